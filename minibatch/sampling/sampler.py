"""Sampling: turn a batch of logits into next tokens, one request's rules per row.

``SamplingParams`` uses vLLM's names, so code written here reads like vLLM code.
The order of operations per row is the usual one:
    logits / temperature  ->  keep top-k  ->  keep the top-p nucleus  ->  softmax  ->  draw
``temperature == 0`` means greedy (argmax), with no randomness at all.

Reproducibility: a request with a ``seed`` owns a ``torch.Generator`` seeded once,
and only its own draws advance it, so it samples the same tokens whatever else
shares its batch (and however the batch is ordered). Without a seed, draws come
from one engine-wide generator.

Two ways to the same distribution: ``apply_top_k_top_p`` and ``probabilities`` are the slow, obvious
reference (one row at a time; exercise 3 writes the first). ``Sampler`` does a whole batch at once, as vLLM's
does: one batched filter (``top_k_top_p_batched``, held equal to the reference by tests/test_batched_sampler.py)
and one draw, the exponential race: token = argmax_i p_i / q_i with q_i ~ Exp(1) independent, which picks
token i with probability exactly p_i (the smallest of independent Exp(p_i)-scaled clocks q_i / p_i wins
with probability p_i / sum p). A seeded row fills its own q row from its own generator, so what it draws
depends on nothing else in the batch. No host sync until the one ``.tolist()`` of the chosen tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from minibatch.model.tokenizer import VOCAB_SIZE as VOCAB

MAX_LOGPROBS = 20        # vLLM's default max_logprobs: the most top alternatives a request may ask for
from minibatch.sampling.structured.params import structured_outputs_params


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
    # logprobs (sampling/logprobs.py) and the sampling controls (sampling/logits_processors.py), vLLM's names and ranges
    logprobs: Optional[int] = None          # per output token: its logprob and the top `logprobs` (<= MAX_LOGPROBS)
    prompt_logprobs: Optional[int] = None   # the same for every prompt token after the first
    presence_penalty: float = 0.0           # [-2, 2]: minus this once for every token already in the output
    frequency_penalty: float = 0.0          # [-2, 2]: minus this times the token's count in the output
    repetition_penalty: float = 1.0         # > 0: a seen token's (prompt or output) logit / p if > 0, * p if < 0
    logit_bias: Optional[dict] = None       # {token id: bias in [-100, 100]} added to the logits
    min_tokens: int = 0                     # stop_token_ids are masked until this many tokens are out
    stop_token_ids: list = field(default_factory=list)   # finish ("stop") once one is generated, kept in the output
    structured_outputs: Optional[object] = None   # StructuredOutputsParams (or its fields as a dict): json, regex, ...

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.structured_outputs is not None:        # compiled once, here; a plain request never goes there
            self.structured_outputs = structured_outputs_params(self.structured_outputs)
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
        for ok, msg in checks + self._control_checks():
            if not ok:
                raise ValueError(msg)
        if self.logit_bias:                  # JSON keys arrive as strings ("65": 5): token ids from here on
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}

    def _control_checks(self) -> list:
        """(ok, message) for the logprobs and sampling-control fields, with vLLM's ranges."""
        def count(v):
            return v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_LOGPROBS)
        def token(t):                        # an int id, or its decimal string (a JSON object's key)
            if isinstance(t, str):
                t = int(t) if t.strip().lstrip("-").isdigit() else None
            return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < VOCAB
        bias = self.logit_bias or {}
        return [
            (count(self.logprobs), f"logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}"),
            (count(self.prompt_logprobs),
             f"prompt_logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got {self.prompt_logprobs!r}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must lie in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must lie in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"),
            (isinstance(bias, dict) and all(token(k) for k in bias),
             f"logit_bias keys must be token ids in [0, {VOCAB}), got {sorted(bias, key=str)[:5]!r}"),
            (all(isinstance(v, (int, float)) and -100 <= v <= 100 for v in bias.values()),
             f"logit_bias values must lie in [-100, 100], got {list(bias.values())[:5]!r}"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"),
            (isinstance(self.stop_token_ids, list) and all(isinstance(t, int) and token(t) for t in self.stop_token_ids),
             f"stop_token_ids must be token ids in [0, {VOCAB}), got {self.stop_token_ids!r}"),
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_controls(self) -> bool:
        """Whether a logits processor rewrites this request's rows (``sampling/logits_processors.py``)."""
        return bool(self.logit_bias or (self.min_tokens and self.stop_token_ids) or self.repetition_penalty != 1.0
                    or self.presence_penalty or self.frequency_penalty)


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


def top_k_top_p_batched(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``apply_top_k_top_p`` on every row at once: logits [B, V], top_k [B] int (<= 0 or >= V: off),
    top_p [B] float (1: off) -> logits [B, V] with the tokens outside each row's sets at -inf.

    The same rules, with no per-row branch and no host sync: the k-th largest logit is a gather in the
    sorted row (k off = the V-th, which masks nothing); the nucleus is a prefix of the sorted probabilities,
    so its least kept probability sits at index (number kept - 1); a row with top_p = 1 masks nothing
    (not even tokens whose running mass rounds to 1)."""
    B, V = logits.shape
    k = torch.where((top_k > 0) & (top_k < V), top_k, V).long().to(logits.device)        # [B]
    desc = logits.sort(-1, descending=True).values                                       # [B, V]
    logits = logits.masked_fill(logits < desc.gather(1, k[:, None] - 1), float("-inf"))
    probs = logits.softmax(-1)
    sorted_p = probs.sort(-1, descending=True).values
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p.to(probs)[:, None]                   # [B, V], a prefix
    threshold = sorted_p.gather(1, keep.sum(-1, keepdim=True) - 1)                        # [B, 1]
    threshold = torch.where(top_p.to(probs.device)[:, None] < 1.0, threshold, 0.0)
    return logits.masked_fill(probs < threshold, float("-inf"))


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: logits[..., V] -> probs[..., V] (one-hot if greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    x = logits.float() / params.temperature
    if (params.top_k and params.top_k > 0) or params.top_p < 1.0:      # a filter is asked for
        flat = x.reshape(-1, x.shape[-1])
        x = torch.stack([apply_top_k_top_p(row, params.top_k, params.top_p) for row in flat]).view(x.shape)
    return x.softmax(-1)


def top_k_top_p_rows(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, row_filter) -> torch.Tensor:
    """``top_k_top_p_batched``'s result, row by row through ``row_filter`` (``apply_top_k_top_p``'s signature:
    a student's, exercise 3): logits [B, V], top_k [B], top_p [B] -> logits [B, V]."""
    return torch.stack([row_filter(row, int(k), float(p)) for row, k, p in zip(logits, top_k.tolist(), top_p.tolist())])


def batched_probabilities(logits: torch.Tensor, params: list, top_k_top_p=None) -> torch.Tensor:
    """``probabilities`` of many rows at once: logits [R, V], row i under params[i] -> probs [R, V] (one-hot
    rows for greedy ones), on the logits' device. top-k / top-p is one batched call (``top_k_top_p_batched``),
    or, given ``top_k_top_p`` (a row filter with ``apply_top_k_top_p``'s signature: the part an engine was built
    with, a student's), that function row by row."""
    dev, x = logits.device, logits.float()
    greedy = torch.tensor([p.greedy for p in params], device=dev)
    x = x / torch.tensor([p.temperature or 1.0 for p in params], device=dev)[:, None]
    if any((p.top_k and p.top_k > 0) or p.top_p < 1.0 for p in params if not p.greedy):
        ks = torch.tensor([-1 if p.greedy else p.top_k for p in params], device=dev)        # greedy rows: off
        ps = torch.tensor([1.0 if p.greedy else p.top_p for p in params], device=dev)
        x = top_k_top_p_batched(x, ks, ps) if top_k_top_p is None else top_k_top_p_rows(x, ks, ps, top_k_top_p)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(x.dtype)
    return torch.where(greedy[:, None], one_hot, x.softmax(-1))


def exponential_noise(shape, generator: Optional[torch.Generator] = None, device="cpu") -> torch.Tensor:
    """q ~ Exp(1) i.i.d. of ``shape`` from ``generator`` (None: torch's global one), on ``generator``'s device,
    then on ``device``. Clamped away from 0 (a float Exp(1) can be exactly 0), so that p / q is never 0 / 0."""
    at = generator.device if generator is not None else device
    q = torch.empty(shape, device=at).exponential_(generator=generator)
    return q.clamp_(min=torch.finfo(q.dtype).tiny).to(device)


def race(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The exponential race: argmax_i p_i / q_i over the last dim, token i with probability exactly p_i
    (q_i / p_i ~ Exp(p_i), and the first of independent exponential clocks to ring is i w.p. p_i / sum p)."""
    return (probs / q).argmax(-1)


def make_generator(seed: Optional[int], device="cpu") -> Optional[torch.Generator]:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def find_stop(output_ids: list[int], stop: list[str], stop_token_ids=()) -> Optional[int]:
    """Index at which to cut the output before the earliest stop string (or just after the earliest stop token
    id: vLLM keeps a stop token in the output), or None.

    Matching is on bytes, so a stop string is found even while the output ends
    in the middle of a multibyte character.
    """
    if not stop and not stop_token_ids:
        return None
    data = bytes(output_ids)
    hits = [i for i in (data.find(s.encode("utf-8")) for s in stop) if i >= 0]
    hits += [i + 1 for i, t in enumerate(output_ids) if t in stop_token_ids][:1]
    return min(hits) if hits else None


class Sampler:
    """Samples one token per row; row i follows params[i] and draws from generators[i] (None: the sampler's own).

    ``top_k_top_p``: the filter part, chosen when the engine is built: None, the batched reference
    (``top_k_top_p_batched``); or a row filter with ``apply_top_k_top_p``'s signature (a student's)."""

    def __init__(self, seed: int = 0, top_k_top_p=None):
        self.seed, self.top_k_top_p = seed, top_k_top_p
        self._generators = {}                  # device -> the generator of unseeded rows there

    @property
    def default_generator(self) -> torch.Generator:
        return self._generator(torch.device("cpu"))

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = make_generator(self.seed, device)
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, params: list, generators: list) -> list[int]:
        # logits[B, V]; params[B]: SamplingParams; generators[B]: torch.Generator or None
        greedy = logits.argmax(-1)                   # greedy rows: argmax, no randomness
        rand = [i for i, p in enumerate(params) if not p.greedy]
        if not rand:
            return greedy.tolist()
        dev = logits.device
        probs = batched_probabilities(logits[rand], [params[i] for i in rand], self.top_k_top_p)   # [R, V]
        q = exponential_noise(probs.shape, self._generator(dev), dev)                     # unseeded rows
        for r, i in enumerate(rand):
            if generators[i] is not None:            # its own row from its own generator: batch-independent
                q[r] = exponential_noise(probs.shape[1], generators[i], dev)
        drawn = race(probs, q)
        out = greedy.index_copy(0, torch.tensor(rand, device=dev), drawn)
        return out.tolist()

