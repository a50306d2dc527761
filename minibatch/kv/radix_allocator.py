"""The block allocator over a radix tree: ``prefix_cache="radix"`` (``EngineConfig``), SGLang's prefix cache.

The allocator still owns the blocks: their ref counts, the free queue, every block table, copy-on-write, fork.
What changes is the index of computed prefixes. Instead of the hash chain's dict, a ``RadixCache``
(``radix_cache.py``) holds the blocks of every computed full page, and each sequence *locks* the tree's path of
its cached prefix (``inc_lock_ref`` on the node where it ends; ``dec_lock_ref`` when it is freed or its path
moves). So:

* a block of ref count 0 that the tree holds is **evictable**: it waits in the tree, not in the free queue, and
  ``num_free_blocks`` / ``can_allocate`` count it as free (so does the hash chain with its cached-but-free blocks);
* a fresh block comes from the free queue; when the queue is short, ``evict`` frees the least recently accessed
  unlocked leaves of the tree into it (SGLang's order), not the least recently *freed* block (the hash chain's);
* ``allocate`` matches the prompt (``match_prefix``, leaving the last token out as the hash chain does), locks the
  path, then takes fresh blocks, so evicting for them can never take its own hits;
* ``mark_computed`` inserts the sequence's computed full pages (``insert``) and moves its lock down to the new end.
  A page the tree already holds in another block (two sequences computed the same prefix at once) keeps the tree's
  block; the sequence goes on with its own copy, as the hash chain does.
* ``truncate`` into a cached page leaves the sequence holding a block the tree still indexes: the lock keeps
  covering it, and the next ``append_slots`` writes into a copy (copy-on-write against the tree).

A sequence's ``chain`` here is the tree's block of each of its cached pages (equal to its own block, or the
tree's copy). On full-block prefixes with no eviction both caches find the same hits; they differ in which cached
block goes first when the pool is full (``tests/test_radix_allocator.py`` shows both).
"""
from __future__ import annotations

from minibatch.kv.block_pool import BlockAllocatorBase, NoFreeBlocksError, _as_count, _as_computed, _as_growth, _as_tokens, _Seq
from minibatch.kv.radix_cache import RadixCache

PREFIX_CACHES = ("hash", "radix")     # EngineConfig.prefix_cache: BlockAllocator's hash chain, or this tree


