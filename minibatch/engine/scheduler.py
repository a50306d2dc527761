"""Who runs in this iteration, with how many tokens; and what their results change.

Orca (Yu et al., OSDI'22, §3.1) schedules at the granularity of one
*iteration*: after every model step a finished sequence leaves the batch and a
waiting one may join. ``schedule()`` fills a **token budget**
(``max_num_batched_tokens``) with at most ``max_num_seqs`` running sequences:

* a running sequence in **decode** needs 1 token (1 + k under speculation: the
  last sampled token and k drafts to verify);
* a running sequence still in **prefill** needs the rest of its prompt, cut
  into a **chunk** when it does not fit (chunked prefill, Agrawal et al.
  2023, Sarathi §3), so one long prompt cannot stall every decode;
* a waiting sequence is **admitted** when the allocator can hold its tokens
  (prefix-cache hits included), then prefilled like the above.

``order`` decides who spends the budget first: ``"decode-first"`` (running
sequences, then admissions: low latency for those already generating) or
``"prefill-first"`` (admissions first: faster time to first token).

When a running sequence needs a new block and none is free, the scheduler
**preempts by recompute** (vLLM §4.5): the least important running sequence
(last in queue order) loses its blocks and goes back to waiting; it will
prefill its prompt and its output so far again when readmitted. With
``preemption_mode="swap"`` the victim request is instead swapped out whole to the
host pool before the batch is chosen, and swapped back in before it runs again
(``memory_hierarchy.py``, which also runs the prefix cache's host tier).

``update_from_output()`` is the other half (vLLM V1's name): it takes the model
runner's sampled tokens and, per sequence, advances ``num_computed_tokens``,
rolls back rejected drafts, forks n > 1 samples, appends the tokens, applies
stop strings and ``max_tokens``, and frees the blocks of finished sequences.
The static baseline (``static_scheduler.py``) changes only ``schedule()``.

``SchedulerBase`` holds the queues, the moves between them and ``update_from_output``; ``Scheduler`` adds the
choice of each step's batch (``_fill``, ``_schedule_running``, ``_admit``), which exercise 7 is to write
(``exercises/ex7_scheduler.py``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from minibatch.engine.request_queue import CACHE_AWARE_MAX_WAITING, RequestQueue, check_cache_aware
from minibatch.sampling.sampler import find_stop
from minibatch.engine.sequence import Sequence, SequenceStatus
from minibatch.kv.block_allocator import BlockAllocator, NoFreeBlocksError
from minibatch.kv.tree import judged_depths
from minibatch.sampling.structured.matcher import advance

ORDERS = ("decode-first", "prefill-first")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int          # tokens fed to the model this step: a prefill chunk, 1, or 1 + len(spec)
    num_computed_before: int     # seq.num_computed_tokens when scheduled
    phase: str                   # "prefill", "decode" or "resumed"
    block_table: list = field(default_factory=list)       # its physical blocks, for the model runner
    spec_token_ids: list = field(default_factory=list)    # the drafts among the new tokens
    spec_parents: Optional[list] = None                    # a token tree over [root] + spec_token_ids, else None
    placeholder_index: Optional[int] = None                # asynchronous scheduling: where its sampled token goes
                                                           # (the placeholder is appended once scheduled, so
                                                           # ``samples`` is then fixed as it was before)

    @property
    def input_token_ids(self) -> list:
        """What the model is fed: the uncomputed tokens of this chunk, then the drafts."""
        start = self.num_computed_before
        return self.seq.token_ids[start:start + self.num_new_tokens - len(self.spec_token_ids)] + self.spec_token_ids

    @property
    def samples(self) -> bool:
        """Does this chunk reach the end of the sequence? Then its last 1 + k rows are sampled/verified."""
        if self.placeholder_index is not None:
            return True
        return self.num_computed_before + self.num_new_tokens - len(self.spec_token_ids) == len(self.seq)


@dataclass
class SchedulerOutput:
    scheduled: list = field(default_factory=list)        # [ScheduledSeq], batch order
    admitted: list = field(default_factory=list)         # [Sequence]
    preempted: list = field(default_factory=list)        # [Sequence]
    cow_copies: list = field(default_factory=list)       # (src, dst) blocks to copy before the forward
    # The memory hierarchy (memory_hierarchy.py; vLLM V0's names): copies run before the forward, in this order
    blocks_to_swap_out: list = field(default_factory=list)   # (device, host) blocks of requests swapped out
    blocks_to_offload: list = field(default_factory=list)    # (device, host) full blocks copied to the host tier
    blocks_to_swap_in: list = field(default_factory=list)    # (host, device) blocks of requests swapped back in
    blocks_to_load: list = field(default_factory=list)       # (host, device) prefix blocks loaded from the tier
    swapped_out: list = field(default_factory=list)      # [Sequence] swapped out this step
    swapped_in: list = field(default_factory=list)       # [Sequence] swapped in this step
    recomputed_instead: list = field(default_factory=list)   # [Sequence] to swap, but the swap space was full
    padding: list = field(default_factory=list)          # static batching: (block_table, context length) of
                                                         # each finished member, which still computes a token

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_padding_slots(self) -> int:
        return len(self.padding)


class SchedulerBase:
    """The queues, the helpers that move a sequence between them (``_start``, ``_preempt``, ``_unadmit``,
    ``finish``), ``schedule()`` around the choice of the batch, and ``update_from_output``. ``Scheduler``
    adds the choice itself, ``_fill`` (exercise 7 is to write it: ``exercises/ex7_scheduler.py``)."""

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", order: str = "decode-first",
                 cache_aware_max_waiting: int = CACHE_AWARE_MAX_WAITING):
        if order not in ORDERS:
            raise ValueError(f"unknown order {order!r}; choose one of {list(ORDERS)}")
        check_cache_aware(policy, allocator)
        self.allocator = allocator
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.policy, self.order = policy, order
        self.waiting = RequestQueue(policy, cache_aware_max_waiting)
        self.running: list[Sequence] = []
        # Slots a verify may take past a sequence's own tokens: a tree of N drafts and depth d is written to N
        # slots but keeps at most d of them (the engine sets it from its proposer; a chain needs none).
        self.num_lookahead_slots = 0
        # Disaggregated serving's prefill side: told of each finished sequence before its blocks are freed
        # (vLLM's KVConnector.request_finished; minibatch/distributed/kv_transfer.py). None: nobody listens.
        self.kv_connector = None
        # The KV cache's host tier (memory_hierarchy.py): swapping and the prefix cache's host copies. The engine
        # sets it when preemption_mode="swap" or kv_offload_space > 0; None: one pool, preemption by recompute.
        self.hierarchy = None

    # -- queues -------------------------------------------------------------------------
    def check_request(self, seq: Sequence) -> None:
        """Raise ValueError for a request that could never run, before it is queued."""
        need = self.allocator.blocks_needed(len(seq) + seq.params.max_tokens + self.num_lookahead_slots)
        if need > self.allocator.num_blocks:
            raise ValueError(f"request {seq.request_id!r} needs {need} blocks even alone, but the cache has only "
                             f"{self.allocator.num_blocks}: it could never finish")
        if 1 + seq.num_forks_pending > self.max_num_seqs:
            raise ValueError(f"request {seq.request_id!r}: n={seq.params.n} exceeds max_num_seqs={self.max_num_seqs}")

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.add(seq)

    def has_unfinished(self) -> bool:
        return bool(len(self.waiting) or self.running or (self.hierarchy and self.hierarchy.swapped))

    def live_seq_ids(self) -> list:
        """The sequences that hold blocks: the running ones (the static baseline adds its finished members)."""
        return [s.seq_id for s in self.running if self.allocator.has_seq(s.seq_id)]

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a finished or aborted sequence out and return its blocks."""
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        seq.clear_spec()
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if self.hierarchy is not None:
            self.hierarchy.forget(seq)          # a swapped-out sequence's host blocks go too
        if self.kv_connector is not None and self.allocator.has_seq(seq.seq_id):
            self.kv_connector.request_finished(seq, self.allocator.block_table(seq.seq_id))
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Return a finished sequence's blocks (the static baseline holds them until its batch ends)."""
        if self.allocator.has_seq(seq.seq_id):
            self.allocator.free(seq.seq_id)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.allocator.free(seq.seq_id)
        if self.hierarchy is not None:
            self.hierarchy.forget(seq)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.clear_spec()
        seq.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)

    def _unadmit(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Undo this step's admission of ``seq`` (nothing was computed, so it is no preemption);
        returns the tokens of budget it gives back."""
        k = next(j for j, s in enumerate(out.scheduled) if s.seq is seq)
        out.admitted.remove(seq)
        self.allocator.free(seq.seq_id)
        self.running.remove(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        self.add(seq)
        return out.scheduled.pop(k).num_new_tokens

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.waiting.reorder(self.allocator)               # a cache-aware policy's order follows the cache
        if self.hierarchy is not None:                # swap out, or back in, before the batch is chosen
            self.hierarchy.before_fill(self, out)
        self._fill(out)
        if self.hierarchy is not None:
            self.hierarchy.after_fill(self, out)
        now = time.perf_counter()
        for s in out.scheduled:
            s.block_table = self.allocator.block_table(s.seq.seq_id)
            # A tree's drafts are listed parents first, so the first m of them (the budget may cut a proposal)
            # with the first 1 + m parents are a tree again.
            if s.spec_token_ids and s.seq.spec_parents is not None:
                s.spec_parents = s.seq.spec_parents[: 1 + len(s.spec_token_ids)]
            if s.seq.request.metrics.first_scheduled_time is None:
                s.seq.request.metrics.first_scheduled_time = now
        return out

    @staticmethod
    def _seats(seqs) -> int:
        """Seats (towards max_num_seqs) these sequences take: one each, and one per fork still to come (n > 1:
        the children fork off once the prompt is computed)."""
        return sum(1 + s.num_forks_pending for s in seqs)

    def _fill(self, out: SchedulerOutput) -> None:
        """Choose this step's batch into ``out`` (``Scheduler`` and ``StaticScheduler`` each say how).
        (Not an abc.ABC: the student release builds ``Scheduler`` with a metaclass of its own.)"""
        raise TypeError(f"{type(self).__name__} must define _fill(out)")

    def _start(self, seq: Sequence, out: SchedulerOutput) -> None:
        cached = self.allocator.allocate(seq.seq_id, seq.token_ids)
        if self.hierarchy is not None:                # the prefix the device missed, loaded from the host tier
            cached += self.hierarchy.load_back(self.allocator, seq, cached, out)
        seq.num_computed_tokens = seq.num_cached_tokens = cached
        self.waiting.remove(seq, admitted=True)
        self.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        out.admitted.append(seq)

    # -- the results of a step ----------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, runner_output) -> tuple[list, list]:
        """Apply one step's sampled tokens; returns (requests whose output changed, sequences finished)."""
        changed, finished = {}, []
        for i, s in enumerate(out.scheduled):
            seq, toks = s.seq, runner_output.sampled_token_ids[i]
            n_acc = runner_output.num_accepted[i]
            # the K/V written this step: the chunk, minus the drafts the target rejected
            seq.num_computed_tokens = s.num_computed_before + s.num_new_tokens - len(s.spec_token_ids) + n_acc
            if s.spec_token_ids:
                self.allocator.truncate(seq.seq_id, seq.num_computed_tokens)    # roll rejected drafts back
                judged = None if s.spec_parents is None else judged_depths(s.spec_parents,
                                                                             runner_output.accepted_paths[i])
                seq.spec_stats.add(len(s.spec_token_ids), n_acc, len(toks), judged=judged)
            seq.clear_spec()
            if not toks:                                      # mid-prefill: nothing sampled yet
                self.allocator.mark_computed(seq.seq_id, seq.num_computed_tokens, seq.token_ids)
                if self.hierarchy is not None:
                    self.hierarchy.offload(self.allocator, seq)
                continue
            if seq.num_forks_pending:                         # n > 1: the prompt is done, fork the samples
                finished += self._fork(seq, runner_output.forked_token_ids[i])
            finished += self._append(seq, toks)
            changed[seq.request_id] = seq.request
        return self._stamped(changed), finished

    @staticmethod
    def _stamped(changed: dict) -> list:
        """The requests whose output changed, their first-token and finish times stamped now."""
        now = time.perf_counter()
        for req in changed.values():
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if req.finished and req.metrics.finished_time is None:
                req.metrics.finished_time = now
        return list(changed.values())

    def _append(self, seq: Sequence, toks: list) -> list:
        """Append sampled tokens (up to max_tokens), cache the computed blocks, apply stop strings."""
        toks, ended = toks[: seq.params.max_tokens - seq.num_output_tokens], None
        if seq.grammar is not None:                   # structured outputs: the grammar follows, or ends here
            toks, ended = advance(seq.grammar, toks)
            seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq) + len(toks))
        seq.token_ids += toks
        self.allocator.mark_computed(seq.seq_id, seq.num_computed_tokens, seq.token_ids)
        if self.hierarchy is not None:                # write-through: newly full blocks to the host tier
            self.hierarchy.offload(self.allocator, seq)
        cut = find_stop(seq.output_token_ids, seq.params.stop, seq.params.stop_token_ids)
        if cut is not None:
            del seq.token_ids[seq.num_prompt_tokens + cut:]
            self.finish(seq, "stop")
        elif ended is not None:
            self.finish(seq, ended)
        elif seq.num_output_tokens >= seq.params.max_tokens:
            self.finish(seq, "length")
        return [seq] if seq.is_finished else []

    def _fork(self, parent: Sequence, first_tokens: list) -> list:
        """Parallel sampling: n - 1 children share every block of the parent's computed prompt (§4.4);
        each starts with its own first token, sampled from the same logits. Returns those finished."""
        req, finished = parent.request, []
        for i, tok in enumerate(first_tokens, start=1):
            child = Sequence(f"{req.request_id}.{i}", req, i, list(parent.token_ids),
                             status=SequenceStatus.RUNNING, num_computed_tokens=parent.num_computed_tokens,
                             num_cached_tokens=parent.num_cached_tokens)
            self.allocator.fork(parent.seq_id, child.seq_id)          # ref counts up, copy-on-write later
            req.seqs.append(child)
            self._on_fork(child)
            finished += self._append(child, [tok])
        parent.num_forks_pending = 0
        return finished

    def _on_fork(self, child: Sequence) -> None:
        self.running.append(child)


