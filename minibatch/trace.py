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
from dataclasses import asdict, dataclass, field
from typing import Optional

PHASES = ("prefill", "decode", "resumed")


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
    accepted: int = 0               # ... of which accepted
    bonus: int = 0                  # 1 if a bonus / correction token was added (decode steps)
    new_token_ids: list = field(default_factory=list)   # tokens appended this step (may be empty mid-prefill)


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
    note: Optional[str] = None

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
