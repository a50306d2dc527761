"""The KV cache tensors, and the slot mapping that says where each new token's K and V go.

One tensor holds every layer's keys and values, cut into blocks (Kwon et al.,
SOSP'23, §4.1-4.2):

    kv[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
       layer l's keys  = kv[l, 0]   [num_blocks, block_size, Hkv, D]
       layer l's values = kv[l, 1]

A token's **slot** is its place in that pool: ``slot = block_id * block_size +
offset``, where ``block_id = block_table[position // block_size]`` and
``offset = position % block_size``. The engine computes one slot per new token
(the **slot mapping**) so the attention backend can store K/V with a single
scatter, whatever mix of prefill and decode the batch is.

Block ids are the allocator's business (``block_allocator.py``); this module
only owns memory and the position -> slot arithmetic.

**Quantized blocks** (``kv_cache_dtype``, ``quant.py``): the pool is stored in the quantized dtype (fp8 or
int8, one byte a value) and its scales sit beside the blocks, so that whatever moves a block moves its scales:

    per_tensor      scales[num_layers, 2]                                  layer l's k_scale, v_scale: 1.0, or
                                                                           calibrated on the first batch
    per_token_head  scales[num_layers, 2, num_blocks, block_size, Hkv]     one per (slot, KV head), written
                                                                           by the store with the K/V

The store quantizes and every backend dequantizes inside its loop (``backends/loop.py``, ``batched.py``);
``dtype`` is the pool's storage dtype, ``model_dtype`` the one attention computes and returns in.
"""
from __future__ import annotations

from typing import Optional

import torch

