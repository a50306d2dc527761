"""Mutant (exercise 7): when no block is free it preempts the most important sequence (the smallest queue key: the
earliest arrival, the lowest priority value) instead of the least important."""
from minibatch.engine.scheduler import ScheduledSeq, Scheduler as Reference  # noqa: F401
from minibatch.kv.block_allocator import NoFreeBlocksError  # noqa: F401


class Scheduler(Reference):
    def _schedule_running(self, out, budget, skip, preempt=True):
        queue = sorted((s for s in self.running if s not in skip), key=self.waiting.key)
        i = 0
        while i < len(queue) and budget > 0:
            seq = queue[i]
            if seq.num_uncomputed_tokens == 1:
                spec = seq.spec_token_ids[: budget - 1]
                try:
                    out.cow_copies += self.allocator.append_slots(seq.seq_id, 1 + len(spec))
                except NoFreeBlocksError:
                    if not preempt:
                        raise
                    victim = min(queue[i:] + out.admitted, key=self.waiting.key)   # BUG: min, not max
                    if victim in out.admitted:
                        budget += self._unadmit(victim, out)
                    else:
                        queue.remove(victim)
                        self._preempt(victim, out)
                    continue
                n = 1 + len(spec)
            else:
                spec, n = [], min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens, seq.phase, spec_token_ids=spec))
            budget -= n
            i += 1
        return budget
