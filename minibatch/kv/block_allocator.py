"""The block allocator: the pool of physical KV blocks, ref counts, the prefix cache, copy-on-write.

PagedAttention (Kwon et al., SOSP'23) cuts the KV cache into fixed-size **blocks** of
``block_size`` token slots. A sequence's *logical* blocks (tokens 0..bs-1, bs..2bs-1, ...) map
to *physical* blocks anywhere in the pool through its **block table** (§4.2). A block is taken
only when the last one is full, so a sequence wastes only the unfilled tail of its last block
(§4.3), instead of a whole max-length reservation.

Sharing (§4.4). A block may sit in several block tables; its **ref count** says in how many.
``fork`` (parallel sampling, n > 1) shares every block of the parent. A shared block is never
written: a sequence about to write into one gets a fresh block and the caller copies the KV
over first (**copy-on-write**, per block; ``append_slots`` returns the (src, dst) pairs).

Prefix caching (vLLM's *automatic prefix caching*; the shared-prefix case of §4.4). A *full,
computed* block is identified by a hash chained over its parent block's hash and its own tokens,
so equal hashes mean equal prefixes; a new sequence reuses the blocks of its longest cached
prefix (whole blocks) and skips computing them. The hash is an index, not a proof: a hit is
verified against the tokens stored with the entry *and* the exact entry its parent matched
(``serial``s are never reused), so a collision can only cost a miss, never a wrong answer.

Free list policy (vLLM v1's): free blocks wait in **one queue ordered by when they were freed**;
a fresh block is taken from the front, and a cache entry it still holds is evicted then. So a
cached-but-free block stays reusable until it reaches the front (least recently freed first).
A sequence's blocks are freed *tail first*: its last blocks (least likely shared) go first.
A hit on a cached-free block takes it out of the queue (ref count 0 -> 1). Never-used blocks
start in the queue in id order, so a fresh pool hands out 0, 1, 2, ...

Every failed call raises before changing anything.

The code is in two modules: ``block_pool.py``'s ``BlockAllocatorBase`` holds the pool's state and what
only reads it (and ``truncate``, ``can_allocate``, the invariant checker); ``BlockAllocator``, here, adds the
policy: the free queue, allocation, copy-on-write, the prefix cache, fork and free. Exercise 6 is to write
this module's class (``exercises/ex6_block_allocator.py``). The names the pool defines are importable from
here too, since this module is the allocator's public face.
"""
from __future__ import annotations

from minibatch.kv.block_pool import (BlockAllocatorBase, CacheEntry, NoFreeBlocksError, _as_count, _Seq,
                                     hash_block_tokens)
from minibatch.kv.block_pool import UnknownSequenceError  # noqa: F401 (re-exported: the allocator's errors)


