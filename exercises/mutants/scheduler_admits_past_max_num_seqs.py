"""Mutant (exercise 7): admission checks blocks and budget but never the seats: more than max_num_seqs
sequences run at once."""
from minibatch.engine.scheduler import ScheduledSeq, Scheduler as Reference  # noqa: F401
from minibatch.kv.block_allocator import NoFreeBlocksError  # noqa: F401


class Scheduler(Reference):
    def _admit(self, out, budget):
        while len(self.waiting) and budget > 0:
            seq = self.waiting.peek()                     # BUG: no max_num_seqs check
            if not self.allocator.can_allocate(seq.token_ids):
                break
            self._start(seq, out)
            n = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens, seq.phase))
            budget -= n
        return budget
