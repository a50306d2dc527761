"""Mutant (exercise 2): computes in float32 and returns float32 whatever the query's dtype."""
import torch


def paged_attention_torch(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
    T, H, D = query.shape
    N, bs, Hkv, _ = key_cache.shape
    out = torch.zeros(T, H, D)                                # BUG: dtype=query.dtype
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
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out
