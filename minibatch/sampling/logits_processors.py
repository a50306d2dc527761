"""Sampling controls: a request's rules rewrite its rows of logits before anything samples from them.

vLLM's names and order (``vllm/v1/sample/``): first the processors that move single tokens, then the
penalties, then (in the sampler) temperature, top-k and top-p:

    logit_bias          logits[t] += bias[t]                                   (OpenAI's, in [-100, 100])
    min_tokens          logits[stop_token_ids] = -inf  while fewer than min_tokens tokens are out
    repetition_penalty  a token seen in the prompt or the output: logit / p if logit > 0, else logit * p
                        (Keskar et al. 2019, CTRL §4.1; p > 1 discourages repeats, p = 1 is off)
    frequency_penalty   logits[t] -= f * count of t in the output       (OpenAI's, in [-2, 2])
    presence_penalty    logits[t] -= p * (t occurs in the output)

**Lossless under speculation.** A verify step scores 1 + k rows at once; row i is the target's next token
*after* drafts 0 .. i-1, so its counts include those drafts, as if they had been generated already (a
token tree: the drafts on the path from the root to node i). The processed rows are what the sampler,
the greedy argmax and the rejection sampler all read, so the accepted tokens follow the processed target
distribution exactly, whatever the proposer drafted.

``apply_logits_processors`` is batched (one scatter per statistic over every row that asks for a control);
``process_row_reference`` is the slow, obvious per-row version the tests hold it equal to.
"""
from __future__ import annotations

import torch

from minibatch.sampling.sampler import SamplingParams


def _path_drafts(s, j: int) -> list:
    """The drafts generated, in this row's world, before row j of a verify: drafts 0 .. j-1 of a chain, or
    the drafts on the path root -> node j of a tree (``kv/tree.py``: node i > 0 holds draft i - 1)."""
    if s.spec_parents is None:
        return s.spec_token_ids[:j]
    path = []
    while j > 0:
        path.append(s.spec_token_ids[j - 1])
        j = s.spec_parents[j]
    return path[::-1]


def row_contexts(scheduled, rows) -> list:
    """[(logits row, params, prompt ids, output ids as that row sees them)] for each row whose request asks
    for a control; scheduled[b] owns rows[b] (1, or 1 + k when it verifies k drafts, or none mid-prefill)."""
    out = []
    for s, r in zip(scheduled, rows):
        p = s.seq.params
        if not r or not p.has_controls:
            continue
        prompt, output = s.seq.token_ids[:s.seq.num_prompt_tokens], s.seq.output_token_ids
        out += [(row, p, prompt, output + _path_drafts(s, j)) for j, row in enumerate(r)]
    return out


def apply_logits_processors(logits: torch.Tensor, scheduled, rows) -> torch.Tensor:
    """logits [N, V] -> logits [N, V] with each request's controls applied to its rows (a copy; unchanged
    and not copied when no row asks for one)."""
    ctx = row_contexts(scheduled, rows)
    if not ctx:
        return logits
    logits = logits.clone()
    idx = torch.tensor([c[0] for c in ctx], device=logits.device)
    logits[idx] = process_rows(logits[idx], [c[1] for c in ctx], [c[2] for c in ctx], [c[3] for c in ctx])
    return logits


def _scatter(R: int, V: int, lists: list, values=None, device="cpu") -> torch.Tensor:
    """[R, V] float: row r gets += values[r][i] (or 1) at column lists[r][i] (duplicates add up)."""
    rows = torch.tensor([r for r, l in enumerate(lists) for _ in l], dtype=torch.long, device=device)
    cols = torch.tensor([t for l in lists for t in l], dtype=torch.long, device=device)
    vals = (torch.tensor([v for vs in values for v in vs], dtype=torch.float32, device=device) if values is not None
            else torch.ones(len(cols), device=device))
    return torch.zeros(R * V, device=device).index_add_(0, rows * V + cols, vals).view(R, V)


def process_rows(x: torch.Tensor, params: list, prompts: list, outputs: list) -> torch.Tensor:
    """x [R, V] float logits; row r follows params[r], having seen prompts[r] and then outputs[r]."""
    R, V, dev = x.shape[0], x.shape[1], x.device
    col = lambda vals: torch.tensor(vals, dtype=torch.float32, device=dev)[:, None]     # noqa: E731  [R, 1]
    biases = [p.logit_bias or {} for p in params]
    x = x + _scatter(R, V, [list(b) for b in biases], [list(b.values()) for b in biases], dev)
    early = [list(p.stop_token_ids) if len(o) < p.min_tokens else [] for p, o in zip(params, outputs)]
    x = x.masked_fill(_scatter(R, V, early, device=dev) > 0, float("-inf"))
    seen = _scatter(R, V, [pr + o for pr, o in zip(prompts, outputs)], device=dev) > 0
    rep = col([p.repetition_penalty for p in params])
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    counts = _scatter(R, V, outputs, device=dev)                                          # [R, V]
    x = x - col([p.frequency_penalty for p in params]) * counts
    return x - col([p.presence_penalty for p in params]) * (counts > 0).float()


def process_row_reference(logits: list, p: SamplingParams, prompt: list, output: list) -> list:
    """The same for one row, token by token, in plain Python: the definition the batched version must meet."""
    x = list(logits)
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if len(output) < p.min_tokens:
        for t in p.stop_token_ids:
            x[t] = float("-inf")
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x
