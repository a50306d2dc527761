"""Paged attention backends: the same answer four ways, and the checks they share.

Every backend reads the step's K/V from the paged cache (this step's own K/V are
stored there first), position p of sequence b living in physical block
``block_tables[b, p // block_size]`` at offset ``p % block_size``, and computes
causal attention with a context offset: query i of sequence b sits at position
``seq_lens[b] - q_len_b + i``. Grouped-query attention: query head h reads kv head
``h // (H // Hkv)``.

A token tree adds one mask (SpecInfer, Miao et al. 2024, §4.1): ``tree_bits`` [T] int64, bit i of row t set =
query t sees this step's token i (cache index ``context_len + i``); the context stays visible and -1 is
plain causal. Query t sees key j iff ``j <= its index`` and (``j < context_len`` or that bit is set).

  "loop"    -- the teaching version: one sequence at a time, gather its K/V through its block table
               into a contiguous [L, Hkv, D], then a plain masked softmax. Read this one first.
  "batched" -- the default on a GPU: the rows are split into decodes (q_len 1) and the rest (prefill,
               chunks, verification), and each group is gathered at once into padded
               [G, L, Hkv, D] and handed to ``scaled_dot_product_attention`` with one mask. What it
               derives from the metadata (gather indices, masks) is built once per step, not per layer.
  "triton"  -- ``kernels.paged_attention``: reads blocks in place with an online softmax; pure-decode steps go
               to ``kernels.flash_decode`` (full tiles, the context split over programs).
  "cpu"     -- the default on a CPU (``attention.default_backend``): ``cpu_attention.py``, a small C++
               operator (vLLM's CPU attention, compiled at first use) that reads the blocks in place with an
               online softmax, OpenMP over (sequence, KV head), for the rows of up to LONG_QUERY queries;
               longer rows (prefill chunks) go through "batched"'s SDPA in the same step. "batched" where the
               operator cannot be built (said once, in a warning).

The public functions (``store_kv_torch``, ``paged_attention_loop``, ``paged_attention_batched``) check
their inputs (``checks.py``), so a student or a test calling one directly gets a clear error. Inside the engine the
metadata was checked once by ``AttentionMetadata.build``, so ``get(backend)`` hands out the unchecked
bodies unless debug checks are on; the exception is the teaching loop, which the engine calls as the
public function (checks included), so that a student's version can stand in for it.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from minibatch.kv import cpu_attention
from minibatch.kv.checks import _check_attention, _check_cache, check_accepts
from minibatch.kv.metadata import AttentionMetadata


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
    _store(key[keep], value[keep], key_cache, value_cache, slots)


def _store(key, value, key_cache, value_cache, slot_mapping) -> None:
    """The store itself, on slots already checked. A slot of -1 (a padding row of a fixed-shape decode batch,
    ``engine/input_batch.py``) writes nowhere, with no data-dependent shape: it rewrites row 0's slot with row 0's
    own K/V, a duplicate write of equal values, so the order of the writes cannot matter (row 0 is always real)."""
    N, bs, Hkv, D = key_cache.shape
    pad = slot_mapping < 0                                                       # [T]
    slots = torch.where(pad, slot_mapping[:1], slot_mapping)
    key, value = (torch.where(pad[:, None, None], x[:1], x) for x in (key, value))
    key_cache.view(N * bs, Hkv, D).index_copy_(0, slots, key)
    value_cache.view(N * bs, Hkv, D).index_copy_(0, slots, value)


# -- attend: the teaching version (backend "loop") ---------------------------------------------------------
def paged_attention_loop(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, *,
                         tree_bits=None):
    """query [T, H, D] -> out [T, H, D]; one sequence at a time, gathered through its block table.
    tree_bits [T] int64 or None: the token-tree mask of each row (see the module docstring)."""
    _check_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                     "paged_attention_loop", tree_bits)
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
        if tree_bits is not None:
            # Tree attention (SpecInfer, Miao et al. 2024, §4.1): this step's n tokens are a tree's nodes, and
            # query i sees key L - n + r (node r) only if bit r of its row is set: its ancestors and itself.
            r = torch.arange(L, device=query.device) - (L - n)            # [L]: node index; < 0 in the context
            bit = (tree_bits[s:e, None] >> r.clamp(0, 63)[None, :]) & 1    # [n, L]: bit r of row i
            causal &= (r < 0)[None, :] | (bit == 1)                        # [n, L]: context, or an ancestor
        scores = scores.masked_fill(~causal, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(query.dtype)
    return out


# -- attend: the batched backend (the GPU's default) -------------------------------------------------------------
def paged_attention_batched(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, *,
                            tree_bits=None):
    """Same as paged_attention_loop, for the whole batch at once (two groups: decodes and the rest)."""
    _check_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                     "paged_attention_batched", tree_bits)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    md = AttentionMetadata(None, block_tables, seq_lens, query_start_loc, 0, 0, None,
                           lens, [e - s for s, e in zip(qsl[:-1], qsl[1:])], tree_bits=tree_bits)
    return _batched(query, key_cache, value_cache, md, scale)


def _buckets(rows: list, lens: list, max_waste: float = 0.3, max_buckets: int = 4) -> list:
    """Decode rows split by context length, so that padding every row of a group to its longest wastes
    little: the gather copies G x L_max rows of K and V per layer, and copying is most of the cost."""
    if len(rows) <= 2:
        return [rows]
    order = sorted(rows, key=lambda b: -lens[b])
    out = [[order[0]]]
    for b in order[1:]:
        if lens[b] < (1 - max_waste) * lens[out[-1][0]] and len(out) < max_buckets:
            out.append([])
        out[-1].append(b)
    return out if len(out) > 1 else [rows]         # one bucket: keep batch order (no scatter needed)


def _static_decode_plan(md, block_size: int, device) -> tuple:
    """A fixed-shape decode batch (``md.static``: every row one query, the shapes fixed by the buffers, not by
    the lengths): the plan from the device tensors alone, so a CUDA graph can replay it. Each row gathers the
    whole width of its block table, L = W * block_size positions, and masks past its own length; a padding row
    (length 0, table -1) reads slot 0 through position 0, finite and discarded."""
    bt = md.block_tables.to(device).long().clamp(min=0)                           # [P, W]
    L = bt.shape[1] * block_size
    j = torch.arange(L, device=device)
    slots = bt[:, j // block_size] * block_size + j % block_size                  # [P, L]
    valid = j[None] < md.seq_lens.to(device).long().clamp(min=1)[:, None]         # [P, L]
    slots = torch.where(valid, slots, slots[:, :1])            # past the length: position 0 again (see _plan)
    return slots, None, None, valid[:, None, None, :]                            # mask [P, 1, 1, L]


def _plan(md, block_size: int, device) -> list:
    """Once per step, for each group of rows (decodes; the rest): the gather slots [G, L], the flat query
    rows [G, Q] (None: the group is every row, in order, the same number of queries each), which of those are
    real [G, Q], and the mask [G, 1, Q, L] (None: nothing to mask), causal with each row's context offset, and
    for tree rows (only ever in the rest: a tree of 2+ nodes has q_len > 1; a root alone sees what a decode
    sees) the tree's."""
    if "batched" in md.plan:
        return md.plan["batched"]
    if md.static:
        md.plan["batched"] = [_static_decode_plan(md, block_size, device)]
        return md.plan["batched"]
    groups = []
    decodes = [b for b, n in enumerate(md.query_lens_list) if n == 1]
    rest = [b for b, n in enumerate(md.query_lens_list) if n > 1]
    for rows in (*_buckets(decodes, md.seq_lens_list), rest):
        if rows:
            groups.append(_group(md, rows, block_size, device))
    md.plan["batched"] = groups
    return groups


