"""Mutant (exercise 11, in exercise 7's file; exercise 7's own tests pass it): reads "preempted: it recomputes everything when readmitted" as "ignore
what the cache gives it back": a readmitted sequence is scheduled from token 0, though its own computed blocks
were still cached and ``_start`` found them. The text stays right (the same K/V is written again), so exercise
7's tests, on a pool without a prefix cache, pass it; with exercise 6's cache a preemption costs the whole
recompute again."""
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
            if seq.num_preemptions:               # BUG: a readmitted sequence recomputes its cached blocks too
                seq.num_computed_tokens = 0
            n = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens, seq.phase))
            budget -= n
        return budget
