"""Sampling: turn a batch of logits into next tokens, one request's rules per row.

``SamplingParams`` uses vLLM's names, so code written here reads like vLLM code.
The order of operations per row is the usual one:
    logits / temperature  ->  keep top-k  ->  keep the top-p nucleus  ->  softmax  ->  draw
``temperature == 0`` means greedy (argmax), with no randomness at all.

Reproducibility: a request with a ``seed`` owns a ``torch.Generator`` seeded once,
and only its own draws advance it, so it samples the same tokens whatever else
shares its batch (and however the batch is ordered). Without a seed, draws come
from one engine-wide generator.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from minibatch.structured.params import structured_outputs_params


@dataclass
class SamplingParams:
    n: int = 1                      # parallel samples of one prompt (forked sequences)
    temperature: float = 1.0        # 0 = greedy
    top_k: int = -1                 # -1 or 0 = off
    top_p: float = 1.0              # nucleus mass in (0, 1]
    max_tokens: int = 16
    seed: Optional[int] = None
    stop: list = field(default_factory=list)   # stop strings; the output is cut before the match
    ignore_eos: bool = True         # a byte model has no end-of-sequence token; kept for vLLM parity
    structured_outputs: Optional[object] = None   # StructuredOutputsParams (or its fields as a dict): json, regex, ...

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.structured_outputs = structured_outputs_params(self.structured_outputs)   # compiled once, here
        checks = [
            (isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}"),
            (isinstance(self.top_k, int) and self.top_k >= -1,
             f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k!r}"),
            (0 < self.top_p <= 1, f"top_p must lie in (0, 1], got {self.top_p}"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}"),
            (self.seed is None or isinstance(self.seed, int), f"seed must be an int or None, got {self.seed!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits[V] -> logits[V] with every token outside the top-k and the top-p nucleus set to -inf.

    Ties: top-k keeps every token whose logit equals the k-th largest (so the
    kept set never depends on sort order among equals). Nucleus: keep the
    smallest set of most-probable tokens whose mass reaches top_p; the token
    that crosses the boundary is kept (Holtzman et al., 2020, Sec. 3.1), and
    tokens tied with it are kept too.
    """
    if top_k and top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        probs = logits.softmax(-1)
        sorted_p, _ = probs.sort(descending=True)
        mass_before = sorted_p.cumsum(0) - sorted_p            # mass of strictly more probable tokens
        keep_sorted = mass_before < top_p                       # token i kept if the nucleus isn't full yet
        threshold = sorted_p[keep_sorted].min()                 # least probability still inside
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: logits[..., V] -> probs[..., V] (one-hot if greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    x = logits.float() / params.temperature
    if (params.top_k and params.top_k > 0) or params.top_p < 1.0:      # a filter is asked for
        flat = x.reshape(-1, x.shape[-1])
        x = torch.stack([apply_top_k_top_p(row, params.top_k, params.top_p) for row in flat]).view(x.shape)
    return x.softmax(-1)


def make_generator(seed: Optional[int], device="cpu") -> Optional[torch.Generator]:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def find_stop(output_ids: list[int], stop: list[str]) -> Optional[int]:
    """Index at which to cut the output before the earliest stop string, or None.

    Matching is on bytes, so a stop string is found even while the output ends
    in the middle of a multibyte character.
    """
    if not stop:
        return None
    data = bytes(output_ids)
    hits = [i for i in (data.find(s.encode("utf-8")) for s in stop) if i >= 0]
    return min(hits) if hits else None


class Sampler:
    """Samples one token per row; row i follows params[i] and draws from generators[i]."""

    def __init__(self, seed: int = 0):
        self.default_generator = torch.Generator()
        self.default_generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list, generators: list) -> list[int]:
        # logits[B, V]; params[B]: SamplingParams; generators[B]: torch.Generator or None
        out = logits.argmax(-1).tolist()             # greedy rows: argmax, all rows at once, no randomness
        for i, (p, g) in enumerate(zip(params, generators)):
            if not p.greedy:
                probs = probabilities(logits[i], p).cpu()
                out[i] = int(torch.multinomial(probs, 1, generator=g or self.default_generator))
        return out
