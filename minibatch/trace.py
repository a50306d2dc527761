"""The step trace: what one engine iteration did, as plain data.

Every ``Engine.step()`` builds one ``StepTrace`` and hands it to each hook
registered with ``engine.add_hook(fn)``. Renderers (``minibatch.viz``), metrics
and lectures read traces, never the engine's private state, so a run recorded
to JSON replays anywhere without a model (the event-log idea of
LLM-Training-Puzzles: the model never draws itself).

Vocabulary: a *sequence* is one generation stream (a request with n > 1 has n
sequences, ids ``"<request_id>"`` for n = 1 and ``"<request_id>.<i>"`` else).
Its *phase* this step is ``prefill`` (a chunk of its prompt), ``decode`` (one
new token, or 1 + k under speculation) or ``resumed`` (a prefill that
recomputes the KV of a sequence preempted earlier).
"""
from __future__ import annotations

import json
import pathlib
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from minibatch.kv.tree import depths

PHASES = ("prefill", "decode", "resumed")
RADIX_TEXT_TOKENS = 8               # a radix node's first tokens kept in the trace (the view's label)


@dataclass
class SeqStep:
    """One sequence scheduled in this step."""
    seq_id: str
    request_id: str
    phase: str                      # one of PHASES
    num_tokens: int                 # tokens fed through the model for it this step
    num_computed_before: int        # tokens whose KV was already in the cache before the step
    num_prompt_tokens: int
    num_output_tokens: int          # after this step
    priority: int = 0
    proposed: int = 0               # speculative decoding: draft tokens verified this step
    accepted: int = 0               # ... of which accepted; a verify step then emits accepted + 1 tokens:
    bonus: int = 0                  # 1 if every draft was accepted (a tree: the path reached a leaf), so the +1
                                    # is a bonus token from the target's next position; 0 with proposed > 0:
                                    # it is a correction token
    new_token_ids: list = field(default_factory=list)   # tokens appended this step (may be empty mid-prefill)
    draft_token_ids: list = field(default_factory=list) # the drafts verified this step (the first `accepted` kept)
    draft_parents: list = field(default_factory=list)   # a token tree: parents of [root] + drafts ([] = a chain;
                                                        # kv/tree.py), so draft i is node i + 1
    accepted_path: list = field(default_factory=list)   # a tree: the accepted nodes [0, c1, ..., c_accepted]
    root_token_id: Optional[int] = None                 # drafts verified: the token before them (a tree's root,
                                                        # node 0: the last accepted token; None without drafts)


