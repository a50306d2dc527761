"""Mutant (exercise 7): when the head of the queue does not fit the free blocks, admission skips to the
requests behind it: small requests keep overtaking a long one, which can starve (and FCFS order is broken)."""
from minibatch.engine.scheduler import ScheduledSeq, Scheduler as Reference  # noqa: F401
from minibatch.kv.block_allocator import NoFreeBlocksError  # noqa: F401


class Scheduler(Reference):
    def _admit(self, out, budget):
        for seq in list(self.waiting):
            if budget <= 0:
                break
            if self._seats(self.running) + 1 + seq.num_forks_pending > self.max_num_seqs:
                break
            if not self.allocator.can_allocate(seq.token_ids):
                continue                                   # BUG: not break
            self._start(seq, out)
            n = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens, seq.phase))
            budget -= n
        return budget