class BlockAllocator(BlockAllocatorBase):
    """The policy: which block is taken and when one comes back, ref counts, the prefix cache, copy-on-write."""

    # -- the free queue -----------------------------------------------------------------
    def _take_fresh(self) -> int:
        block, _ = self._free.popitem(last=False)           # the least recently freed block
        self._evict(block)                                  # its old cache entry (if any) dies here
        self._ref[block] = 1
        return block

    def _release(self, blocks: list) -> None:
        for b in reversed(blocks):                          # tail first: last blocks are evicted first
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None                        # to the back of the queue

    # -- the prefix cache -----------------------------------------------------------------
    def _lookup(self, tokens: list) -> list:
        """[(block, hash, serial)] of the longest verified cached prefix, leaving the last token out.
        (Called only with prefix caching on.)"""
        bs, found, parent_hash, parent_serial = self.block_size, [], None, None
        for i in range((len(tokens) - 1) // bs):          # cap: the last token is always computed
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash_block_tokens(parent_hash, chunk)
            e = self._entries.get(self._cache.get(h))
            if e is None or e.tokens != chunk or e.parent_serial != parent_serial:
                break                                       # a miss (or a hash collision: still a miss)
            found.append((self._cache[h], h, e.serial))
            parent_hash, parent_serial = h, e.serial
        return found

    # -- sequences ------------------------------------------------------------------------
    def allocate(self, seq_id, token_ids) -> int:
        """A new sequence holding ``token_ids``; returns how many leading tokens the cache already holds."""
        self._check_new_id(seq_id)
        tokens, hits, fresh, free = self._plan(token_ids)
        if fresh > free:
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs {fresh} fresh blocks, {free} are free")
        blocks = []
        for b, _, _ in hits:                                # first, so taking fresh ones cannot evict them
            if self._ref[b] == 0:
                del self._free[b]                           # a cached-but-free block comes back
            self._ref[b] += 1
            blocks.append(b)
        blocks += [self._take_fresh() for _ in range(fresh)]
        if self.enable_prefix_caching:
            self.queries += (len(tokens) - 1) // self.block_size
            self.hits += len(hits)
        n_cached = len(hits) * self.block_size
        self._seqs[seq_id] = _Seq(blocks, len(tokens), [(h, s) for _, h, s in hits])
        return n_cached

    def append_slots(self, seq_id, num_new_tokens: int) -> list:
        """Grow by ``num_new_tokens`` slots; returns the copy-on-write (src, dst) block pairs to copy first.

        (vLLM's ``allocate_slots(request, num_new_tokens)``: the allocator needs a count, not the tokens.)"""
        s = self._get(seq_id)
        new = _as_count(num_new_tokens, "num_new_tokens")
        if new < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {new}")
        if not new:
            return []
        n_old = s.num_slots
        grow = self.blocks_needed(n_old + new) - len(s.blocks)
        last = s.blocks[-1] if n_old % self.block_size else None     # partly filled: we write into it
        cow = last is not None and self._ref[last] > 1
        if grow + cow > len(self._free):
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs {grow + cow} blocks, {len(self._free)} are free")
        pairs = []
        if cow:                                             # shared: write into a private copy (§4.4)
            dst = self._take_fresh()
            self._ref[last] -= 1
            s.blocks[-1] = dst
            pairs.append((last, dst))
        elif last is not None:
            self._evict(last)      # private but still cached (after a truncate): its content changes now
        s.blocks += [self._take_fresh() for _ in range(grow)]
        s.num_slots += new
        return pairs

    def mark_computed(self, seq_id, num_computed_tokens: int, token_ids) -> None:
        """The K/V of the first ``num_computed_tokens`` of ``token_ids`` (the sequence's tokens) is written:
        register its full blocks in the prefix cache. Only computed blocks are ever shared."""
        s = self._get(seq_id)
        n = _as_count(num_computed_tokens, "num_computed_tokens")
        if not 0 <= n <= min(s.num_slots, len(token_ids)):
            raise ValueError(f"sequence {seq_id!r}: num_computed_tokens must be in 0..{s.num_slots} (the slots "
                             f"it holds) and at most len(token_ids) = {len(token_ids)}, got {n}")
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        while len(s.chain) < n // bs:
            i = len(s.chain)
            chunk, block = tuple(token_ids[i * bs:(i + 1) * bs]), s.blocks[i]
            parent_hash, parent_serial = s.chain[-1] if s.chain else (None, None)
            h = hash_block_tokens(parent_hash, chunk)
            e = self._entries.get(block)       # set already: a prefix hit, or a block shared by fork
            if e is not None and e.tokens != chunk:
                raise ValueError(f"sequence {seq_id!r}: block {block} is cached as holding {list(e.tokens)}, but "
                                 f"token_ids has {list(chunk)} there: pass the sequence's own tokens")
            if e is None and h in self._cache:
                e = self._entries[self._cache[h]]           # same content already cached in another block
                if e.tokens != chunk or e.parent_serial != parent_serial:
                    break                                   # a collision: leave the rest uncached
            elif e is None:
                e = CacheEntry(h, chunk, parent_serial, self._next_serial)
                self._next_serial += 1
                self._entries[block], self._cache[h] = e, block
            s.chain.append((h, e.serial))

    def fork(self, parent_id, child_id) -> None:
        """The child shares every block of the parent (ref counts up); writes will copy-on-write."""
        p = self._get(parent_id)
        self._check_new_id(child_id)
        for b in p.blocks:
            self._ref[b] += 1
        self._seqs[child_id] = _Seq(list(p.blocks), p.num_slots, list(p.chain))

    def free(self, seq_id) -> None:
        """Return the sequence's blocks; those whose ref count reaches 0 join the free queue."""
        self._release(self._get(seq_id).blocks)
        del self._seqs[seq_id]
