"""Paged attention: the metadata of one flat batch, and three backends that attend over the paged cache.

One engine step feeds the model T new tokens from B sequences: sequence b owns
query rows ``query_start_loc[b] : query_start_loc[b+1]`` (q_len_b of them) and
has ``seq_lens[b]`` tokens of context *including* those new ones, so its query
i sits at position ``seq_lens[b] - q_len_b + i`` and attends causally to
positions 0..that. Decode (q_len 1), a prefill, a later prefill chunk and a
speculative verification (1 + k queries) are all this one case (vLLM's
"unified" attention; Kwon et al., SOSP'23, §4.1 for the paged form).

Per layer, ``PagedAttention`` first **stores** the new tokens' K and V at their
slots (the slot mapping), then **attends**: position p of sequence b is found
in physical block ``block_tables[b, p // block_size]`` at offset
``p % block_size``. Grouped-query attention: query head h reads kv head
``h // (H // Hkv)``.

Backends (same inputs, same answer; tests hold them equal):
  "torch"  -- the teaching version: per sequence, gather its K/V through its
              block table into a contiguous [L, Hkv, D], then plain masked softmax.
  "dense"  -- vectorised: every sequence gathered at once into padded
              [B, max_seq_len, Hkv, D], one batched masked softmax, no Python loop.
  "triton" -- ``kernels.paged_attention`` (reads blocks in place, online softmax).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minibatch.kv.kv_cache import KVCache, block_table_tensor, slot_mapping as _slot_mapping

BACKENDS = ("dense", "torch", "triton")


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor       # [T] int64, -1 = do not store
    block_tables: torch.Tensor       # [B, max_blocks] int32, -1 padded
    seq_lens: torch.Tensor           # [B] int32, context length including this step's tokens
    query_start_loc: torch.Tensor    # [B+1] int32
    max_query_len: int
    max_seq_len: int

    @classmethod
    def build(cls, block_tables, num_computed, num_new, block_size: int, device="cpu") -> "AttentionMetadata":
        """Sequence b has num_computed[b] tokens in the cache already and feeds num_new[b] new ones."""
        if not len(block_tables) == len(num_computed) == len(num_new):
            raise ValueError(f"block_tables, num_computed, num_new have different lengths "
                             f"({len(block_tables)}, {len(num_computed)}, {len(num_new)})")
        if any(n < 1 for n in num_new) or any(c < 0 for c in num_computed):
            raise ValueError(f"need num_new >= 1 and num_computed >= 0, got {list(num_new)}, {list(num_computed)}")
        lens = [c + n for c, n in zip(num_computed, num_new)]
        slots = _slot_mapping(block_tables, num_computed, num_new, block_size, device)
        starts = [0]
        for n in num_new:
            starts.append(starts[-1] + n)
        return cls(slots, block_table_tensor(block_tables, device),
                   torch.tensor(lens, dtype=torch.int32, device=device),
                   torch.tensor(starts, dtype=torch.int32, device=device),
                   max(num_new, default=0), max(lens, default=0))


# -- checks: one clear error before anything is written ------------------------------
def _check_cache(key_cache, value_cache, who):
    for name, x in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a tensor, got {type(x).__name__}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"{who}: key_cache and value_cache must both be [num_blocks, block_size, Hkv, D], "
                         f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.dtype != value_cache.dtype or key_cache.device != value_cache.device:
        raise TypeError(f"{who}: key_cache and value_cache differ in dtype or device")


def _check_metadata(block_tables, seq_lens, query_start_loc, num_blocks, block_size, T, device, who):
    named = dict(block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc)
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a tensor, got {type(x).__name__}")
        if x.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{who}: {name} must be int32 or int64, got {x.dtype}")
        if x.device != device:
            raise ValueError(f"{who}: {name} is on {x.device}, the cache on {device}")
    B = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if block_tables.dim() != 2 or block_tables.shape[0] != B or query_start_loc.shape != (B + 1,):
        raise ValueError(f"{who}: want block_tables [B, max_blocks], seq_lens [B], query_start_loc [B+1]; got "
                         f"{tuple(block_tables.shape)}, {tuple(seq_lens.shape)}, {tuple(query_start_loc.shape)}")
    qsl, sl = query_start_loc.long(), seq_lens.long()
    q_lens = qsl[1:] - qsl[:-1]
    n_used = (sl.clamp(min=0) + block_size - 1) // block_size             # blocks each sequence reads
    used = torch.arange(block_tables.shape[1], device=device)[None] < n_used[:, None]
    bt = block_tables.long()
    if int(qsl[0]) != 0 or int(qsl[-1]) != T:
        raise ValueError(f"{who}: query_start_loc must run from 0 to T = {T}, got {qsl.tolist()}")
    if bool((q_lens < 0).any()) or bool((sl < q_lens).any()):
        raise ValueError(f"{who}: need non-decreasing query_start_loc and seq_lens >= query lengths "
                         f"(seq_lens counts this step's tokens too); got {sl.tolist()}, {qsl.tolist()}")
    if B and int(n_used.max()) > block_tables.shape[1]:
        raise ValueError(f"{who}: seq_lens {sl.tolist()} need more blocks than block_tables has columns "
                         f"({block_tables.shape[1]})")
    if bool((used & ((bt < 0) | (bt >= num_blocks))).any()):
        raise ValueError(f"{who}: a block table entry a sequence reads is outside 0..{num_blocks - 1}")


def _check_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, who):
    _check_cache(key_cache, value_cache, who)
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        raise ValueError(f"{who}: query must be a tensor [T, H, D]")
    N, bs, Hkv, D = key_cache.shape
    if query.shape[2] != D or query.shape[1] % Hkv:
        raise ValueError(f"{who}: query [T, H={query.shape[1]}, D={query.shape[2]}] does not fit a cache of "
                         f"{Hkv} kv heads of dim {D} (H must be a multiple of Hkv)")
    if query.dtype != key_cache.dtype or query.device != key_cache.device:
        raise TypeError(f"{who}: query is {query.dtype} on {query.device}, the cache {key_cache.dtype} "
                        f"on {key_cache.device}; they must match")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"{who}: scale must be a finite number, got {scale!r}")
    _check_metadata(block_tables, seq_lens, query_start_loc, N, bs, query.shape[0], query.device, who)


# -- store ------------------------------------------------------------------------------
def store_kv_torch(key, value, key_cache, value_cache, slot_mapping) -> None:
    """key, value [T, Hkv, D] -> cache slot slot_mapping[t] (in place); slot -1 is skipped."""
    who = "store_kv_torch"
    _check_cache(key_cache, value_cache, who)
    N, bs, Hkv, D = key_cache.shape
    for name, x in (("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or tuple(x.shape[1:]) != (Hkv, D) or x.dim() != 3:
            raise ValueError(f"{who}: {name} must be [T, {Hkv}, {D}] to fit the cache")
        if x.dtype != key_cache.dtype or x.device != key_cache.device:
            raise TypeError(f"{who}: {name} is {x.dtype} on {x.device}, the cache {key_cache.dtype} "
                            f"on {key_cache.device}")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.shape != (key.shape[0],) \
            or value.shape[0] != key.shape[0] or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{who}: slot_mapping must be an int tensor [T] with T = {key.shape[0]} for key and value")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError(f"{who}: the caches must be contiguous (a flat [slots] view must alias them)")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if bool((slot_mapping < -1).any()) or bool((slots >= N * bs).any()):
        raise ValueError(f"{who}: a slot is outside -1..{N * bs - 1} (num_blocks * block_size)")
    if slots.unique().numel() != slots.numel():
        raise ValueError(f"{who}: two tokens map to one slot")
    key_cache.view(N * bs, Hkv, D).index_copy_(0, slots, key[keep])
    value_cache.view(N * bs, Hkv, D).index_copy_(0, slots, value[keep])


# -- attend: the teaching version ---------------------------------------------------------
def paged_attention_torch(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
    """query [T, H, D] -> out [T, H, D]; one sequence at a time, gathered through its block table."""
    _check_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                     "paged_attention_torch")
    T, H, D = query.shape
    N, bs, Hkv, _ = key_cache.shape
    out = torch.zeros_like(query)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, L in enumerate(lens):
        s, e = qsl[b], qsl[b + 1]
        n = e - s
        if n == 0:
            continue
        blocks = block_tables[b, :-(-L // bs)].long()                  # its physical blocks, in logical order
        k = key_cache[blocks].reshape(-1, Hkv, D)[:L].float()          # [L, Hkv, D]: positions 0..L-1
        v = value_cache[blocks].reshape(-1, Hkv, D)[:L].float()
        k, v = (x.repeat_interleave(H // Hkv, dim=1) for x in (k, v))  # [L, H, D]: head h -> kv head h // G
        scores = torch.einsum("qhd,khd->hqk", query[s:e].float(), k) * scale   # [H, n, L]
        q_pos = torch.arange(L - n, L, device=query.device)[:, None]  # its queries are the last n positions
        causal = torch.arange(L, device=query.device)[None, :] <= q_pos  # [n, L]
        scores = scores.masked_fill(~causal, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(query.dtype)
    return out


# -- attend: vectorised ---------------------------------------------------------------------
def paged_attention_dense(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
    """Same as paged_attention_torch, for the whole batch at once through padded tensors."""
    _check_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                     "paged_attention_dense")
    T, H, D = query.shape
    N, bs, Hkv, _ = key_cache.shape
    B, G, dev = seq_lens.shape[0], H // Hkv, query.device
    if T == 0:
        return torch.zeros_like(query)
    qsl, sl = query_start_loc.long(), seq_lens.long()
    q_lens = qsl[1:] - qsl[:-1]
    L, Q = int(sl.max()), int(q_lens.max())
    # gather: context position j of sequence b lives at slot block_tables[b, j // bs] * bs + j % bs
    j = torch.arange(L, device=dev)
    valid = j[None] < sl[:, None]                                       # [B, L]: real context, not padding
    slots = block_tables.long()[:, j // bs].clamp(min=0) * bs + j % bs  # [B, L]
    K = key_cache.flatten(0, 1)[slots].float()                         # [B, L, Hkv, D]
    V = value_cache.flatten(0, 1)[slots].float()
    # padding slots may hold NaN or another sequence's K/V; zero them, since a masked weight 0 * NaN is NaN
    K, V = (torch.where(valid[..., None, None], x, 0.0) for x in (K, V))
    # scatter the flat queries into [B, Q, H, D]: token t is query i of sequence b
    t = torch.arange(T, device=dev)
    seq_of = torch.searchsorted(qsl[1:], t, right=True)                 # [T]
    i_of = t - qsl[seq_of]
    Qp = query.new_zeros((B, Q, H, D), dtype=torch.float32)
    Qp[seq_of, i_of] = query.float()
    q_pos = (sl - q_lens)[:, None] + torch.arange(Q, device=dev)[None]  # [B, Q]
    mask = valid[:, None, :] & (j[None, None, :] <= q_pos[:, :, None])   # [B, Q, L]
    scores = torch.einsum("bqkgd,bskd->bkgqs", Qp.view(B, Q, Hkv, G, D), K) * scale  # [B, Hkv, G, Q, L]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    O = torch.einsum("bkgqs,bskd->bqkgd", scores.softmax(dim=-1), V)   # [B, Q, Hkv, G, D]
    return O.reshape(B, Q, H, D)[seq_of, i_of].to(query.dtype)          # back to [T, H, D]


# -- the attention function the model calls --------------------------------------------------
class PagedAttention:
    """``model(input_ids, positions, PagedAttention(kv_cache, metadata))``: store, then attend, per layer."""

    def __init__(self, kv_cache: KVCache, metadata: AttentionMetadata, backend: str = "torch"):
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {list(BACKENDS)}")
        if not isinstance(kv_cache, KVCache) or not isinstance(metadata, AttentionMetadata):
            raise TypeError("PagedAttention(kv_cache: KVCache, metadata: AttentionMetadata, backend)")
        T = metadata.slot_mapping.shape[0] if isinstance(metadata.slot_mapping, torch.Tensor) else -1
        _check_metadata(metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                        kv_cache.num_blocks, kv_cache.block_size, T, kv_cache.device, "PagedAttention")
        if metadata.slot_mapping.device != kv_cache.device:
            raise ValueError(f"PagedAttention: slot_mapping is on {metadata.slot_mapping.device}, "
                             f"the cache on {kv_cache.device}")
        if backend == "triton":
            try:
                import kernels                        # lazily: the other backends need no Triton
                self._store, self._attend = kernels.store_kv, kernels.paged_attention
            except (ImportError, AttributeError) as e:
                raise ImportError(f"the 'triton' backend needs kernels.store_kv and kernels.paged_attention: {e}") \
                    from e
        else:
            self._store = store_kv_torch
            self._attend = paged_attention_torch if backend == "torch" else paged_attention_dense
        self.kv_cache, self.metadata, self.backend = kv_cache, metadata, backend

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c, md = self.kv_cache, self.metadata
        T = md.slot_mapping.shape[0]
        if q.dim() != 3 or q.shape[0] != T or q.shape[2] != c.head_dim or q.shape[1] % c.num_kv_heads:
            raise ValueError(f"PagedAttention: q must be [T={T}, H, D={c.head_dim}] with H a multiple of "
                             f"num_kv_heads={c.num_kv_heads}, got {tuple(q.shape)}")
        want = (T, c.num_kv_heads, c.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"PagedAttention: k and v must be {list(want)}, got {tuple(k.shape)}, {tuple(v.shape)}")
        if not q.dtype == k.dtype == v.dtype == c.dtype or not q.device == k.device == v.device == c.device:
            raise TypeError(f"PagedAttention: q/k/v are {q.dtype}/{k.dtype}/{v.dtype} on {q.device}, the cache "
                            f"{c.dtype} on {c.device}; they must match")
        key_cache, value_cache = c.key_cache(layer_idx), c.value_cache(layer_idx)
        self._store(k, v, key_cache, value_cache, md.slot_mapping)       # 1) this step's K/V into their slots
        return self._attend(q, key_cache, value_cache, md.block_tables, md.seq_lens,   # 2) attend
                            md.query_start_loc, 1.0 / math.sqrt(c.head_dim))
