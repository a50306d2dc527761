"""Mutant (exercise 7): un-admits a newcomer (prefill-first) but never adds back the budget its chunk had taken:
the sequences after it in the step go short."""
from minibatch.engine.scheduler import ScheduledSeq, Scheduler as Reference, SchedulerOutput  # noqa: F401
from minibatch.kv.block_allocator import NoFreeBlocksError  # noqa: F401


class Scheduler(Reference):
    def _schedule_running(self, out: SchedulerOutput, budget: int, skip: set, preempt: bool = True) -> int:
        """Schedule the running sequences (but those in ``skip``), most important first, while budget is left:
        a decode gets 1 + its drafts (cut to the budget) and new slots, a prefill its next chunk. With no
        block free, preempt the least important (or, when ``preempt`` is False, let the error out).
        Returns the budget left."""
        queue = sorted((s for s in self.running if s not in skip), key=self.waiting.key)
        i = 0
        while i < len(queue) and budget > 0:
            seq = queue[i]
            if seq.num_uncomputed_tokens == 1:                # decode: the last token (+ drafts to verify)
                spec = seq.spec_token_ids[: budget - 1]
                try:
                    out.cow_copies += self.allocator.append_slots(seq.seq_id, 1 + len(spec))
                except NoFreeBlocksError:
                    if not preempt:
                        raise
                    # the least important among those not yet scheduled and (prefill-first) those admitted
                    # this step: a newcomer must not push out a more important sequence already running
                    victim = max(queue[i:] + out.admitted, key=self.waiting.key)
                    if victim in out.admitted:
                        self._unadmit(victim, out)          # BUG: the budget it gives back is lost
                    else:
                        queue.remove(victim)
                        self._preempt(victim, out)
                    continue                                  # retry seq (unless it was the victim)
                n = 1 + len(spec)
            else:                                             # prefill chunk: blocks were allocated at admission
                spec, n = [], min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens, seq.phase, spec_token_ids=spec))
            budget -= n
            i += 1
        return budget