@dataclass
class StepTrace:
    step: int                       # 0, 1, 2, ...
    time: float                     # seconds since the engine was created, at the step's start
    duration: float                 # seconds the step took
    scheduling: str                 # "continuous" or "static"
    scheduled: list                 # [SeqStep], in batch order
    admitted: list                  # seq ids that became running this step
    preempted: list                 # seq ids preempted (KV freed, back to waiting)
    finished: list                  # seq ids that finished this step
    waiting: list                   # seq ids waiting after the step, queue order
    running: list                   # seq ids running after the step
    block_tables: dict              # seq id -> [physical block ids], every live sequence after the step
    num_blocks: int
    block_size: int
    ref_counts: list                # [num_blocks] after the step
    cached_blocks: list             # block ids holding a prefix-cache entry (in use or free)
    num_free_blocks: int            # ref count 0 (cached-but-free blocks count as free)
    num_batched_tokens: int         # tokens in this step's flat batch
    token_budget: int               # max_num_batched_tokens
    max_num_seqs: int
    num_padding_slots: int = 0      # static batching: batch slots held by finished sequences
    prefix_cache_hits: int = 0      # cumulative blocks reused from the prefix cache
    prefix_cache_queries: int = 0   # cumulative full blocks looked up
    speculative_method: Optional[str] = None   # the proposer ("draft", "ngram", ...), None without speculation
    num_speculative_tokens: int = 0            # its k
    propose_duration: float = 0.0              # seconds of ``duration`` the proposer took (drafting for the next step)
    note: Optional[str] = None
    drafted: list = field(default_factory=list)        # what the proposer drafted after this step, per sequence:
                                                       # [drafts, depth (a chain: = drafts), context] (perf/cost.py)
    simulated_time: Optional[float] = None     # EngineConfig.simulate: the simulated clock at the step's start (s)
    simulated_duration: Optional[float] = None # ... and the step's duration on it (minibatch/perf/cost.py)
    cpu_duration: Optional[float] = None       # CPU seconds this process spent in the step (time.process_time):
                                               # ``duration`` without the waits of a shared machine (bench/validate.py)
    instance: Optional[str] = None             # disaggregated serving: "prefill" or "decode" (disagg/instance.py)
    async_scheduling: bool = False             # scheduled by the batch queue (EngineConfig.async_scheduling): the
                                               # simulated clock overlaps the host's time with the device's
    # Where the step's time went, [start, end] in seconds since the engine was created: the CPU's scheduling, the
    # model's forward (with sampling, in the synchronous engine; the forward alone on the model's thread under
    # asynchronous scheduling, where it overlaps the next step's schedule and the previous one's update), and the
    # CPU's update (engine.py; under asynchronous scheduling from the forward's result on: sampling, placeholders
    # resolved, the next forward launched, update_from_output). viz/lanes.py draws them as two lanes, CPU and model.
    schedule_span: list = field(default_factory=list)
    forward_span: list = field(default_factory=list)
    update_span: list = field(default_factory=list)
    # The memory hierarchy (engine/memory_hierarchy.py, kv/host_pool.py); all empty / 0 without a host pool
    swapped_out: list = field(default_factory=list)         # seq ids swapped out to the host pool this step
    swapped_in: list = field(default_factory=list)          # seq ids swapped back in this step
    recomputed_instead: list = field(default_factory=list)  # seq ids to swap, preempted by recompute: swap space full
    host_block_tables: dict = field(default_factory=dict)   # seq id -> [host block ids], every swapped-out sequence
    offloaded_blocks: list = field(default_factory=list)    # host block ids holding a host-tier (prefix) copy
    num_host_blocks: int = 0
    num_free_host_blocks: int = 0
    offload_hits: int = 0           # cumulative blocks loaded back from the host tier instead of recomputed
    offload_queries: int = 0        # cumulative blocks looked up in the host tier (they missed the device pool)
    blocks_to_host: int = 0         # blocks copied device -> host this step (swapped out + offloaded)
    blocks_to_device: int = 0       # blocks copied host -> device this step (swapped in + loaded back)
    bytes_to_host: int = 0          # ... and their bytes, each way (every layer's K and V)
    bytes_to_device: int = 0
    # The radix tree (prefix_cache="radix", kv/radix_cache.py) after the step, parents first, the root first; empty
    # with the hash chain: [node id, parent id (-1: the root), tokens on its edge, its first RADIX_TEXT_TOKENS
    # token ids, [its blocks, one a page], lock_ref, evictable leaf (no children and lock_ref 0: evict's next)]
    radix_nodes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StepTrace":
        d = dict(d)
        d["scheduled"] = [SeqStep(**s) for s in d["scheduled"]]
        return cls(**d)


class TraceRecorder:
    """A hook that keeps every trace:  rec = TraceRecorder(); engine.add_hook(rec)."""

    def __init__(self, traces=None, meta: Optional[dict] = None):
        self.traces: list[StepTrace] = list(traces or [])
        self.meta = dict(meta or {})

    def __call__(self, trace: StepTrace) -> None:
        self.traces.append(trace)

    def __len__(self):
        return len(self.traces)

    def save(self, path) -> None:
        data = {"format": "minibatch-trace/1", "meta": self.meta, "traces": [t.to_dict() for t in self.traces]}
        pathlib.Path(path).write_text(json.dumps(data))

    @classmethod
    def load(cls, path) -> "TraceRecorder":
        data = json.loads(pathlib.Path(path).read_text())
        if data.get("format") != "minibatch-trace/1":
            raise ValueError(f"{path}: not a minibatch trace (format {data.get('format')!r})")
        return cls([StepTrace.from_dict(t) for t in data["traces"]], data.get("meta"))