from minibatch.kv import quant


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device="cpu", debug_nan: bool = False,
                 kv_cache_dtype: str = "auto", scale_granularity: str = "per_tensor",
                 calculate_kv_scales: bool = False):
        for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if block_size & (block_size - 1):                 # as the allocator and the kernels require
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.kv_cache_dtype = quant.check_kv_cache_dtype(kv_cache_dtype)
        self.scale_granularity = quant.check_scale_granularity(scale_granularity)
        self.model_dtype = dtype
        storage = quant.storage_dtype(self.kv_cache_dtype, dtype)
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        # debug_nan: a slot never written reads as NaN, so any read of one poisons the output and shows
        # (int8 has no NaN: its unwritten slots read as 0, with their scale of 1.0)
        fill = float("nan") if debug_nan and storage.is_floating_point else 0.0
        self.kv = torch.full(shape, fill, dtype=storage, device=device)
        self.scales = None                               # "auto": nothing to scale
        if self.kv_cache_dtype != "auto":
            per = self.scale_granularity == "per_token_head"
            self.scales = torch.ones(shape[:-1] if per else (num_layers, 2), dtype=quant.SCALE_DTYPE, device=device)
        if calculate_kv_scales and (self.scales is None or self.scale_granularity != "per_tensor"):
            raise ValueError("calculate_kv_scales calibrates per-tensor scales: it needs a quantized kv_cache_dtype "
                             "and scale_granularity='per_tensor'")
        self._to_calibrate = set(range(num_layers)) if calculate_kv_scales else set()
        # tensor parallelism (distributed/tp_engine.py) sets this to an all-reduce (max) over the ranks, so that
        # every rank calibrates on the amax over all heads: the scale one engine would take, the same on each rank
        self.reduce_amax = None

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def _layer(self, layer: int) -> int:
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer!r} is not in 0..{self.num_layers - 1}")
        return layer

    def key_cache(self, layer: int) -> torch.Tensor:
        return self.kv[self._layer(layer), 0]          # a view [num_blocks, block_size, Hkv, D]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.kv[self._layer(layer), 1]

    def layer_scales(self, layer: int) -> dict:
        """{} for "auto"; else {"k_scale", "v_scale"}: 0-dim views (per tensor) or [num_blocks, block_size, Hkv]
        views (per token and head), what the store and the backends take."""
        if self.scales is None:
            return {}
        s = self.scales[self._layer(layer)]
        return {"k_scale": s[0], "v_scale": s[1]}

    def set_scales(self, layer: int, k_scale: float, v_scale: float) -> None:
        """Per-tensor scales of one layer (from a checkpoint, or calibrated): positive and finite, or a ValueError."""
        if self.scales is None or self.scale_granularity != "per_tensor":
            raise ValueError("set_scales: only a quantized cache with per_tensor scales has per-layer scales")
        for name, v in (("k_scale", k_scale), ("v_scale", v_scale)):
            quant.check_scale(v, f"layer {layer}'s {name}")
        self.scales[self._layer(layer)] = torch.tensor([k_scale, v_scale], dtype=quant.SCALE_DTYPE)
        self._to_calibrate.discard(layer)

    def calibrate(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """calculate_kv_scales: the first batch a layer stores sets its scales, amax / max, and they never change
        again (vLLM's rule; the pitfall: a later, larger value clips)."""
        if layer in self._to_calibrate:
            amax = torch.stack([x.detach().abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
                                for x in (key, value)])                      # [2]: K's and V's
            if self.reduce_amax is not None:
                self.reduce_amax(amax)
            k_amax, v_amax = amax.tolist()
            self.set_scales(layer, quant.scale_from_amax(k_amax, self.kv_cache_dtype),
                            quant.scale_from_amax(v_amax, self.kv_cache_dtype))

    def adopt_scales(self, scales: torch.Tensor) -> None:
        """Per tensor: another cache's layer scales [num_layers, 2] (the disaggregated prefill instance's, with the
        K/V it sends) taken for every layer this cache has not calibrated yet, so that both sides quantize alike."""
        for layer in sorted(self._to_calibrate):
            self.set_scales(layer, *scales[layer].tolist())

    def copy_blocks(self, pairs) -> None:
        """Copy-on-write: block dst becomes a copy of block src, in every layer, keys and values."""
        pairs = [tuple(p) for p in pairs]
        if not pairs:
            return
        for p in pairs:
            if len(p) != 2 or not all(isinstance(b, int) and 0 <= b < self.num_blocks for b in p):
                raise ValueError(f"copy pair {p!r}: need (src, dst) block ids in 0..{self.num_blocks - 1}")
        dst = [d for _, d in pairs]
        if len(set(dst)) != len(dst) or set(dst) & {s for s, _ in pairs}:
            raise ValueError(f"copy pairs {pairs}: a destination twice, or a destination that is also a source")
        src_t = torch.tensor([s for s, _ in pairs], device=self.device)
        dst_t = torch.tensor(dst, device=self.device)
        self.kv[:, :, dst_t] = self.kv[:, :, src_t]     # the right side is gathered (copied) first
        if self._per_slot_scales():                     # a block's scales go where its values go
            self.scales[:, :, dst_t] = self.scales[:, :, src_t]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, num_layers: Optional[int] = None) -> None:
        """Token slot src[i]'s K/V to slot dst[i], in every layer (a tree's accepted path to consecutive
        slots) or in layers 0 .. num_layers-1 only (early exit's drafts, from scratch into the target's slots).
        The right side is gathered first, so a slot may be a destination and, later in the list, a source."""
        L, _, N, bs, H, D = self.kv.shape
        flat = self.kv.view(L, 2, N * bs, H, D)[:num_layers]      # [L', 2, slots, Hkv, D]
        flat[:, :, dst] = flat[:, :, src]
        if self._per_slot_scales():
            scales = self.scales.view(L, 2, N * bs, H)[:num_layers]  # [L', 2, slots, Hkv]
            scales[:, :, dst] = scales[:, :, src]

    def _per_slot_scales(self) -> bool:
        return self.scales is not None and self.scale_granularity == "per_token_head"

    # -- the host tier: swapping and offloading (host_pool.py owns the host block ids) -----------------------
    def allocate_host(self, num_host_blocks: int) -> None:
        """The host pool's tensor ``host_kv[L, 2, num_host_blocks, bs, Hkv, D]``: pinned memory on a GPU, so its
        copies run on a side stream while the CPU goes on; ordinary memory on a CPU."""
        if not isinstance(num_host_blocks, int) or isinstance(num_host_blocks, bool) or num_host_blocks < 1:
            raise ValueError(f"num_host_blocks must be a positive int, got {num_host_blocks!r}")
        L, two, _, bs, H, D = self.kv.shape
        gpu = self.device.type == "cuda"
        self.host_kv = torch.zeros((L, two, num_host_blocks, bs, H, D), dtype=self.dtype, pin_memory=gpu)
        # a quantized block's per-(token, head) scales travel with it: host_scales[L, 2, num_host_blocks, bs, Hkv]
        self.host_scales = torch.ones((L, two, num_host_blocks, bs, H), dtype=self.scales.dtype) \
            if self._per_slot_scales() else None
        self._stream = torch.cuda.Stream(self.device) if gpu else None
        self._pending = []                     # GPU: (event, host block ids, pinned staging) still in flight

    def _check_pairs(self, pairs, n_src: int, n_dst: int, what: str):
        if not hasattr(self, "host_kv"):
            raise RuntimeError("no host pool: allocate_host() first (preemption_mode='swap' or kv_offload_space)")
        src = [int(s) for s, _ in pairs]
        dst = [int(d) for _, d in pairs]
        if min(src) < 0 or max(src) >= n_src or min(dst) < 0 or max(dst) >= n_dst or len(set(dst)) != len(dst):
            raise ValueError(f"{what} pairs {pairs}: need distinct destinations, ids in range")
        return src, dst

    def swap_out(self, pairs) -> None:
        """Device block d -> host block h for each (d, h): one batched gather and one index copy per layer
        (vLLM's ``swap_blocks``), never a loop over blocks. On a GPU the copy runs on a side stream; the step's
        forward (which may overwrite the freed device blocks) waits for it (``wait_copies``)."""
        if not pairs:
            return
        src, dst = self._check_pairs(pairs, self.num_blocks, self.host_kv.shape[2], "swap-out")
        if self.host_scales is not None:                       # (small: one float a slot and head)
            self.host_scales[:, :, dst] = self.scales[:, :, src].cpu()
        if self._stream is None:
            src_t, dst_t = torch.tensor(src), torch.tensor(dst)
            kv, host = _raw(self.kv), _raw(self.host_kv)
            for layer in range(self.num_layers):               # [2, n, bs, Hkv, D] a layer
                host[layer].index_copy_(1, dst_t, kv[layer].index_select(1, src_t))
            return
        self._flush()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            src_t = torch.tensor(src, device=self.device)
            staging = torch.empty((self.num_layers,) + self.kv[0][:, src_t].shape, dtype=self.dtype, pin_memory=True)
            for layer in range(self.num_layers):
                staging[layer].copy_(self.kv[layer].index_select(1, src_t), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._pending.append((event, torch.tensor(dst), staging))

    def swap_in(self, pairs) -> None:
        """Host block h -> device block d for each (h, d), batched per layer as ``swap_out``."""
        if not pairs:
            return
        src, dst = self._check_pairs(pairs, self.host_kv.shape[2], self.num_blocks, "swap-in")
        src_t = torch.tensor(src)
        if self.host_scales is not None:
            self.scales[:, :, dst] = self.host_scales[:, :, src].to(self.device)
        if self._stream is None:
            dst_t = torch.tensor(dst)
            kv, host = _raw(self.kv), _raw(self.host_kv)
            for layer in range(self.num_layers):
                kv[layer].index_copy_(1, dst_t, host[layer].index_select(1, src_t))
            return
        self._flush()                                          # a block swapped out last step may come back now
        staging = torch.empty((self.num_layers,) + self.host_kv[0][:, src_t].shape, dtype=self.dtype,
                              pin_memory=True)
        for layer in range(self.num_layers):
            torch.index_select(self.host_kv[layer], 1, src_t, out=staging[layer])
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            dst_t = torch.tensor(dst, device=self.device)
            for layer in range(self.num_layers):
                self.kv[layer].index_copy_(1, dst_t, staging[layer].to(self.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self._stream)
        self._pending.append((event, None, staging))           # staging lives until the copy is done

    def wait_copies(self) -> None:
        """GPU: the step's forward waits (on the device, no host sync) for the copies issued before it."""
        if getattr(self, "_stream", None) is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def _flush(self) -> None:
        """GPU: finish the host side of earlier swap-outs (their staging into ``host_kv``); by now, a step later,
        their events have almost always completed, so the wait is short."""
        for event, dst, staging in self._pending:
            event.synchronize()
            if dst is not None:
                for layer in range(self.num_layers):
                    self.host_kv[layer].index_copy_(1, dst, staging[layer])
        self._pending.clear()

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, kv_cache_dtype: str = "auto", scale_granularity: str = "per_tensor") -> int:
        """K and V of block_size tokens in every layer: 2 * L * bs * Hkv * D * element size of the stored dtype,
        plus per (token, head) the scales beside them (``quant.bytes_per_token``)."""
        return block_size * quant.bytes_per_token(num_layers, num_kv_heads, head_dim, kv_cache_dtype, dtype,
                                                  scale_granularity)

    @classmethod
    def from_memory_budget(cls, budget_bytes: int, num_layers: int, block_size: int, num_kv_heads: int,
                           head_dim: int, dtype: torch.dtype = torch.float32, device="cpu", **kw) -> "KVCache":
        """As many blocks as fit in ``budget_bytes`` (vLLM sizes its cache from free GPU memory this way)."""
        per = cls.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype,
                                  kw.get("kv_cache_dtype", "auto"), kw.get("scale_granularity", "per_tensor"))
        num_blocks = int(budget_bytes) // per
        if num_blocks < 1:
            raise ValueError(f"a budget of {budget_bytes} bytes holds no block ({per} bytes each)")
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, **kw)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as uint8 where the dtype is one byte (fp8: index copies of float8 are not on every build)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def slot_mapping(block_tables, starts, counts, block_size: int, device="cpu") -> torch.Tensor:
    """slots[T] int64 of the new tokens: sequence b's positions starts[b] .. starts[b] + counts[b] - 1.

    T = sum(counts), in batch order. Every position must fall inside the blocks
    its table holds (the allocator gave them out before this step). Plain Python
    over the positions, then one tensor: a step has few new tokens, and many small
    tensor ops would cost more than the arithmetic.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not len(block_tables) == len(starts) == len(counts):
        raise ValueError(f"block_tables, starts, counts have different lengths "
                         f"({len(block_tables)}, {len(starts)}, {len(counts)})")
    out = []
    for b, (table, start, count) in enumerate(zip(block_tables, starts, counts)):
        if start < 0 or count < 0:
            raise ValueError(f"sequence {b}: start {start} and count {count} must be >= 0")
        if -(-(start + count) // block_size) > len(table):
            raise ValueError(f"sequence {b}: positions up to {start + count - 1} need "
                             f"{-(-(start + count) // block_size)} blocks, its block table has {len(table)}")
        used = table[start // block_size: -(-(start + count) // block_size)]
        if count and min(used) < 0:
            raise ValueError(f"sequence {b}: block table {list(table)} has a negative block id")
        # position p -> physical block table[p // bs], offset p % bs
        out += [table[p // block_size] * block_size + p % block_size for p in range(start, start + count)]
    return torch.tensor(out, dtype=torch.int64, device=device)


def block_table_tensor(block_tables, device="cpu") -> torch.Tensor:
    """block_tables[B, max_blocks] int32, each row padded with -1 past its sequence's blocks."""
    width = max((len(t) for t in block_tables), default=0)
    rows = [list(t) + [-1] * (width - len(t)) for t in block_tables]
    return torch.tensor(rows, dtype=torch.int32, device=device).view(len(block_tables), width)
