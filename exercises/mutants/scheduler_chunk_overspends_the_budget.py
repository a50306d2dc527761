"""Mutant (exercise 7): an admitted sequence's first chunk is its whole prompt, not what the budget has left:
a long prompt blows the token budget (no chunked prefill for newcomers)."""
from minibatch.engine.scheduler import ScheduledSeq, Scheduler as Reference  # noqa: F401
from minibatch.kv.block_allocator import NoFreeBlocksError  # noqa: F401


class Scheduler(Reference):
    def _admit(self, out, budget):
        while len(self.waiting) and budget > 0:
            seq = self.waiting.peek()
            if self._seats(self.running) + 1 + seq.num_forks_pending > self.max_num_seqs:
                break
            if not self.allocator.can_allocate(seq.token_ids):
                break
            self._start(seq, out)
            n = seq.num_uncomputed_tokens                 # BUG: not min(..., budget)
            out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens, seq.phase))
            budget -= n
        return budget