def make_trace(engine, out, runner_output, t_start: float, propose_duration: float = 0.0) -> StepTrace:
    """The trace of the step just taken, from the scheduler's output, the runner's and the state after."""
    a, sched = engine.allocator, engine.scheduler
    steps = []
    paths = runner_output.accepted_paths or [[] for _ in out.scheduled]
    for s, toks, acc, path in zip(out.scheduled, runner_output.sampled_token_ids, runner_output.num_accepted, paths):
        k = len(s.spec_token_ids)
        c, ids = s.num_computed_before, s.seq.token_ids      # the root is the token at c (a stop string that cut
        root = ids[c] if k and c < len(ids) else None        # the output before it leaves it unknown)
        if s.spec_parents is not None:        # a tree: the +1 is a bonus when the accepted path reached a leaf
            bonus = int(k > 0 and path[-1] not in s.spec_parents)
        else:
            bonus = int(k > 0 and acc == k)
        steps.append(SeqStep(s.seq.seq_id, s.seq.request_id, s.phase, s.num_new_tokens, s.num_computed_before,
                             s.seq.num_prompt_tokens, s.seq.num_output_tokens, s.seq.request.priority,
                             proposed=k, accepted=acc, bonus=bonus, new_token_ids=list(toks),
                             draft_token_ids=list(s.spec_token_ids), draft_parents=list(s.spec_parents or []),
                             accepted_path=list(path), root_token_id=root))
    live = sched.live_seq_ids()
    spec = engine.config.speculative_config or {}
    return StepTrace(
        step=engine.step_count, time=t_start - engine.t0, duration=time.perf_counter() - t_start,
        scheduling=engine.config.scheduling, scheduled=steps,
        admitted=[s.seq_id for s in out.admitted], preempted=[s.seq_id for s in out.preempted],
        finished=[s.seq.seq_id for s in out.scheduled if s.seq.is_finished],
        waiting=[s.seq_id for s in sched.waiting], running=[s.seq_id for s in sched.running],
        block_tables={sid: a.block_table(sid) for sid in live},
        num_blocks=a.num_blocks, block_size=a.block_size, ref_counts=a.ref_counts(),
        cached_blocks=a.cached_block_ids(), num_free_blocks=a.num_free_blocks,
        num_batched_tokens=out.num_batched_tokens, token_budget=sched.max_num_batched_tokens,
        max_num_seqs=sched.max_num_seqs, num_padding_slots=out.num_padding_slots,
        prefix_cache_hits=a.hits, prefix_cache_queries=a.queries,
        speculative_method=spec.get("method"), num_speculative_tokens=spec.get("num_speculative_tokens", 0),
        propose_duration=propose_duration, drafted=_drafted(sched.running), radix_nodes=_radix_nodes(a),
        async_scheduling=bool(getattr(engine.config, "async_scheduling", False)), **_hierarchy(engine, out))


def _radix_nodes(allocator) -> list:
    """The radix tree as plain rows (StepTrace.radix_nodes); [] for an allocator without one."""
    if getattr(allocator, "prefix_cache", "hash") != "radix":
        return []
    tree, root = allocator.tree, allocator.tree.root_node
    rows = [[root.id, -1, 0, [], [], root.lock_ref, False]]
    for n in tree.nodes():                     # parents first
        rows.append([n.id, n.parent.id, len(n.key), list(n.key[:RADIX_TEXT_TOKENS]), list(n.value), n.lock_ref,
                     not n.children and n.lock_ref == 0])
    return rows


def _hierarchy(engine, out) -> dict:
    """The memory hierarchy's fields of the trace (none without a host pool)."""
    host = getattr(engine, "host_pool", None)
    if host is None:
        return {}
    to_host = len(out.blocks_to_swap_out) + len(out.blocks_to_offload)
    to_device = len(out.blocks_to_swap_in) + len(out.blocks_to_load)
    per = engine.bytes_per_block                      # one block: every layer's K and V
    return dict(swapped_out=[s.seq_id for s in out.swapped_out], swapped_in=[s.seq_id for s in out.swapped_in],
                recomputed_instead=[s.seq_id for s in out.recomputed_instead],
                host_block_tables=host.block_tables(), offloaded_blocks=host.offloaded_blocks(),
                num_host_blocks=host.num_blocks, num_free_host_blocks=host.num_free_blocks,
                offload_hits=host.offload_hits, offload_queries=host.offload_queries,
                blocks_to_host=to_host, blocks_to_device=to_device, bytes_to_host=to_host * per,
                bytes_to_device=to_device * per)


def _drafted(running) -> list:
    """[drafts, depth, context] of each running sequence holding drafts for the next step."""
    return [[len(s.spec_token_ids), max(depths(s.spec_parents)) if s.spec_parents else len(s.spec_token_ids),
             s.num_computed_tokens] for s in running if s.spec_token_ids]
