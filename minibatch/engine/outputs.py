"""What the engine reports back: vLLM's ``RequestOutput`` / ``CompletionOutput``, and per-request timings.

Per request (``RequestMetrics``, filled by the engine with ``time.perf_counter`` seconds):

    arrival ──queue──> first scheduled ──prefill──> first token ──decode──> finished
    |<──────────── TTFT ────────────────────────────>|<── (n-1) x TPOT ──>|
    |<──────────────────────────── e2e latency ──────────────────────────>|
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from minibatch.model.tokenizer import decode


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0           # prompt tokens whose KV came from the prefix cache

    @property
    def queue_time(self) -> Optional[float]:
        """Arrival to first scheduled (None until then)."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token: arrival to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> Optional[float]:
        """Arrival to finished."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot(self) -> Optional[float]:
        """Time per output token after the first: (finished - first token) / (n - 1); None if n < 2."""
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    finish_reason: Optional[str] = None     # "length", "stop", "abort"; None while running
    spec: Optional[dict] = None             # this sequence's speculative statistics (SpecStats.to_dict), and
                                            # "lossless": False under typical acceptance (spec_decode/typical.py)
    logprobs: Optional[list] = None         # [{token_id: Logprob}] per token (SamplingParams.logprobs; logprobs.py)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str
    prompt_token_ids: list
    outputs: list                           # [CompletionOutput], one per sample
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: Optional[list] = None  # [None, {token_id: Logprob}, ...] (SamplingParams.prompt_logprobs)


def request_output(req, with_spec: bool, lossless: bool = True) -> RequestOutput:
    """A request's output as it stands now (``req`` is an ``engine.sequence.Request``).

    The counts that live on the sequences are read from them here, so they are stored once:
    output tokens and preemptions are summed over the request's samples."""
    m = req.metrics
    m.num_output_tokens = sum(s.num_output_tokens for s in req.seqs)
    m.num_preemptions = sum(s.num_preemptions for s in req.seqs)
    m.num_cached_tokens = req.seqs[0].num_cached_tokens
    want = req.params.logprobs is not None
    outs = [CompletionOutput(s.index, decode(s.output_token_ids), s.output_token_ids, s.finish_reason,
                             s.spec_stats.to_dict() | {"lossless": lossless} if with_spec else None,
                             list(req.logprobs.get(s.index, [])) if want else None)
            for s in sorted(req.seqs, key=lambda s: s.index)]
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished, m,
                         req.prompt_logprobs)
