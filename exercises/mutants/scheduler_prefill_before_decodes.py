"""Mutant (exercise 7): the batch always admits first and decodes with what is left, whatever the order asks:
under the default decode-first order a long admission starves the running sequences' decodes."""
from minibatch.engine.scheduler import ScheduledSeq, Scheduler as Reference  # noqa: F401
from minibatch.kv.block_allocator import NoFreeBlocksError  # noqa: F401


class Scheduler(Reference):
    def _fill(self, out):
        budget = self._admit(out, self.max_num_batched_tokens)     # BUG: self.order is ignored
        self._schedule_running(out, budget, skip=set(out.admitted))
