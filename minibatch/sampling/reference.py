"""The oracles: generation with no cache, and with the classic contiguous KV cache.

``generate`` is slow on purpose: every new token re-runs the model over the
whole sequence with dense attention. Nothing can go stale, so it is the
definition of the right answer; every engine configuration is tested
token-for-token against it.

``generate_with_cache`` is the textbook optimisation before paging: one
contiguous K/V buffer per request, sized for the whole context, written as the
sequence grows. Prefill writes the prompt's keys and values once, and each
decode step feeds one token. It must give the same greedy tokens.
"""
from __future__ import annotations

import math

import torch

from minibatch.model.model import GPT, DenseAttention
from minibatch.sampling.sampler import (SamplingParams, exponential_noise, find_stop, make_generator, probabilities,
                                      race)


def check_request(model: GPT, prompt_ids, params: SamplingParams) -> None:
    n_ctx = model.config.n_ctx
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty: at least one token is needed to predict the next")
    if len(prompt_ids) + params.max_tokens > n_ctx:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                         f"model's context of {n_ctx} tokens")


def _next_token(logits: torch.Tensor, params: SamplingParams, gen) -> int:
    if params.greedy:
        return int(logits.argmax())
    probs = probabilities(logits, params)              # the engine's draw rule, one row: the exponential race
    return int(race(probs, exponential_noise(probs.shape, gen, probs.device)))


def _finish(out: list[int], params: SamplingParams):
    cut = find_stop(out, params.stop)
    return (out[:cut], "stop") if cut is not None else None


def next_logits(model: GPT, ids: list[int]) -> torch.Tensor:
    """The logits [V] after ``ids``, from a full forward with dense attention (no cache)."""
    x = torch.tensor(ids, device=model.device)
    return model(x, torch.arange(len(ids), device=model.device), DenseAttention([len(ids)]),
                 logits_indices=torch.tensor([len(ids) - 1], device=model.device))[0]


@torch.no_grad()
def generate(model: GPT, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], str]:
    """No cache: recompute the full sequence for every token. Returns (output ids, finish reason)."""
    check_request(model, prompt_ids, params)
    gen = make_generator(params.seed)
    ids, out = list(prompt_ids), []
    while len(out) < params.max_tokens:
        tok = _next_token(next_logits(model, ids), params, gen)
        ids.append(tok)
        out.append(tok)
        if (done := _finish(out, params)) is not None:
            return done
    return out, "length"


class ContiguousKVAttention:
    """One request's cache: K and V buffers [n_layer, n_ctx, Hkv, D], filled left to right."""

    def __init__(self, model: GPT):
        c = model.config
        shape = (c.n_layer, c.n_ctx, c.num_kv_heads, c.head_dim)
        self.k = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.v = torch.zeros_like(self.k)
        self.start = 0                                            # tokens already cached

    def __call__(self, layer_idx, q, k, v):                      # q [n_new, H, D], k, v [n_new, Hkv, D]
        n, end = q.shape[0], self.start + q.shape[0]
        self.k[layer_idx, self.start:end] = k
        self.v[layer_idx, self.start:end] = v
        keys, vals = self.k[layer_idx, :end], self.v[layer_idx, :end]   # [end, Hkv, D]
        if keys.shape[1] != q.shape[1]:                          # grouped-query: H / Hkv queries share each head
            keys, vals = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (keys, vals))   # [end, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(q.shape[-1])
        # new token i sits at position start + i and may see keys 0..start + i
        q_pos = torch.arange(self.start, end, device=q.device)[:, None]
        k_pos = torch.arange(end, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)

    def advance(self, n: int):
        self.start += n


@torch.no_grad()
def generate_with_cache(model: GPT, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], str]:
    """Prefill once, then one token per step through a contiguous per-request KV cache."""
    check_request(model, prompt_ids, params)
    gen = make_generator(params.seed)
    cache = ContiguousKVAttention(model)
    new, out = list(prompt_ids), []
    while len(out) < params.max_tokens:
        x = torch.tensor(new, device=model.device)
        pos = torch.arange(cache.start, cache.start + len(new), device=model.device)
        logits = model(x, pos, cache, logits_indices=torch.tensor([len(new) - 1], device=model.device))[0]
        cache.advance(len(new))
        tok = _next_token(logits, params, gen)
        out.append(tok)
        new = [tok]
        if (done := _finish(out, params)) is not None:
            return done
    return out, "length"