class Scheduler(SchedulerBase):
    """Continuous batching: the running sequences decode (or go on prefilling) and the waiting are admitted,
    every step, within the token budget and ``max_num_seqs``; preemption when the cache is full."""

    def _fill(self, out: SchedulerOutput) -> None:
        """Choose the batch: who runs, with how many tokens (the static baseline overrides this)."""
        budget = self.max_num_batched_tokens
        if self.order == "prefill-first":
            budget = self._admit(out, budget)
            self._schedule_running(out, budget, skip=set(out.admitted))
        else:
            budget = self._schedule_running(out, budget, skip=set())
            self._admit(out, budget)

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
                        budget += self._unadmit(victim, out)
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

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting sequences in queue order while budget, seats and blocks allow; each gets its first
        chunk. Returns the budget left."""
        if self.hierarchy is not None and self.hierarchy.admission_paused():
            return budget                                     # a request is swapped out: it goes first (§4.5)
        while len(self.waiting) and budget > 0:
            seq = self.waiting.peek()
            if self._seats(self.running) + 1 + seq.num_forks_pending > self.max_num_seqs:   # n > 1: n seats
                break
            if seq.num_output_placeholders or not self.allocator.can_allocate(seq.token_ids):
                break            # head of line waits (no starvation under FCFS); a token in flight first lands
            self._start(seq, out)
            n = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens, seq.phase))
            budget -= n
        return budget