def _group(md, rows: list, block_size: int, device) -> tuple:
    """One group's (slots [G, L], q_rows [G, Q] or None, q_valid [G, Q] or None, mask [G, 1, Q, L] or None)
    for the sequences ``rows`` of the step (see ``_plan``)."""
    q_lens, s_lens = md.query_lens_list, md.seq_lens_list
    L, Q = max(s_lens[b] for b in rows), max(q_lens[b] for b in rows)
    sl = torch.tensor([s_lens[b] for b in rows], device=device)                  # [G]
    ql = torch.tensor([q_lens[b] for b in rows], device=device)                  # [G]
    j = torch.arange(L, device=device)
    valid = j[None] < sl[:, None]                                                # [G, L]
    bt = md.block_tables.to(device)[torch.tensor(rows, device=device)].long()    # [G, W]
    slots = bt[:, (j // block_size).clamp(max=bt.shape[1] - 1)].clamp(min=0) * block_size + j % block_size
    # A padding position (past a row's own length) gathers the row's position 0 instead: a real, finite
    # key that the mask then hides. (An unowned slot may hold NaN, and a masked 0 * NaN is still NaN.)
    slots = torch.where(valid, slots, slots[:, :1])                              # [G, L]
    i = torch.arange(Q, device=device)
    q_pos = (sl - ql)[:, None] + i[None]                                         # [G, Q]
    mask = (j[None, None, :] <= q_pos[:, :, None])[:, None]                      # [G, 1, Q, L]
    if Q == 1 and min(s_lens[b] for b in rows) == L:
        mask = None                                                              # decodes of one length
    if rows == list(range(len(q_lens))) and all(q_lens[b] == Q for b in rows):
        # every row of the batch, in order, Q queries each (decodes; one sequence's chunk or verify; a batch
        # verifying k drafts each): the flat [T, H, D] is [G, Q, H, D] already, no gather or scatter
        q_rows = q_valid = None
    else:
        starts = [0, *itertools.accumulate(q_lens)]                              # each row's first query
        q_valid = i[None] < ql[:, None]                                          # [G, Q]
        q_rows = (torch.tensor([starts[b] for b in rows], device=device)[:, None] + i[None]) * q_valid
    if md.tree_bits is not None and Q > 1:        # the tree mask, folded in once per step (see the loop)
        bits = md.tree_bits.to(device)                                             # [T]
        bits = bits.view(len(rows), Q) if q_rows is None else bits[q_rows]         # [G, Q]; padding: never read
        r = j[None] - (sl - ql)[:, None]                                           # [G, L] node index
        bit = (bits[:, :, None] >> r.clamp(0, 63)[:, None, :]) & 1                 # [G, Q, L]
        mask = mask & ((r < 0)[:, None, :] | (bit == 1))[:, None]                  # [G, 1, Q, L]
    return slots, q_rows, q_valid, mask


def _batched(query, key_cache, value_cache, md, scale):
    T, H, D = query.shape
    if T == 0:
        return torch.zeros_like(query)
    out = None
    for slots, q_rows, q_valid, mask in _plan(md, key_cache.shape[1], query.device):
        o = _sdpa_group(query, key_cache, value_cache, slots, q_rows, mask, scale)    # [G, Q, H, D]
        if q_rows is None:
            return o.reshape(T, H, D)                                                # the flat rows, in order
        if out is None:           # one spare row T: a group's padding queries land there (no boolean mask,
            out = query.new_empty(T + 1, H, D)                              # so no host sync), then dropped
        rows = torch.where(q_valid, q_rows, T).view(-1)
        out.index_copy_(0, rows, o.reshape(-1, H, D))
    return out[:T]


def _sdpa_group(query, key_cache, value_cache, slots, q_rows, mask, scale):
    """One group's attention: its context gathered out of the pool, then one SDPA call. -> [G, Q, H, D]"""
    T, H, D = query.shape
    N, bs, Hkv, _ = key_cache.shape
    # CPU matmuls in half precision are slow or missing: compute in float32 there, natively on a GPU
    dt = torch.float32 if query.device.type == "cpu" else query.dtype
    flat_k, flat_v = key_cache.view(N * bs, Hkv, D), value_cache.view(N * bs, Hkv, D)
    G, L = slots.shape                              # (index_select copies rows about 2x faster than x[slots])
    k = flat_k.index_select(0, slots.view(-1)).view(G, L, Hkv, D).to(dt).transpose(1, 2)   # [G, Hkv, L, D]
    v = flat_v.index_select(0, slots.view(-1)).view(G, L, Hkv, D).to(dt).transpose(1, 2)
    q = query.view(G, -1, H, D) if q_rows is None else query[q_rows]                 # [G, Q, H, D]
    o = F.scaled_dot_product_attention(q.to(dt).transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=H != Hkv).transpose(1, 2)          # [G, Q, H, D]
    return o.to(query.dtype)


# -- cpu: the C++ operator for the short rows, SDPA for the long chunks ------------------------------------------
# Measured on the shipped target's shapes (4 heads of 64, one row against a 512-token context, one thread;
# ``python -m minibatch.bench attention --cpu`` prints the same comparison): the operator takes 0.16x of "batched"'s time for one query,
# 0.5-0.6x for 4-8 (verify chains, small trees), and 1.4x-4.5x for 16 and more, where SDPA's matrix products
# win (``cpu_attention.py`` says why). So a row of up to LONG_QUERY queries is read in place, and a longer
# one (a prefill chunk, a big tree) goes through "batched"'s gather and SDPA, in the same step.
LONG_QUERY = 8


def _hybrid_plan(md, block_size: int, device) -> tuple:
    """Once per step: (seq_lens for the operator [B] int32, the long rows' group or None, where its valid
    outputs come from [n] and go to [n]). A long row's seq_len is 0 for the operator, which then reads no
    context for it (the padding row's case) and writes zeros that the SDPA rows overwrite."""
    if "cpu" in md.plan:
        return md.plan["cpu"]
    long_rows = [] if md.static else [b for b, n in enumerate(md.query_lens_list) if n > LONG_QUERY]
    if not long_rows:
        plan = (md.seq_lens, None, None, None)
    else:
        seq_lens = md.seq_lens.clone()
        seq_lens[long_rows] = 0
        group = _group(md, long_rows, block_size, device)
        _, q_rows, q_valid, _ = group
        src = None if q_rows is None else q_valid.reshape(-1).nonzero().squeeze(1)    # [n]: real queries only
        dst = None if q_rows is None else q_rows.reshape(-1)[src]                     # [n]: their flat rows
        plan = (seq_lens, group, src, dst)
    md.plan["cpu"] = plan
    return plan


def _cpu_attend(query, key_cache, value_cache, md, scale):
    T, H, D = query.shape
    seq_lens, group, src, dst = _hybrid_plan(md, key_cache.shape[1], query.device)
    if group is not None and group[1] is None:            # every row long: SDPA alone
        return _sdpa_group(query, key_cache, value_cache, group[0], None, group[3], scale).reshape(T, H, D)
    out = cpu_attention.attend(query, key_cache, value_cache, md, scale, seq_lens=seq_lens)
    if group is not None:
        slots, q_rows, _, mask = group
        o = _sdpa_group(query, key_cache, value_cache, slots, q_rows, mask, scale).reshape(-1, H, D)
        out.index_copy_(0, dst, o.index_select(0, src))
    return out


# -- triton -------------------------------------------------------------------------------------------------------
def _triton_store(key, value, key_cache, value_cache, slot_mapping):
    from kernels.store_kv import launch_store_kv
    launch_store_kv(key, value, key_cache, value_cache, slot_mapping)


def _pure_decode(query, md) -> bool:
    """Every sequence brings exactly one token and there is no tree: the decode-only kernel's case."""
    return md.tree_bits is None and md.max_query_len == 1 and query.shape[0] == md.seq_lens.shape[0]


def _triton_attend(query, key_cache, value_cache, md, scale):
    from kernels.flash_decode import _launch_decode
    from kernels.paged_attention import _launch
    out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    if _pure_decode(query, md):                   # full tiles, the context split over programs
        return _launch_decode(query, key_cache, value_cache, md.block_tables, md.seq_lens, scale, out)
    return _launch(query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                   scale, md.max_query_len, out, tree_bits=md.tree_bits)


def _tree(md, fn=None) -> dict:
    """tree_bits=, only when the step has a tree: a student's function (ex2, ex9) has no such parameter, so a tree
    step that reaches one without it (``fn``) stops with a clear error rather than a TypeError deep inside."""
    if md.tree_bits is None:
        return {}
    if fn is not None:
        check_accepts(fn, ["tree_bits"], f"{fn.__module__}.{fn.__name__}")
    return {"tree_bits": md.tree_bits}


def _checked(fn):
    """A backend body that re-checks its inputs on every call (debug checks)."""
    def attend(query, key_cache, value_cache, md, scale):
        return fn(query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale,
                  **_tree(md, fn))
    return attend


def get(backend: str, checked: bool = False):
    """(store, attend) of a backend; attend(query, key_cache, value_cache, metadata, scale) -> [T, H, D]."""
    if backend == "cpu":          # the C++ operator, built at the first call; where it cannot be, "batched"
        if cpu_attention.load() is None:                 # (load() said why, once)
            backend = "batched"
        elif checked:
            return store_kv_torch, _checked(cpu_attention.paged_attention_cpu)
        else:
            return cpu_attention.store, _cpu_attend
    if backend == "triton":
        try:
            import kernels                        # lazily: the other backends need no Triton
        except ImportError as e:
            raise ImportError(f"the 'triton' backend needs the kernels package and Triton: {e}") from e
        if checked:                               # the public, checked kernel (ex9 hands its decodes to a student's)
            return kernels.store_kv, lambda q, kc, vc, md, s: kernels.paged_attention(
                q, kc, vc, md.block_tables, md.seq_lens, md.query_start_loc, s, **_tree(md))
        return _triton_store, lambda q, kc, vc, md, s: _triton_attend(q, kc, vc, md, s)   # by name: patchable
    if checked:
        attend = paged_attention_loop if backend == "loop" else paged_attention_batched
        return store_kv_torch, _checked(attend)
    if backend == "loop":            # looked up at each call, so exercises.patch_engine can swap in a student's
        return _store, lambda q, kc, vc, md, s: paged_attention_loop(q, kc, vc, md.block_tables, md.seq_lens,
                                                                     md.query_start_loc, s,
                                                                     **_tree(md, paged_attention_loop))
    return _store, _batched
