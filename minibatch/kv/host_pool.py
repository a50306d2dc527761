"""The host pool: a second pool of KV blocks, in host memory, with its own free list and two uses.

The device pool (``block_allocator.py``) is the first tier of the KV cache. When it fills, an engine either
throws K/V away and computes it again later, or keeps it one tier down, in host memory, where a block costs a
copy over PCIe each way instead of a prefill. This pool is that tier, for two mechanisms:

* **Swapping** (PagedAttention, Kwon et al. SOSP'23, §4.5; vLLM V0's ``PreemptionMode.SWAP``). A preempted
  request is *swapped out* whole: every block of all its sequences, a block shared between them once, is copied
  here and its device blocks are freed; it is *swapped in* (fresh device blocks, the copies back) before it next
  runs. The host blocks are the request's until then: they are live data, never evicted.
* **The host tier of the prefix cache** (vLLM V1's ``OffloadingConnector``, ``vllm/v1/kv_offload/``; SGLang's
  HiCache). Full, computed blocks are kept here under the same chained hash that keys the device prefix cache,
  so a prompt whose prefix left the device pool can *load it back* instead of prefilling it again. These blocks
  are a cache: the least recently used is evicted when room is needed.

One free list, two uses, **accounted apart**: swapping may hold at most ``num_swap_blocks`` blocks and the host
tier at most ``num_offload_blocks``, so one use never evicts the other (a full swap space makes the scheduler
recompute a victim instead, and says so in the trace).

This module owns host block ids only; ``kv_cache.py`` owns the host tensor and does the copies (one batched index
copy per layer, vLLM's ``swap_blocks``), and the scheduler decides who is swapped. A host block freed during a
step (swapped in, evicted from the tier) is reused only from the next step on, and a tier block loaded back this
step is never evicted in it: the step's copies all run before its forward (``model_runner.execute``), so no
copy may read a host block that another copy of the same step writes.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class HostPoolFullError(RuntimeError):
    """The swap space cannot hold a victim (the scheduler then recomputes it instead); nothing was changed."""


@dataclass
class _Swapped:
    """A swapped-out sequence: its host block table (logical block i -> host block) and its token slots."""
    blocks: list
    num_slots: int


class HostBlockPool:
    """Host block ids ``0 .. num_swap_blocks + num_offload_blocks - 1``: swapped sequences' tables, the host tier's
    LRU map ``block hash -> (host block, tokens)``, the free list, and the counters the trace reports."""

    def __init__(self, num_swap_blocks: int, num_offload_blocks: int, block_size: int):
        for name, v in (("num_swap_blocks", num_swap_blocks), ("num_offload_blocks", num_offload_blocks)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        self.num_swap_blocks, self.num_offload_blocks = num_swap_blocks, num_offload_blocks
        self.num_blocks, self.block_size = num_swap_blocks + num_offload_blocks, block_size
        self._free: list = list(range(self.num_blocks - 1, -1, -1))   # a stack: pop() hands out 0, 1, 2, ...
        self._later: list = []                       # freed this step: back on the free list at begin_step()
        self._ref = [0] * self.num_blocks            # swapped sequences' tables sharing a host block (n > 1)
        self.swapped: dict = {}                      # seq id -> _Swapped
        self._tier: OrderedDict = OrderedDict()      # block hash -> (host block, tokens); front = least recent
        self._busy: set = set()                      # tier blocks loaded back this step: not evictable in it
        self.num_swap_used = 0                       # host blocks swapping holds now (<= num_swap_blocks)
        self.offload_hits = 0                        # cumulative blocks loaded back instead of recomputed
        self.offload_queries = 0                     # cumulative blocks looked up here (they missed the device)
        self.offload_stores = 0                      # cumulative blocks copied into the tier

    # -- readings -----------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._later)

    @property
    def num_offload_used(self) -> int:
        return len(self._tier)

    def is_swapped(self, seq_id) -> bool:
        return seq_id in self.swapped

    def block_tables(self) -> dict:
        """seq id -> host block table, every swapped-out sequence."""
        return {sid: list(s.blocks) for sid, s in self.swapped.items()}

    def offloaded_blocks(self) -> list:
        return sorted(b for b, _ in self._tier.values())

    def begin_step(self) -> None:
        """A new step: last step's copies have run, so its freed host blocks may be reused, and its loads unpinned."""
        self._free += reversed(self._later)
        self._later.clear()
        self._busy.clear()

    def _take(self) -> int:
        b = self._free.pop()
        self._ref[b] = 1
        return b

    def _give_back(self, b: int) -> None:
        self._ref[b] = 0
        self._later.append(b)

    # -- swapping -------------------------------------------------------------------------------------------
    def blocks_to_swap_out(self, tables: dict) -> int:
        """Host blocks that swapping out these sequences (seq id -> device block table) takes: each block once."""
        return len({b for t in tables.values() for b in t})

    def can_swap_out(self, tables: dict) -> bool:
        n = self.blocks_to_swap_out(tables)
        return n <= min(self.num_swap_blocks - self.num_swap_used, len(self._free))

    def swap_out(self, tables: dict, num_slots: dict) -> list:
        """Hold these sequences (one request's: seq id -> device block table, and their slots). Returns the
        (device block, host block) pairs to copy, one per distinct device block. Raises HostPoolFullError, changing
        nothing, when the swap space cannot hold them."""
        if not self.can_swap_out(tables):
            raise HostPoolFullError(f"swapping out {sorted(tables)} takes {self.blocks_to_swap_out(tables)} host "
                                    f"blocks; the swap space has {self.num_swap_blocks - self.num_swap_used} left "
                                    f"and the host pool {len(self._free)} free")
        host_of, pairs = {}, []
        for sid, table in tables.items():
            for b in table:
                if b in host_of:
                    self._ref[host_of[b]] += 1      # shared by two sequences of the request: copied once
                else:
                    host_of[b] = self._take()
                    pairs.append((b, host_of[b]))
            self.swapped[sid] = _Swapped([host_of[b] for b in table], num_slots[sid])
        self.num_swap_used += len(pairs)
        return pairs

    def swap_in(self, seq_ids) -> tuple:
        """(host tables {seq id: [host block]}, slots {seq id: n}, distinct host blocks in first-use order) of these
        swapped sequences, which leave the pool; their host blocks are free again from the next step."""
        tables, slots, order = {}, {}, []
        for sid in seq_ids:
            s = self.swapped.pop(sid)
            tables[sid], slots[sid] = s.blocks, s.num_slots
            for b in s.blocks:
                if b not in order:
                    order.append(b)
        for sid in seq_ids:
            for b in tables[sid]:
                self._ref[b] -= 1
                if self._ref[b] == 0:
                    self._give_back(b)
                    self.num_swap_used -= 1
        return tables, slots, order

    def drop(self, seq_id) -> None:
        """An aborted swapped-out sequence: its host blocks are freed, nothing is copied back."""
        self.swap_in([seq_id])

    # -- the host tier of the prefix cache --------------------------------------------------------------------
    def lookup(self, block_hash: int, tokens: tuple):
        """The host block holding this full block (its chained hash, verified against its tokens), or None;
        a hit becomes the most recently used and stays pinned for this step (it is about to be read)."""
        e = self._tier.get(block_hash)
        if e is None or e[1] != tokens:
            return None
        self._tier.move_to_end(block_hash)
        self._busy.add(block_hash)
        return e[0]

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._tier

    def store(self, block_hash: int, tokens: tuple):
        """A host block for a full device block about to be offloaded (the caller copies it), or None: already
        held (then only touched), or no room even after evicting the least recently used unpinned entry."""
        if self.num_offload_blocks == 0:
            return None
        if block_hash in self._tier:
            self._tier.move_to_end(block_hash)
            return None
        if len(self._tier) >= self.num_offload_blocks or not self._free:
            victim = next((h for h in self._tier if h not in self._busy), None)
            if victim is None:
                return None
            self._give_back(self._tier.pop(victim)[0])    # reusable next step: this step may still read it
            if not self._free:
                return None
        b = self._take()
        self._tier[block_hash] = (b, tuple(tokens))
        self.offload_stores += 1
        return b

    # -- invariants -----------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every host block is free, pending reuse, held by swapped sequences (ref = tables holding it) or by one
        tier entry, exactly once; each use within its own budget."""
        counts = [0] * self.num_blocks
        for s in self.swapped.values():
            for b in s.blocks:
                counts[b] += 1
            assert len(s.blocks) == -(-s.num_slots // self.block_size), "a swapped table does not cover its slots"
        swap_blocks = {b for s in self.swapped.values() for b in s.blocks}
        assert all(counts[b] == self._ref[b] for b in swap_blocks), "host ref counts != swapped-table occurrences"
        tier_blocks = [b for b, _ in self._tier.values()]
        owned = sorted(list(swap_blocks) + tier_blocks + self._free + self._later)
        assert owned == list(range(self.num_blocks)), f"a host block is lost or held twice: {owned}"
        assert len(swap_blocks) == self.num_swap_used <= self.num_swap_blocks, "swap accounting broken"
        assert len(tier_blocks) <= self.num_offload_blocks, "host tier over its budget"

    def check_idle(self) -> None:
        """Once the engine is idle no host block is held by swapping (the tier may keep its cache)."""
        assert not self.swapped and self.num_swap_used == 0, f"host blocks still swapped: {sorted(self.swapped)}"
