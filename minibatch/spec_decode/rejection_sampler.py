"""Speculative decoding, the maths: verify k guesses with one target forward, lose nothing.

A cheap *proposer* guesses the next k tokens x_1..x_k (a small draft model
sampling from q, or an n-gram lookup with no q at all). The target model then
scores all k + 1 positions in one forward, giving p_1..p_{k+1}. The rejection
sampler below keeps a prefix of the guesses and adds one token of its own, and
the tokens it emits are distributed *exactly* as if the target had sampled them
one by one (Leviathan et al., 2023, Sec. 2.3 and Appendix A.1; Chen et al.,
2023, Theorem 1). Why, for one position:

    P(emit x) = q(x) * min(1, p(x)/q(x))           accepted draft
              + (1 - sum_y min(q(y), p(y))) * r(x)   rejected, redrawn from r
    with r = norm(max(0, p - q)):  min(q, p) + max(0, p - q) = p, so P(emit x) = p(x).
"""
from __future__ import annotations

from typing import Optional

import torch

from minibatch.kv import tree


def _check_inputs(draft_token_ids, draft_probs, target_probs, generators, num_draft_tokens, greedy):
    """Every way the inputs can disagree, as one ValueError each; returns (B, k, ks, greedy)."""
    if not isinstance(draft_token_ids, torch.Tensor) or draft_token_ids.dim() != 2:
        raise ValueError("draft_token_ids must be a 2-D tensor [B, k]")
    if draft_token_ids.dtype != torch.int64:
        raise ValueError(f"draft_token_ids must be int64, got {draft_token_ids.dtype}")
    B, k = draft_token_ids.shape
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (B, k + 1):
        raise ValueError(f"target_probs must be [B, k+1, V] = [{B}, {k + 1}, V], got "
                         f"{tuple(getattr(target_probs, 'shape', ()))}")
    V = target_probs.shape[2]
    if draft_probs is not None:
        if not isinstance(draft_probs, torch.Tensor) or tuple(draft_probs.shape) != (B, k, V):
            raise ValueError(f"draft_probs must be [B, k, V] = [{B}, {k}, {V}] (or None for one-hot drafts), "
                             f"got {tuple(getattr(draft_probs, 'shape', ()))}")
        if draft_probs.device != target_probs.device:
            raise ValueError(f"draft_probs is on {draft_probs.device} but target_probs on {target_probs.device}")
    ks = [k] * B if num_draft_tokens is None else [int(n) for n in num_draft_tokens]
    greedy = [False] * B if greedy is None else [bool(g) for g in greedy]
    for name, xs in (("generators", generators), ("num_draft_tokens", ks), ("greedy", greedy)):
        if xs is not None and len(xs) != B:
            raise ValueError(f"{name} has {len(xs)} entries for a batch of {B} rows")
    if any(not 0 <= n <= k for n in ks):
        raise ValueError(f"num_draft_tokens must each lie in [0, k={k}], got {ks}")
    ids = draft_token_ids.tolist()
    for b, n in enumerate(ks):
        if any(not 0 <= t < V for t in ids[b][:n]):
            raise ValueError(f"row {b}: draft token ids {ids[b][:n]} outside the vocabulary [0, {V})")
    # The distributions actually read: positions 0..k_b of p (k_b+1 = the bonus), 0..k_b-1 of q.
    used_p = torch.arange(k + 1)[None, :] <= torch.tensor(ks)[:, None]           # [B, k+1]
    used_q = torch.arange(k)[None, :] < torch.tensor(ks)[:, None]                  # [B, k]
    for name, probs, used in (("target_probs", target_probs, used_p), ("draft_probs", draft_probs, used_q)):
        if probs is None:
            continue
        rows = probs.detach().double().cpu()[used]                                  # [num_used, V]
        if not torch.isfinite(rows).all() or (rows < 0).any():
            raise ValueError(f"{name} must be finite and non-negative")
        if rows.numel() and ((rows.sum(-1) - 1).abs() > 1e-3).any():
            raise ValueError(f"{name}: every distribution that is read must sum to 1")
    return B, k, ks, greedy


