"""Logprobs: the distribution behind each token, in vLLM's shapes.

    CompletionOutput.logprobs       [{token_id: Logprob(logprob, rank, decoded_token)}] one dict per output token:
                                    the chosen token first, then the top ``logprobs`` alternatives
    RequestOutput.prompt_logprobs   [None, {...}, {...}, ...] one per prompt token (the first has no context)

**Which distribution** (vLLM's ``logprobs_mode``; its default is ``raw_logprobs``, the model's own). Here an
output token's logprob is vLLM's ``processed_logprobs`` before truncation: log_softmax of the logits after the
request's controls (``logits_processors.py``) and its temperature (greedy counts as temperature 1, as in
vLLM), *before* top-k/top-p, so every value is finite. With no controls and temperature 0 or 1 the two
modes agree. Prompt logprobs are always the model's own (temperature 1, no controls): scoring a text must
not depend on how one would sample after it. ``rank`` is vLLM's: 1 + the number of other tokens at least as
likely.

**Under speculation** a verified token's logprob is read from the target's row at its position (row j of a
chain, node path[j] of a tree), never from the drafter's q: the accepted tokens are distributed as the target
says, and so are their logprobs.

**Prompt logprobs** take one dense forward over the prompt when it is first complete (``prompt_rows``): one
more prefill for a scoring request, in exchange for being independent of chunked prefill, prefix-cache hits
(whose positions were never computed) and preemption.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from minibatch.model.model import DenseAttention
from minibatch.model.tokenizer import decode


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None           # 1 = the most likely token
    decoded_token: Optional[str] = None


def _entries(lp: torch.Tensor, tokens: list, nums: list) -> list:
    """lp [M, V] logprobs; row m scores tokens[m] and lists its top nums[m] -> [{token: Logprob}] per row."""
    idx = torch.tensor(tokens, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, idx[:, None])                                   # [M, 1]
    ranks = (lp >= chosen).sum(-1).tolist()                               # vLLM: count of logprobs >= the token's
    k = max(nums, default=0)
    top_lp, top_id = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    out = []
    for m, (t, lpt, rank, n) in enumerate(zip(tokens, chosen[:, 0].tolist(), ranks, nums)):
        d = {t: Logprob(lpt, rank, decode([t]))}
        for r, (tok, v) in enumerate(zip(top_id[m, :n].tolist(), top_lp[m, :n].tolist()), start=1):
            d.setdefault(tok, Logprob(v, r, decode([tok])))
        out.append(d)
    return out


def processed_logprobs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """logits [M, V] (controls applied) -> logprobs [M, V] at each row's temperature (greedy: 1)."""
    temp = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)[:, None]
    return (logits.float() / temp).log_softmax(-1)


def sample_logprobs(scheduled, logits: torch.Tensor, rows: list, sampled: list, paths: list, forked: list):
    """For each scheduled sequence that asks (params.logprobs is not None): the entries of its new tokens,
    read at the target's rows; and of its children's first tokens (n > 1). (None where not asked.)"""
    picks = []                                           # (b, child or -1, logits row, token)
    for b, s in enumerate(scheduled):
        if s.seq.params.logprobs is None or not sampled[b]:
            continue
        nodes = paths[b] if paths[b] else range(len(sampled[b]))         # a tree's accepted path, or a chain
        picks += [(b, -1, rows[b][node], t) for node, t in zip(nodes, sampled[b])]
        picks += [(b, i, rows[b][0], t) for i, t in enumerate(forked[b])]
    B = len(scheduled)
    toks, child = [None] * B, [None] * B
    if not picks:
        return toks, child
    params = [scheduled[b].seq.params for b, *_ in picks]
    lp = processed_logprobs(logits[[r for _, _, r, _ in picks]], params)
    for (b, i, _, _), e in zip(picks, _entries(lp, [t for *_, t in picks], [p.logprobs for p in params])):
        lists = toks if i < 0 else child
        if lists[b] is None:
            lists[b] = []
        lists[b].append(e)
    return toks, child


def prompt_rows(model, scheduled) -> list:
    """[B]: the prompt logprobs of each sequence whose prompt is complete for the first time this step and
    whose request asks for them (else None): [None, {token: Logprob}, ...], one per prompt token."""
    out = [None] * len(scheduled)
    for b, s in enumerate(scheduled):
        seq = s.seq
        if seq.params.prompt_logprobs is None or not s.samples or seq.output_token_ids or seq.index:
            continue
        ids = seq.token_ids[:seq.num_prompt_tokens]
        L, dev = len(ids), model.device
        logits = model(torch.tensor(ids, device=dev), torch.arange(L, device=dev), DenseAttention([L]),
                       logits_indices=torch.arange(L - 1, device=dev))                 # [L - 1, V]
        out[b] = [None] + _entries(logits.float().log_softmax(-1), ids[1:], [seq.params.prompt_logprobs] * (L - 1))
    return out


def record(scheduler_output, runner_output) -> None:
    """After ``update_from_output``: keep each sequence's new entries beside its new tokens (cut to the
    tokens it kept: max_tokens, a stop string), and a request's prompt logprobs once."""
    for i, s in enumerate(scheduler_output.scheduled):
        req = s.seq.request
        if runner_output.prompt_logprobs and runner_output.prompt_logprobs[i] is not None \
                and req.prompt_logprobs is None:
            req.prompt_logprobs = runner_output.prompt_logprobs[i]
        if not runner_output.logprobs or runner_output.logprobs[i] is None:
            continue
        seqs = {q.index: q for q in req.seqs}
        new = [(s.seq, runner_output.logprobs[i])]
        new += [(seqs[k], [e]) for k, e in enumerate(runner_output.forked_logprobs[i] or [], start=1)]
        for seq, entries in new:
            kept = req.logprobs.get(seq.index, []) + entries
            req.logprobs[seq.index] = kept[:seq.num_output_tokens]