class RadixBlockAllocator(BlockAllocatorBase):
    """The block allocator with the radix tree as its prefix cache: ``BlockAllocator``'s policy (free queue front
    first, tail-first release, copy-on-write, fork), over the pool's state (``BlockAllocatorBase``; the hash
    chain's maps stay empty) and ``tree`` (a ``RadixCache``), ``_in_tree`` the set of blocks it holds, ``_locks``
    seq_id -> the node its lock is on. (Not a subclass of ``BlockAllocator``, so that it runs the same whoever
    wrote that one: exercise 6.)"""

    prefix_cache = "radix"

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        if not self.enable_prefix_caching:
            raise ValueError("prefix_cache='radix' is a prefix cache: it needs enable_prefix_caching=True")
        self.tree = RadixCache(block_size)
        self._in_tree: set = set()
        self._locks: dict = {}

    # -- readings ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.tree.evictable_size()

    def cached_block_ids(self) -> list:
        return sorted(self._in_tree)

    def _cap(self, tokens: list) -> list:
        """The tokens a prefix hit may cover: whole blocks, leaving the last token out (it must make logits)."""
        return tokens[:(len(tokens) - 1) // self.block_size * self.block_size]

    def _lookup(self, tokens: list) -> list:
        return self.tree.peek(self._cap(tokens))[0]

    def cached_prefix_blocks(self, token_ids) -> list:
        return self._lookup(_as_tokens(token_ids, "token_ids"))

    def _plan(self, token_ids):
        tokens = _as_tokens(token_ids, "token_ids")
        if not tokens:
            raise ValueError("token_ids is empty: a sequence needs at least one token")
        hits, unlocked = self.tree.peek(self._cap(tokens))
        # locking the hits takes their unlocked blocks out of the evictable ones
        return tokens, hits, self.blocks_needed(len(tokens)) - len(hits), self.num_free_blocks - unlocked

    # -- the free queue and the tree ---------------------------------------------------------------
    def _reclaim(self, n: int) -> None:
        """Have ``n`` blocks in the free queue: evict the tree's LRU unlocked leaves into it (callers check
        ``num_free_blocks`` first)."""
        for b in self.tree.evict(n - len(self._free)) if n > len(self._free) else ():
            self._in_tree.discard(b)
            self._free[b] = None

    def _take_fresh(self) -> int:
        block, _ = self._free.popitem(last=False)           # the least recently freed block (none in the tree)
        self._ref[block] = 1
        return block

    def _release(self, blocks: list) -> None:
        for b in reversed(blocks):                          # tail first, as the hash chain's
            self._ref[b] -= 1
            if self._ref[b] == 0 and b not in self._in_tree:
                self._free[b] = None                        # a block the tree holds waits there, evictable

    def _relock(self, seq_id, node) -> None:
        self.tree.inc_lock_ref(node)                        # first: the old and new paths share their top
        self.tree.dec_lock_ref(self._locks[seq_id])
        self._locks[seq_id] = node

    # -- sequences ------------------------------------------------------------------------------
    def allocate(self, seq_id, token_ids) -> int:
        self._check_new_id(seq_id)
        tokens, hits, fresh, free = self._plan(token_ids)
        if fresh > free:
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs {fresh} fresh blocks, {free} are free")
        blocks, node = self.tree.match_prefix(self._cap(tokens))
        self.tree.inc_lock_ref(node)                        # before evicting: the hits stay
        for b in blocks:
            self._ref[b] += 1
        self._reclaim(fresh)
        self.queries += (len(tokens) - 1) // self.block_size
        self.hits += len(blocks)
        self._seqs[seq_id] = _Seq(blocks + [self._take_fresh() for _ in range(fresh)], len(tokens), list(blocks))
        self._locks[seq_id] = node
        return len(blocks) * self.block_size

    def append_slots(self, seq_id, num_new_tokens: int) -> list:
        """Grow by ``num_new_tokens`` slots; returns the copy-on-write (src, dst) block pairs to copy first. The
        partly filled last block is copied when it is shared: with another table, or with the tree (a truncate
        into a cached page left it there)."""
        s, new = self._get(seq_id), _as_growth(num_new_tokens)
        if not new:
            return []
        last = s.blocks[-1] if s.num_slots % self.block_size else None
        in_tree = last is not None and last in self._in_tree
        cow = last is not None and (in_tree or self._ref[last] > 1)
        grow = self.blocks_needed(s.num_slots + new) - len(s.blocks)
        if grow + cow > self.num_free_blocks:
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs {grow + cow} blocks, {self.num_free_blocks} are free")
        self._reclaim(grow + cow)
        pairs = []
        if cow:
            dst = self._take_fresh()
            self._release([last])                           # a tree page left at ref 0 stays there, evictable
            s.blocks[-1] = dst
            pairs.append((last, dst))
            if in_tree:                                     # the lock covered that page: now only the chain
                self._relock(seq_id, self._node_at(seq_id, len(s.chain)))
        s.blocks += [self._take_fresh() for _ in range(grow)]
        s.num_slots += new
        return pairs

    def _node_at(self, seq_id, num_pages: int):
        """The node where the first ``num_pages`` pages of the sequence's locked path end (splitting there)."""
        key = self.tree.path_key(self._locks[seq_id])
        return self.tree.match_prefix(key[:num_pages * self.block_size])[1]

    def mark_computed(self, seq_id, num_computed_tokens: int, token_ids) -> None:
        s = self._get(seq_id)
        n = _as_computed(seq_id, s, num_computed_tokens, token_ids)
        pages, bs = n // self.block_size, self.block_size
        if pages <= len(s.chain):
            return
        key = tuple(_as_tokens(list(token_ids[:pages * bs]), "token_ids"))
        if self.tree.peek(key[:len(s.chain) * bs])[0] != s.chain:
            raise ValueError(f"sequence {seq_id!r}: token_ids differ from the tokens its cached blocks hold: "
                             f"pass the sequence's own tokens")
        done = self.tree.insert(key, s.blocks[:pages]) // bs
        self._in_tree.update(s.blocks[done:pages])          # the new pages are the sequence's own blocks
        blocks, node = self.tree.match_prefix(key)
        self._relock(seq_id, node)
        s.chain = list(blocks)

    def fork(self, parent_id, child_id) -> None:
        parent = self._get(parent_id)
        self._check_new_id(child_id)
        for block in parent.blocks:                         # every block shared: its ref count goes up
            self._ref[block] += 1
        self._seqs[child_id] = _Seq(list(parent.blocks), parent.num_slots, list(parent.chain))
        self._locks[child_id] = self._locks[parent_id]
        self.tree.inc_lock_ref(self._locks[child_id])

    def swap_in(self, seq_ids, host) -> list:
        """As the pool's (block_pool.py), and each sequence comes back holding no tree path yet: its chain starts
        empty, so it locks the root (nothing); ``mark_computed`` then inserts and locks its pages again."""
        pairs = super().swap_in(seq_ids, host)
        for sid in seq_ids:
            self._locks[sid] = self.tree.root_node
        return pairs

    def free(self, seq_id) -> None:
        s = self._get(seq_id)
        self.tree.dec_lock_ref(self._locks.pop(seq_id))     # first: its unshared tree pages become evictable
        self._release(s.blocks)
        del self._seqs[seq_id]

    def truncate(self, seq_id, num_tokens: int) -> None:
        self._get(seq_id)
        path = self.tree.peek(self.tree.path_key(self._locks[seq_id]))[0]      # the blocks its lock covers
        super().truncate(seq_id, num_tokens)                # releases spare blocks (the tree keeps its own)
        s, c = self._seqs[seq_id], len(self._seqs[seq_id].chain)
        # still held: the partly kept block of the first page cut, when it is the tree's block itself
        keep = c + (c < len(path) and c < len(s.blocks) and s.blocks[c] == path[c])
        if keep != len(path):
            self._relock(seq_id, self._node_at(seq_id, keep))

    def reset_prefix_cache(self) -> None:
        for b in sorted(self._in_tree):
            if self._ref[b] == 0:
                self._free[b] = None
        self.tree.reset()
        self._in_tree.clear()
        self._locks = {sid: self.tree.root_node for sid in self._seqs}
        for s in self._seqs.values():
            s.chain = []

    def snapshot(self) -> dict:
        return super().snapshot() | {"tree": self.tree.snapshot(), "in_tree": sorted(self._in_tree),
                                     "locks": {k: self.tree.path_key(v) for k, v in self._locks.items()}}

    # -- invariants -------------------------------------------------------------------------------
    def _cache_held_blocks(self) -> set:
        return self._in_tree

    def check_invariants(self, live_seq_ids=None) -> None:
        super().check_invariants(live_seq_ids)
        tree, bs = self.tree, self.block_size
        tree.check_invariants()
        blocks = tree.all_blocks()
        assert sorted(blocks) == sorted(self._in_tree), f"tree blocks {sorted(blocks)} != indexed {sorted(self._in_tree)}"
        assert set(self._locks) == set(self._seqs), "a sequence without a lock, or a lock without a sequence"
        for node in tree.nodes():
            assert node.lock_ref > 0 or all(self._ref[b] == 0 for b in node.value), \
                f"{node} is evictable but holds blocks in use {[b for b in node.value if self._ref[b]]}"
        ends, in_tree = {}, {id(n) for n in tree.nodes()} | {id(tree.root_node)}
        for sid, s in self._seqs.items():
            node = self._locks[sid]
            assert id(node) in in_tree, f"{sid!r}: its lock is on a node not in the tree"
            path = tree.peek(tree.path_key(node))[0]
            assert path[:len(s.chain)] == s.chain, f"{sid!r}: chain {s.chain} is not its locked path {path}"
            extra = len(path) - len(s.chain)        # 1: the partly kept tree page a truncate left
            assert extra == 0 or (extra == 1 and s.num_slots % bs and s.blocks[len(s.chain)] == path[-1]), \
                f"{sid!r}: locks {len(path)} pages for {len(s.chain)} cached"
            for own, cached in zip(s.blocks, s.chain):
                assert own == cached or own not in self._in_tree, f"{sid!r}: block {own} in the tree off its path"
            ends[id(node)] = ends.get(id(node), 0) + 1
        for node in tree.nodes():                   # lock_ref = the locks ending at or below the node
            assert node.lock_ref == ends.get(id(node), 0) + sum(c.lock_ref for c in node.children.values()), \
                f"{node}: lock_ref is not the count of sequences holding it"
