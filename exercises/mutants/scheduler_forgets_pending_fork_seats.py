"""Mutant (exercise 7): admission counts each running sequence as one seat, forgetting the children a sequence
with n > 1 samples will fork once its prompt is computed: max_num_seqs is exceeded after the fork."""
from minibatch.engine.scheduler import ScheduledSeq, Scheduler as Reference  # noqa: F401
from minibatch.kv.block_allocator import NoFreeBlocksError  # noqa: F401


class Scheduler(Reference):
    def _admit(self, out, budget):
        while len(self.waiting) and budget > 0:
            seq = self.waiting.peek()
            if len(self.running) + 1 + seq.num_forks_pending > self.max_num_seqs:   # BUG: not self._seats(...)
                break
            if not self.allocator.can_allocate(seq.token_ids):
                break
            self._start(seq, out)
            n = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens, seq.phase))
            budget -= n
        return budget
