"""A request and its sequences: the one place their state lives.

State machine (vLLM's, with preemption by recompute, Kwon et al. 2023 §4.5):

    WAITING --admit--> RUNNING --stop / length / abort--> FINISHED
       ^                 |  ^
       +----preempt------+  |   (recompute: its blocks are freed; on readmission the
                         |  |    prompt *and* the tokens generated so far are prefilled again)
              swap out   v  | swap in
                        SWAPPED  (preemption_mode="swap": its blocks wait in the host pool,
                                  host_pool.py, and are copied back before it runs again)

The invariant that makes chunked prefill, decode, preemption and speculation one
mechanism (vLLM V1's ``num_computed_tokens``): the first ``num_computed_tokens`` of
``token_ids`` have their K/V in the cache; a step feeds the model some of the rest.
Plain decode is the case ``len(token_ids) - num_computed_tokens == 1`` (the token
sampled last step). Drafts to verify are not tokens yet: they wait in
``spec_token_ids`` until the target accepts them.

A ``Request`` (one ``add_request`` call) owns its prompt, sampling parameters,
timings and its n ``Sequence``s (n > 1: parallel sampling, forked once the prompt
is computed so they share its blocks).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch

from minibatch.engine.outputs import RequestMetrics
from minibatch.sampling.sampler import SamplingParams, make_generator
from minibatch.spec_decode.stats import SpecStats


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"                      # preempted by swapping: its blocks wait in the host pool
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str
    prompt_token_ids: list
    params: SamplingParams
    priority: int = 0                        # lower value = served first (vLLM's convention)
    arrival_time: float = 0.0
    arrival_order: int = 0                   # tie-break: order of add_request calls
    metrics: Optional[RequestMetrics] = None
    seqs: list = field(default_factory=list)
    generators: list = field(default_factory=list)   # sample i draws from generators[i] (None: the engine's)
    logprobs: dict = field(default_factory=dict)     # sample index -> [{token: Logprob}] per output token
    prompt_logprobs: Optional[list] = None           # [None, {token: Logprob}, ...] (sampling/logprobs.py)

    def __post_init__(self):
        if self.metrics is None:
            self.metrics = RequestMetrics(self.arrival_time, num_prompt_tokens=len(self.prompt_token_ids))
        if not self.generators:              # a seeded request: sample i is seeded seed + i, in any batch
            seed = self.params.seed
            self.generators = [make_generator(None if seed is None else seed + i) for i in range(self.params.n)]

    @property
    def finished(self) -> bool:
        return bool(self.seqs) and all(s.is_finished for s in self.seqs) and not self.seqs[0].num_forks_pending


@dataclass(eq=False)
class Sequence:
    seq_id: str
    request: Request
    index: int                               # which of the request's n samples
    token_ids: list                          # prompt, then output: the tokens this sequence holds
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0             # leading tokens whose K/V is in the cache
    num_cached_tokens: int = 0               # of those, how many the prefix cache gave at admission
    num_preemptions: int = 0                 # preempted by recompute (its K/V thrown away)
    num_swaps: int = 0                       # preempted by swapping (its K/V kept in host memory)
    num_forks_pending: int = 0               # n > 1: children to fork off once the prompt is computed
    num_output_placeholders: int = 0         # asynchronous scheduling: tokens at the end of token_ids that a step
                                             # in flight is still sampling (engine/async_scheduler.py)
    spec_token_ids: list = field(default_factory=list)        # drafts for the next step to verify
    spec_probs: Optional[torch.Tensor] = None                 # [len(spec_token_ids), V] draft q; None = one-hot
    spec_parents: Optional[list] = None                       # a token tree: parents of [root] + drafts
                                                              # (kv/tree.py); None = a chain
    spec_stats: SpecStats = field(default_factory=SpecStats)  # this sequence's verify steps
    finish_reason: Optional[str] = None      # "length", "stop", "abort" ("dead_end": sampling/structured/matcher.py)
    grammar: Optional[object] = None         # structured outputs: the matcher after this sequence's output tokens

    def __post_init__(self):
        if self.grammar is None and self.params.structured_outputs is not None:
            self.grammar = self.params.structured_outputs.new_matcher()

    def clear_spec(self) -> None:
        """Forget the drafts (verified, rejected, or no longer wanted)."""
        self.spec_token_ids, self.spec_probs, self.spec_parents = [], None, None

    # -- read-only views of the request's facts ----------------------------------------
    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def generator(self) -> Optional[torch.Generator]:
        return self.request.generators[self.index]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def output_token_ids(self) -> list:
        """The tokens sampled so far (without the placeholders of a step in flight)."""
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.num_output_placeholders]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens, placeholders included (what max_tokens counts)."""
        return len(self.token_ids) - self.num_prompt_tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token is uncomputed: the next step is a decode (or a verify)."""
        return (self.status is SequenceStatus.RUNNING and self.num_uncomputed_tokens == 1
                and self.num_output_tokens > 0)

    @property
    def phase(self) -> str:
        """What a step does for it: "decode", "resumed" (recomputing after a preemption) or "prefill"."""
        if self.num_uncomputed_tokens == 1 and self.num_output_tokens:
            return "decode"
        return "resumed" if self.num_preemptions and self.num_output_tokens else "prefill"
