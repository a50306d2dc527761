"""Exercise 7: one step of the continuous-batching scheduler (Orca, Yu et al., OSDI'22, Sec. 3.1; chunked
prefill, Sarathi, Agrawal et al. 2023; preemption by recompute, vLLM Sec. 4.5).

Every iteration the scheduler chooses the batch: which sequences run and with how many tokens each, within a
**token budget** (``self.max_num_batched_tokens``: tokens fed to the model this step) and ``self.max_num_seqs``
(sequences running at once). ``SchedulerBase`` (in ``minibatch/engine/scheduler.py``, read it first) gives
you the queues and the moves between them; you write the choice:

    self.running            the running sequences (a list, in the order they started)
    self.waiting            the waiting queue (request_queue.py): self.waiting.peek() is the next to admit;
                            self.waiting.key(seq) ranks any sequence, smaller = more important (FCFS: earlier
                            arrival; priority policy: lower priority value, then earlier)
    self.allocator          the block allocator: can_allocate(tokens), append_slots(seq_id, n) (raises
                            NoFreeBlocksError when no block is free; returns copy-on-write pairs)
    self._start(seq, out)   admit seq: allocate its blocks (its cached prefix counts as computed), move it from
                            waiting to running, add it to out.admitted
    self._preempt(seq, out) preempt a running seq: free its blocks, back to waiting (it recomputes everything
                            when readmitted), add it to out.preempted
    self._unadmit(seq, out) undo this step's admission of seq (remove its entry from out.scheduled too); returns
                            the tokens of budget it gives back
    ScheduledSeq(seq, num_new_tokens, seq.num_computed_tokens, seq.phase, spec_token_ids=[...])
                            one entry of the batch; append them to out.scheduled in batch order

A sequence's state: ``seq.num_computed_tokens`` of its ``len(seq)`` tokens have K/V in the cache;
``seq.num_uncomputed_tokens`` = the rest. It is in **decode** when exactly 1 token is uncomputed (the last
sampled one); then it runs 1 + len(drafts) tokens (``seq.spec_token_ids``: a proposer's drafts, to verify) and
needs slots for them: ``append_slots``. Otherwise it is in **prefill** (its prompt, or after a preemption its
prompt and output so far): it runs its next chunk, at most what the budget has left; its blocks were all
allocated at admission.

    budget 8, max_num_seqs 2; A (6-token prompt), B (3), C (10) arrive in that order
    step 1: A prefill 6, B prefill 2 (the budget has 2 left: B's prompt is cut into a chunk)
    step 2: A decode 1, B prefill 1 (its last prompt token); C waits: 2 sequences already run
    ...

Run the tests:  MINIBATCH_STUDENT=scheduler python -m pytest tests/exercises -m ex7
Run the engine on it:  exercises.patch_engine("scheduler") (exercises/README.md)
"""
from __future__ import annotations

from minibatch.engine.scheduler import ScheduledSeq, SchedulerBase, SchedulerOutput  # noqa: F401
from minibatch.kv.block_allocator import NoFreeBlocksError  # noqa: F401


class Scheduler(SchedulerBase):
    def _fill(self, out: SchedulerOutput) -> None:
        """Fill ``out`` with this step's batch, starting from the whole budget (``self.max_num_batched_tokens``).

        ``self.order == "decode-first"`` (the default): the running sequences first (``_schedule_running``),
        then admissions with the budget left (``_admit``). ``"prefill-first"``: admissions first, then the
        running sequences, except the ones admitted just now (``skip``: they have had their chunk)."""
        raise NotImplementedError("Exercise 7: Scheduler._fill (exercises/ex7_scheduler.py)")

    def _schedule_running(self, out: SchedulerOutput, budget: int, skip: set, preempt: bool = True) -> int:
        """Schedule the running sequences not in ``skip``, most important first (sorted by
        ``self.waiting.key``), while budget is left; returns the budget left.

        * decode: 1 + its drafts, the drafts cut so the budget is never exceeded
          (``seq.spec_token_ids[:budget - 1]``); ask the allocator for the slots
          (``self.allocator.append_slots(seq.seq_id, n)``) and add the pairs it returns to ``out.cow_copies``;
        * prefill: its next chunk, min(seq.num_uncomputed_tokens, budget) tokens (no new blocks needed).

        When ``append_slots`` raises NoFreeBlocksError: if ``preempt`` is False (static batching), let it
        propagate. Else preempt the **least important** (largest key) among the sequences not yet scheduled
        this step (this one included) and those admitted this step (``out.admitted``: under prefill-first a
        newcomer must not push out a more important sequence that is already running): an admitted one is
        unadmitted (``self._unadmit``; add back the budget it returns), a running one preempted
        (``self._preempt``), and it leaves this step's queue. Then try the same sequence again (unless it was
        the victim): the victim's blocks are free now."""
        raise NotImplementedError("Exercise 7: Scheduler._schedule_running (exercises/ex7_scheduler.py)")

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting sequences, in queue order (``self.waiting.peek()``), while budget is left; returns the
        budget left. Stop at the first that cannot start:

        * the seats taken would exceed ``self.max_num_seqs``: ``self._seats(self.running)`` (a running
          sequence with n > 1 samples that has not forked yet takes its children's seats already) plus this
          one's, ``1 + seq.num_forks_pending``;
        * the allocator cannot hold its tokens now (``self.allocator.can_allocate(seq.token_ids)``).

        Stopping at the head of the queue (not skipping to a smaller request behind it) is what keeps a long
        request from starving. ``self._start(seq, out)`` admits it; then schedule its first chunk:
        min(seq.num_uncomputed_tokens, budget) (after ``_start``: a prefix-cache hit is already computed)."""
        raise NotImplementedError("Exercise 7: Scheduler._admit (exercises/ex7_scheduler.py)")
