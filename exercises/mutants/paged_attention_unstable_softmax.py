"""Mutant (exercise 2): a hand-written softmax, exp(s) / sum exp(s), without subtracting the row max:
large scores overflow to inf, and inf / inf is NaN."""
import torch


def paged_attention_torch(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
    T, H, D = query.shape
    N, bs, Hkv, _ = key_cache.shape
    out = torch.zeros_like(query)
    qsl = query_start_loc.tolist()
    for b, L in enumerate(seq_lens.tolist()):
        s, e = qsl[b], qsl[b + 1]
        n = e - s
        blocks = block_tables[b, :-(-L // bs)].long()
        k = key_cache[blocks].reshape(-1, Hkv, D)[:L].float().repeat_interleave(H // Hkv, dim=1)
        v = value_cache[blocks].reshape(-1, Hkv, D)[:L].float().repeat_interleave(H // Hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[s:e].float(), k) * scale
        q_pos = torch.arange(L - n, L)[:, None]
        scores = scores.masked_fill(torch.arange(L)[None, :] > q_pos, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", (scores.exp() / scores.exp().sum(-1, keepdim=True)), v)   # BUG: no max subtracted.to(query.dtype)
    return out
