"""The grader's hidden workloads for the scheduling project (instructor only: a student release leaves it out).

Three workloads of 120 requests (ten bursts each), three times the practice size: the score is the headroom closed,
averaged over them (exercises/project.py), so one request moves it by under 1 %. ``ShortestJobFirst`` is the
instructor's proof that full goodput marks are within reach: admission by the least work left (prompt to compute
and tokens to generate), about 15 lines, closes about a third of the headroom here (tests/test_grader.py checks that
it earns every goodput point); it is not the best policy, and a student's may do better."""
from minibatch.engine.scheduler import ScheduledSeq, Scheduler

SEEDS = (20261205, 20261212, 20261219)
NUM_REQUESTS = 120
SEED = SEEDS[0]                       # the first of them (older callers)


class ShortestJobFirst(Scheduler):
    """Decode-first continuous batching whose admission takes, among the waiting requests the pool can hold now,
    the one with the least work left (uncomputed tokens plus tokens still to generate), not the head of the queue."""

    def _admit(self, out, budget):
        def work(s):
            return s.num_uncomputed_tokens + s.params.max_tokens - s.num_output_tokens
        while len(self.waiting) and budget > 0:
            if self._seats(self.running) + 1 > self.max_num_seqs:
                break
            seq = next((s for s in sorted(self.waiting, key=work) if self.allocator.can_allocate(s.token_ids)), None)
            if seq is None:
                break
            self._start(seq, out)
            n = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens, seq.phase))
            budget -= n
        return budget
