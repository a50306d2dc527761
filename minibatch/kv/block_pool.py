"""The block pool: what a block allocator keeps, and everything that only reads it.

``BlockAllocatorBase`` holds the state of the pool of physical KV blocks (ref counts, the free queue,
each sequence's block table, the prefix cache's maps) with its readings, ``can_allocate``, ``truncate``
and the invariant checker. ``block_allocator.py`` explains the ideas (PagedAttention's blocks, sharing,
prefix caching, the free-list policy): read it first; its ``BlockAllocator`` adds the policy on top. vLLM V1 keeps the
same split: ``BlockPool`` (the free block queue and the cached-block map) under ``KVCacheManager``.
"""
from __future__ import annotations

import hashlib
import numbers
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional


class NoFreeBlocksError(RuntimeError):
    """Not enough free blocks; the allocator is unchanged (the scheduler preempts or waits)."""


class UnknownSequenceError(KeyError):
    """No such sequence (never allocated, or already freed)."""

    def __str__(self):                       # KeyError would print the message with quotes
        return str(self.args[0])


def hash_block_tokens(parent_hash: Optional[int], token_ids: tuple) -> int:
    """Chained content hash of one full block: hash(parent block's hash, this block's tokens).

    sha256 so that it is the same in every run (replayed traces, tests); 64 bits
    are plenty for a dict key since every hit is verified against stored tokens.
    """
    text = f"{parent_hash}|{','.join(map(str, token_ids))}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


@dataclass(frozen=True)
class CacheEntry:
    block_hash: int
    tokens: tuple                            # the block's block_size token ids, kept to verify hits
    parent_serial: Optional[int]             # serial of the entry its parent block matched; None = first block
    serial: int                              # unique for ever: an evicted entry's serial never comes back


@dataclass
class _Seq:
    """What the allocator knows of a sequence: blocks only. Its tokens and how many are computed belong to
    the engine's ``Sequence``, which passes them in when the allocator needs them (to hash full blocks)."""
    blocks: list                             # block table: logical block i -> physical block id
    num_slots: int                           # token slots it holds (its tokens, drafts included)
    chain: list = field(default_factory=list)  # (hash, serial) of its leading cached full blocks


def _as_tokens(token_ids, what: str) -> list:
    if not isinstance(token_ids, (list, tuple)):
        raise TypeError(f"{what} must be a list of ints, got {type(token_ids).__name__}")
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in token_ids):
        raise TypeError(f"{what} must contain only ints")
    return [int(t) for t in token_ids]


def _as_growth(num_new_tokens) -> int:
    """``append_slots``' count, checked: an int >= 0."""
    n = _as_count(num_new_tokens, "num_new_tokens")
    if n < 0:
        raise ValueError(f"num_new_tokens must be >= 0, got {n}")
    return n


def _as_computed(seq_id, s, num_computed_tokens, token_ids) -> int:
    """``mark_computed``'s count, checked against the slots ``s`` holds and the tokens given."""
    n = _as_count(num_computed_tokens, "num_computed_tokens")
    if not 0 <= n <= min(s.num_slots, len(token_ids)):
        raise ValueError(f"sequence {seq_id!r}: num_computed_tokens must be in 0..{s.num_slots} (the slots it holds) "
                         f"and at most len(token_ids) = {len(token_ids)}, got {n}")
    return n


def _as_count(n, what: str) -> int:
    if not isinstance(n, numbers.Integral) or isinstance(n, bool):
        raise TypeError(f"{what} must be an int, got {type(n).__name__}")
    return int(n)


