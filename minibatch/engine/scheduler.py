"""Who runs in this iteration, and with how many tokens.

Orca (Yu et al., OSDI'22, §3.1) schedules at the granularity of one
*iteration*: after every model step a finished sequence leaves the batch and a
waiting one may join. Each step here fills a **token budget**
(``max_num_batched_tokens``) and at most ``max_num_seqs`` running sequences:

* a running sequence in **decode** needs 1 token (1 + k under speculation);
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
(lowest priority, latest arrival) loses its blocks and goes back to waiting;
it will prefill its prompt and its output so far again when readmitted.

``scheduling="static"`` is the baseline: it forms a batch of up to
``max_num_seqs`` requests in queue order (arrival order under FCFS; with
``policy="priority"``, priority first), reserving blocks for their full
length (so it never preempts), runs it until every member is done, and admits
nobody meanwhile; a finished member keeps its slot and computes a padding
token that is thrown away (the engine does that: a rectangular batch cannot shrink).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from minibatch.kv.block_allocator import BlockAllocator, NoFreeBlocksError
from minibatch.engine.sequence import Sequence, SequenceStatus

POLICIES = ("fcfs", "priority")
ORDERS = ("decode-first", "prefill-first")
SCHEDULINGS = ("continuous", "static")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int              # tokens fed to the model this step (chunk, 1, or 1 + k)
    phase: str                   # "prefill", "decode" or "resumed"
    num_computed_before: int
    spec_token_ids: list = field(default_factory=list)   # the draft tokens among num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list = field(default_factory=list)        # [ScheduledSeq], batch order
    admitted: list = field(default_factory=list)         # [Sequence]
    preempted: list = field(default_factory=list)        # [Sequence]
    cow_copies: list = field(default_factory=list)       # (src, dst) blocks to copy before the forward
    num_padding_slots: int = 0                           # static: finished members holding a slot

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", order: str = "decode-first", scheduling: str = "continuous"):
        for name, value, allowed in (("policy", policy, POLICIES), ("order", order, ORDERS),
                                     ("scheduling", scheduling, SCHEDULINGS)):
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; choose one of {list(allowed)}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < allocator.block_size:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) is smaller than one block "
                             f"({allocator.block_size} tokens)")
        self.allocator = allocator
        self.max_num_seqs, self.token_budget = max_num_seqs, max_num_batched_tokens
        self.policy, self.order, self.scheduling = policy, order, scheduling
        self.waiting: list[Sequence] = []                # kept sorted by policy order
        self.running: list[Sequence] = []
        self.static_batch: list[Sequence] = []           # static: the batch being run, finished members included

    # -- queues -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        keys = [s.sort_key(self.policy) for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, seq.sort_key(self.policy)), seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and return its blocks."""
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if self.allocator.has_seq(seq.seq_id):
            self.allocator.free(seq.seq_id)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.allocator.free(seq.seq_id)
        self.running.remove(seq)
        seq.num_computed, seq.spec_token_ids = 0, []
        seq.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)

    def _unadmit(self, seq: Sequence, out: SchedulerOutput, budget: list) -> None:
        """Undo this step's admission of ``seq``: its chunk, its budget and its blocks go back, and it
        waits again as if never admitted (nothing was computed, so nothing counts as preempted)."""
        k = next(j for j, s in enumerate(out.scheduled) if s.seq is seq)
        budget[0] += out.scheduled.pop(k).num_tokens
        out.admitted.remove(seq)
        self.allocator.free(seq.seq_id)
        self.running.remove(seq)
        seq.num_computed = seq.num_cached_prefix = 0
        self.add(seq)

    # -- one step -------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = [self.token_budget]                      # a list so the helpers can spend it
        if self.scheduling == "static":
            self._schedule_static(out, budget)
        elif self.order == "prefill-first":
            self._admit(out, budget)
            self._schedule_running(out, budget, skip=set(out.admitted))
        else:
            self._schedule_running(out, budget, skip=set())
            self._admit(out, budget)
        return out

    def _phase(self, seq: Sequence) -> str:
        if seq.num_uncomputed == 1 and seq.output_ids:
            return "decode"
        return "resumed" if seq.num_preemptions and seq.output_ids else "prefill"

    def _schedule_running(self, out: SchedulerOutput, budget: list, skip: set, preempt: bool = True) -> None:
        queue = sorted((s for s in self.running if s not in skip), key=lambda s: s.sort_key(self.policy))
        i = 0
        while i < len(queue) and budget[0] > 0:
            seq = queue[i]
            phase = self._phase(seq)
            if phase == "decode":
                spec = seq.spec_token_ids[: budget[0] - 1]
                try:                                          # slots for the fed token (+ drafts)
                    out.cow_copies += self.allocator.append_slots(seq.seq_id, [seq.token_ids[-1]] + spec)
                except NoFreeBlocksError:
                    if not preempt:
                        raise
                    # the least important among those not yet scheduled and (prefill-first) those admitted
                    # this step: a newcomer must not push out a more important sequence already running
                    victim = max(queue[i:] + out.admitted, key=lambda s: s.sort_key(self.policy))
                    if victim in out.admitted:
                        self._unadmit(victim, out, budget)
                    else:
                        queue.remove(victim)
                        self._preempt(victim, out)
                    continue                                  # retry seq (unless it was the victim)
                n = 1 + len(spec)
            else:                                             # prefill chunk: blocks were allocated at admission
                spec, n = [], min(seq.num_uncomputed, budget[0])
            out.scheduled.append(ScheduledSeq(seq, n, phase, seq.num_computed, spec))
            budget[0] -= n
            i += 1

    def _admit(self, out: SchedulerOutput, budget: list) -> None:
        while self.waiting and budget[0] > 0:
            seq = self.waiting[0]
            seats = 1 + seq.fork_pending                      # n > 1 takes n slots once forked
            if len(self.running) + seats > self.max_num_seqs:
                break
            if not self.allocator.can_allocate(seq.token_ids):
                break                                         # head of line waits: no starvation under FCFS
            self._start(seq, out)
            n = min(seq.num_uncomputed, budget[0])
            out.scheduled.append(ScheduledSeq(seq, n, self._phase(seq), seq.num_computed))
            budget[0] -= n

    def _start(self, seq: Sequence, out: SchedulerOutput) -> None:
        cached = self.allocator.allocate(seq.seq_id, seq.token_ids)
        seq.num_computed = seq.num_cached_prefix = cached
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        out.admitted.append(seq)

    def _schedule_static(self, out: SchedulerOutput, budget: list) -> None:
        if all(s.is_finished for s in self.static_batch):   # the whole batch is done: form the next one
            self.static_batch = []
            reserved = 0
            for seq in list(self.waiting):                    # queue order: arrival under FCFS
                if len(self.static_batch) >= self.max_num_seqs:
                    break
                n = 1 + seq.fork_pending
                need = self.static_reservation(seq)
                if reserved + need > self.allocator.num_free_blocks or \
                        len(self.static_batch) + n > self.max_num_seqs:
                    break
                reserved += need
                self._start(seq, out)
                self.static_batch.append(seq)
        out.num_padding_slots = sum(s.is_finished for s in self.static_batch)
        self._schedule_running(out, budget, skip=set(), preempt=False)

    def static_reservation(self, seq: Sequence) -> int:
        """Blocks a static batch sets aside for ``seq`` at its full length: its own prompt + max_tokens,
        and for each of its n - 1 forks everything but the full prompt blocks they share."""
        a = self.allocator
        whole = a.blocks_needed(len(seq.prompt_ids) + seq.params.max_tokens)
        return whole + seq.fork_pending * (whole - len(seq.prompt_ids) // a.block_size)

    def on_fork(self, child: Sequence) -> None:
        """A parallel-sampling child joins the running set (and the static batch)."""
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        if self.scheduling == "static":
            self.static_batch.append(child)