def rejection_sample(draft_token_ids: torch.Tensor, draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor,
                     generators: Optional[list] = None, num_draft_tokens: Optional[list] = None,
                     greedy: Optional[list] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep a prefix of the drafts, then add one target token; row b reads only its first k_b drafts.

    draft_token_ids [B, k] int64 (entries past k_b = num_draft_tokens[b] are ignored, e.g. -1);
    draft_probs [B, k, V], or None when the proposer has no distribution (n-gram): q is then one-hot at
    the draft token, so acceptance probability is p(x) and the residual is p with x removed;
    target_probs [B, k+1, V]: p_1..p_{k+1}, position k_b holding the bonus distribution of row b.
    generators[b] makes every draw of row b (the uniforms, then the one residual or bonus draw) come from
    that generator, so a seeded request samples the same tokens in any batch. Greedy rows use argmax p
    and no randomness at all.
    Returns (tokens [B, k+1] int64: accepted drafts, then the replacement or bonus token, then -1;
    num_accepted [B] int64), so row b has num_accepted[b] + 1 valid tokens.
    """
    B, k, ks, greedy = _check_inputs(draft_token_ids, draft_probs, target_probs, generators, num_draft_tokens,
                                     greedy)
    # float64 on the CPU: exact enough that p == q gives ratio exactly 1, and the generators are CPU ones.
    p_all = target_probs.detach().double().cpu()                                   # [B, k+1, V]
    q_all = None if draft_probs is None else draft_probs.detach().double().cpu()   # [B, k, V]
    drafts = draft_token_ids.tolist()
    # Per-position numbers the loop reads, gathered once (padding ids clamped: gathered, never used).
    x = draft_token_ids.cpu().clamp(0, p_all.shape[-1] - 1)[..., None]            # [B, k, 1]
    p_x = p_all[:, :k].gather(-1, x)[..., 0].tolist()                              # p_i(x_i)
    q_x = [[1.0] * k] * B if q_all is None else q_all.gather(-1, x)[..., 0].tolist()   # q_i(x_i); one-hot: 1
    best = p_all.argmax(-1).tolist()                                               # greedy: argmax p_i
    rows, num_accepted = [], []
    for b in range(B):
        g = generators[b] if generators is not None else None
        n = 0                                              # drafts accepted so far
        while n < ks[b]:
            if greedy[b]:
                ok = drafts[b][n] == best[b][n]            # accept while the draft is the target's argmax
            else:                                          # accept with prob min(1, p/q): u < p/q, as u*q < p
                ok = float(torch.rand((), dtype=torch.float64, generator=g)) * q_x[b][n] < p_x[b][n]
            if not ok:
                break
            n += 1
        if greedy[b]:                                      # mismatch at n: argmax p_n; all accepted: bonus
            extra = best[b][n]
        else:
            dist = p_all[b, n]                             # all k_b accepted: the bonus token from p_{k_b+1}
            if n < ks[b]:                                  # rejected at n: redraw from norm(max(0, p - q))
                if q_all is None:                          # q one-hot at x: the residual is p without x
                    residual = dist.clone()
                    residual[drafts[b][n]] = 0
                else:
                    residual = (dist - q_all[b, n]).clamp(min=0)
                if residual.sum() > 0:                     # all zero only if p == q (no rejection possible)
                    dist = residual
            extra = int(torch.multinomial(dist, 1, generator=g))   # multinomial normalises the residual
        rows.append(drafts[b][:n] + [extra] + [-1] * (k - n))
        num_accepted.append(n)
    dev = target_probs.device
    return (torch.tensor(rows, dtype=torch.int64, device=dev).view(B, k + 1),
            torch.tensor(num_accepted, dtype=torch.int64, device=dev))


def rejection_sample_batched(draft_token_ids: torch.Tensor, draft_probs: Optional[torch.Tensor],
                             target_probs: torch.Tensor, generators: list, num_draft_tokens: list,
                             greedy: list) -> tuple[torch.Tensor, torch.Tensor]:
    """``rejection_sample``'s rule, every row at once on target_probs' device, no loop and no host sync: the
    engine's fast path (the reference above stays the definition, and exercise 4's target). Same arguments and
    returns, built by the engine (not re-checked). What differs is only how the randomness is drawn: every row
    draws k uniforms up front (the reference stops at the first rejection) and picks its last token by the
    exponential race (``sampler.race``), so a seeded row samples the same in any batch, but not the same tokens
    as the reference; tests/test_batched_rejection.py holds the two to one distribution, and greedy rows equal.

    Per row b, with x_i its drafts, u_i ~ U[0, 1): accept while u_i q_i(x_i) < p_i(x_i) (greedy: x_i = argmax p_i),
    n = the accepted prefix's length (a cumulative product); then the token at n from p_n, or, when x_n was
    rejected, from the residual max(0, p_n - q_n) (q one-hot: p_n without x_n)."""
    from minibatch.sampling.sampler import exponential_noise, race
    p = target_probs                                                             # [B, k+1, V]
    B, k1, V = p.shape
    k, dev = k1 - 1, p.device
    x = draft_token_ids.to(dev).clamp(0, V - 1)                                 # [B, k] (padding: never read)
    ks = torch.tensor(num_draft_tokens, device=dev)
    greedy = torch.tensor(greedy, device=dev)
    u = torch.rand(B, k, device=dev, dtype=p.dtype)                             # unseeded rows
    e = exponential_noise((B, V), None, dev).to(p.dtype)
    for b, g in enumerate(generators):
        if g is not None:                         # a seeded row's draws all come from its own generator
            u[b] = torch.rand(k, generator=g, device=g.device, dtype=p.dtype).to(dev)
            e[b] = exponential_noise(V, g, dev).to(p.dtype)
    p_x = p[:, :k].gather(-1, x[..., None])[..., 0]                             # [B, k] p_i(x_i)
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, x[..., None])[..., 0]
    best = p.argmax(-1)                                                         # [B, k+1]
    ok = torch.where(greedy[:, None], x == best[:, :k], u * q_x < p_x)
    ok &= torch.arange(k, device=dev)[None] < ks[:, None]
    n = ok.long().cumprod(1).sum(1)                                             # [B] drafts accepted
    at = n.clamp(max=k - 1)[:, None]                                            # the rejected position, if any
    dist = p.gather(1, n[:, None, None].expand(B, 1, V))[:, 0]                  # [B, V] p_n
    if draft_probs is None:
        residual = dist.scatter(1, x.gather(1, at), 0.0)
    else:
        residual = (dist - draft_probs.gather(1, at[..., None].expand(B, 1, V))[:, 0]).clamp(min=0)
    use = (n < ks) & (residual.sum(-1) > 0)                                    # all zero only if p == q
    extra = race(torch.where(use[:, None], residual, dist), e)                 # unnormalised: race needs no sum
    extra = torch.where(greedy, best.gather(1, n[:, None])[:, 0], extra)
    j = torch.arange(k + 1, device=dev)[None]
    tokens = torch.where(j < n[:, None], torch.cat([x, x[:, :1]], 1), -1)
    return tokens.scatter(1, n[:, None], extra[:, None]), n


# -- token trees ------------------------------------------------------------------------------------------------------

def tree_rejection_sample(parents, tokens, target_probs: torch.Tensor, draft_probs: Optional[torch.Tensor] = None,
                          generator: Optional[torch.Generator] = None) -> tuple[list, list]:
    """Verify one sequence's token tree (``kv/tree.py``): walk down from the root, keep one path.

    parents [N+1] (node 0 the root, parents first), tokens [N+1] (node i's token; tokens[0], the root's, is
    not read), target_probs [N+1, V]: row i is the target's p for the token after node i.
    At each node the target's p there is matched against the node's children, in node order:

    * **draft_probs None**: the children were chosen *deterministically* (the drafter's top-k, as Medusa's
      and EAGLE-2's trees are). Try them in order: accept child x with probability p(x); on rejection set
      p(x) = 0 and renormalise, then try the next child. (Why it is exact: with p' = p renormalised after
      each rejection, P(emit x) = p'(x) * P(reach x) telescopes to p(x), as sampling from p while
      revealing "not x_1", "not x_2", ... one at a time.)
    * **draft_probs [N+1, V]**: row i is the q node i's children were drawn from, independently (SpecInfer's
      multi-draft rule, Miao et al. 2024 §4.2): accept child x with probability min(1, p(x)/q(x)); on
      rejection p <- norm(max(0, p - q)), the residual, which is what the next child is then checked against.
      Each child is then one chain rejection step (Leviathan et al. §2.3) whose target is the last residual.

    If every child is rejected (or the node is a leaf), the token after the path is drawn from what is left
    of p: a correction token, or a bonus one at a leaf. Every draw comes from ``generator``.
    Returns (the accepted path [0, c1, ..., ca], the tokens to append: the accepted drafts, then that one).
    """
    parents = tree.check_parents(parents)
    n = len(parents)
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    if len(tokens) != n:
        raise ValueError(f"tokens has {len(tokens)} entries for a tree of {n} nodes (root included)")
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 2 or target_probs.shape[0] != n:
        raise ValueError(f"target_probs must be [N+1, V] = [{n}, V], got {tuple(getattr(target_probs, 'shape', ()))}")
    V = target_probs.shape[1]
    if any(not isinstance(t, int) or not 0 <= t < V for t in tokens[1:]):
        raise ValueError(f"draft tokens {tokens[1:]} must be ints in the vocabulary [0, {V})")
    kids = tree.children(parents)
    inner = [i for i in range(n) if kids[i]]             # rows of q that are read: nodes with children
    if draft_probs is not None and (not isinstance(draft_probs, torch.Tensor) or draft_probs.shape != target_probs.shape):
        raise ValueError(f"draft_probs must be [N+1, V] = [{n}, {V}] (or None for deterministic children), "
                         f"got {tuple(getattr(draft_probs, 'shape', ()))}")
    p_all = target_probs.detach().double().cpu()
    q_all = None if draft_probs is None else draft_probs.detach().double().cpu()
    for name, probs, rows in (("target_probs", p_all, range(n)), ("draft_probs", q_all, inner)):
        if probs is None or not rows:
            continue
        r = probs[list(rows)]
        if not torch.isfinite(r).all() or (r < 0).any() or ((r.sum(-1) - 1).abs() > 1e-3).any():
            raise ValueError(f"{name}: every row that is read must be a distribution (finite, >= 0, sum 1)")

    def uniform() -> float:
        return float(torch.rand((), dtype=torch.float64, generator=generator))

    path = [0]
    while True:
        node = path[-1]
        p = p_all[node].clone()                          # what is left of the target's distribution here
        nxt = None
        for c in kids[node]:
            x = tokens[c]
            if q_all is None:                            # accept with p(x) / (mass left): renormalised p
                if uniform() * float(p.sum()) < float(p[x]):
                    nxt = c
                    break
                p[x] = 0.0
            else:                                        # accept with min(1, p(x)/q(x)), p normalised
                q = q_all[node]
                if uniform() * float(q[x]) < float(p[x]):
                    nxt = c
                    break
                residual = (p - q).clamp(min=0)
                if residual.sum() > 0:                   # all zero only if p == q (then no rejection happens)
                    p = residual / residual.sum()
        if nxt is None:
            extra = int(torch.multinomial(p, 1, generator=generator))   # multinomial normalises p
            return path, [tokens[i] for i in path[1:]] + [extra]
        path.append(nxt)