class BlockAllocatorBase:
    """The pool's state and everything that only reads it or follows from the policy below: construction,
    the readings, ``can_allocate``, ``truncate``, the invariant checker. ``BlockAllocator`` adds the policy
    itself (exercise 6 is to write it: ``exercises/ex6_block_allocator.py``).

    State: ``_ref[b]`` the ref count of block b; ``_free`` the free queue (an OrderedDict used as an ordered
    set, front = taken next); ``_seqs[seq_id]`` a ``_Seq``; ``_cache`` block hash -> block id and
    ``_entries`` block id -> ``CacheEntry`` (the prefix cache; a block keeps its entry while free, until it is
    taken again); ``_next_serial`` the next entry's serial; ``hits`` / ``queries`` counters of ``allocate``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        num_blocks, block_size = _as_count(num_blocks, "num_blocks"), _as_count(block_size, "block_size")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._ref = [0] * num_blocks
        self._free: OrderedDict = OrderedDict.fromkeys(range(num_blocks))   # front = taken next
        self._seqs: dict = {}
        self._cache: dict = {}                # block hash -> block id
        self._entries: dict = {}              # block id -> CacheEntry
        self._next_serial = 0
        self.on_evict = None                  # fn(block, CacheEntry) when a cached block's entry dies (write-back)
        self.hits = 0                         # cumulative full blocks reused by allocate
        self.queries = 0                      # cumulative full blocks allocate could have reused

    # -- reading the state ------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def has_seq(self, seq_id) -> bool:
        return seq_id in self._seqs

    def _get(self, seq_id) -> _Seq:
        if seq_id not in self._seqs:
            raise UnknownSequenceError(f"unknown sequence {seq_id!r} (never allocated, or already freed)")
        return self._seqs[seq_id]

    def block_table(self, seq_id) -> list:
        return list(self._get(seq_id).blocks)

    def num_slots(self, seq_id) -> int:
        """Token slots the sequence holds (block_table covers exactly blocks_needed(num_slots))."""
        return self._get(seq_id).num_slots

    def num_cached_blocks(self, seq_id) -> int:
        """Its leading full blocks registered in the prefix cache (or hashed, with caching off: 0)."""
        return len(self._get(seq_id).chain)

    def ref_count(self, block_id: int) -> int:
        if not isinstance(block_id, numbers.Integral) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id!r} is not in 0..{self.num_blocks - 1}")
        return self._ref[block_id]

    def ref_counts(self) -> list:
        return list(self._ref)

    def free_block_ids(self) -> list:
        """The free queue, front (taken next) first."""
        return list(self._free)

    def cached_block_ids(self) -> list:
        return sorted(self._entries)

    def blocks_needed(self, num_tokens: int) -> int:
        num_tokens = _as_count(num_tokens, "num_tokens")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def snapshot(self) -> dict:
        """Everything, as plain data: equal snapshots mean equal allocators (tests use it)."""
        return {"seqs": {k: (list(s.blocks), s.num_slots, list(s.chain))
                         for k, s in self._seqs.items()},
                "ref": list(self._ref), "free": list(self._free), "cache": dict(self._cache),
                "entries": dict(self._entries), "serial": self._next_serial,
                "hits": self.hits, "queries": self.queries}

    # -- the prefix cache ---------------------------------------------------------
    def num_cached_prefix_tokens(self, token_ids) -> int:
        tokens = _as_tokens(token_ids, "token_ids")
        return len(self._lookup(tokens)) * self.block_size if self.enable_prefix_caching else 0

    def cached_prefix_blocks(self, token_ids) -> list:
        """The blocks of ``token_ids``' longest cached prefix (what ``allocate`` would reuse; the cache-aware
        scheduling policies read it). Changes nothing."""
        tokens = _as_tokens(token_ids, "token_ids")
        return [b for b, _, _ in self._lookup(tokens)] if self.enable_prefix_caching else []

    def _evict(self, block: int) -> None:
        e = self._entries.pop(block, None)
        if e is not None and self._cache.get(e.block_hash) == block:
            del self._cache[e.block_hash]
            if self.on_evict is not None:       # the host tier's write-back (engine/scheduler.py): keep a copy
                self.on_evict(block, e)

    def reset_prefix_cache(self) -> None:
        """Forget every cache entry (blocks in use keep their KV; they are just no longer findable)."""
        self._cache.clear()
        self._entries.clear()
        for s in self._seqs.values():
            s.chain = []

    # -- taking and returning blocks ------------------------------------------------
    def _check_new_id(self, seq_id) -> None:
        if seq_id in self._seqs:                            # (an unhashable id raises TypeError here)
            raise ValueError(f"sequence {seq_id!r} already exists")

    def _plan(self, token_ids):
        """(tokens, prefix hits, fresh blocks needed, free blocks left for them) of a new sequence."""
        tokens = _as_tokens(token_ids, "token_ids")
        if not tokens:
            raise ValueError("token_ids is empty: a sequence needs at least one token")
        hits = self._lookup(tokens) if self.enable_prefix_caching else []
        free = len(self._free) - sum(self._ref[b] == 0 for b, _, _ in hits)   # free hits leave the queue
        return tokens, hits, self.blocks_needed(len(tokens)) - len(hits), free

    def can_allocate(self, token_ids) -> bool:
        _, _, fresh, free = self._plan(token_ids)
        return fresh <= free

    def truncate(self, seq_id, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens (rejected speculative tokens go); release spare blocks."""
        s = self._get(seq_id)
        n = _as_count(num_tokens, "num_tokens")
        if not 0 <= n <= s.num_slots:
            raise ValueError(f"cannot truncate sequence {seq_id!r} of {s.num_slots} slots to {n}")
        keep = self.blocks_needed(n)
        self._release(s.blocks[keep:])
        del s.blocks[keep:], s.chain[n // self.block_size:]
        s.num_slots = n

    def _reclaim(self, n: int) -> None:
        """Have ``n`` blocks in the free queue. The hash chain's cached-but-free blocks are in it already; the radix
        tree (radix_allocator.py) evicts its LRU unlocked leaves into it here."""

    # -- swapping (PagedAttention §4.5): whole sequences to the host pool and back ---------------------------------
    def swap_out(self, seq_ids, host) -> list:
        """Move these sequences (one request's, all of them) to ``host`` (a ``HostBlockPool``): their device blocks
        are freed as by ``free``. Returns the (device block, host block) pairs to copy first, each distinct block
        once. Raises ``HostPoolFullError`` (from the host pool), changing nothing, when it cannot hold them."""
        tables = {sid: self._get(sid).blocks for sid in seq_ids}
        pairs = host.swap_out(tables, {sid: self._seqs[sid].num_slots for sid in seq_ids})
        for sid in seq_ids:
            self.free(sid)
        return pairs

    def blocks_to_swap_in(self, seq_ids, host) -> int:
        """Device blocks swapping these sequences back in takes (a block they share, once)."""
        return len({b for sid in seq_ids for b in host.swapped[sid].blocks})

    def swap_in(self, seq_ids, host) -> list:
        """Bring swapped sequences back into fresh device blocks (ref counts as before: a block the request's
        sequences share is shared again). Returns the (host block, device block) pairs to copy before the forward.
        Their prefix-cache chain starts empty: their full blocks are registered again as they are computed."""
        seq_ids = list(seq_ids)
        for sid in seq_ids:
            self._check_new_id(sid)
        need = self.blocks_to_swap_in(seq_ids, host)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(f"swapping in {seq_ids} needs {need} blocks, {self.num_free_blocks} are free")
        self._reclaim(need)
        tables, slots, order = host.swap_in(seq_ids)
        dev = {h: self._take_fresh() for h in order}               # each fresh block has ref count 1
        for sid in seq_ids:
            self._seqs[sid] = _Seq([dev[h] for h in tables[sid]], slots[sid])
        for h in order:                                             # shared by k tables: ref count k
            self._ref[dev[h]] = sum(t.count(h) for t in tables.values())
        return [(h, dev[h]) for h in order]

    # -- invariants -------------------------------------------------------------------
    def _cache_held_blocks(self) -> set:
        """Blocks of ref count 0 that a prefix cache keeps out of the free queue: none for the hash chain (its
        cached-but-free blocks wait in the queue); the radix tree's evictable blocks (``radix_allocator.py``)."""
        return set()

    def check_invariants(self, live_seq_ids=None) -> None:
        bs, counts = self.block_size, [0] * self.num_blocks
        if live_seq_ids is not None:
            assert set(live_seq_ids) == set(self._seqs), \
                f"live sequences {sorted(map(str, live_seq_ids))} != allocated {sorted(map(str, self._seqs))}"
        for sid, s in self._seqs.items():
            assert len(s.blocks) == self.blocks_needed(s.num_slots), \
                f"{sid!r}: {len(s.blocks)} blocks for {s.num_slots} slots"
            assert len(set(s.blocks)) == len(s.blocks), f"{sid!r}: a block twice in one table {s.blocks}"
            assert len(s.chain) * bs <= s.num_slots, f"{sid!r}: more cached blocks than full blocks"
            for i, b in enumerate(s.blocks):
                counts[b] += 1
                e = self._entries.get(b)
                assert e is None or i >= len(s.chain) or s.chain[i][1] == e.serial, f"{sid!r}: chain broken"
        assert counts == self._ref, f"ref counts {self._ref} != block-table occurrences {counts}"
        held = self._cache_held_blocks()
        free = [b for b in range(self.num_blocks) if counts[b] == 0 and b not in held]
        assert sorted(self._free) == free, f"free queue {list(self._free)} != blocks with ref 0 {free}"
        assert len(self._cache) == len(self._entries), "cache maps disagree"
        for h, b in self._cache.items():
            e = self._entries.get(b)
            assert e is not None and e.block_hash == h and len(e.tokens) == bs, f"cache entry of block {b} broken"
