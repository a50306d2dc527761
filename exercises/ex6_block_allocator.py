"""Exercise 6: the block allocator (vLLM / PagedAttention, Kwon et al., SOSP'23, Sec. 4.2-4.4; vLLM v1's
KV cache manager for the prefix cache).

The KV cache is a pool of ``num_blocks`` blocks of ``block_size`` token slots. The allocator decides which
physical block each sequence's logical blocks live in (its **block table**), counts how many tables hold each
block (its **ref count**), and keeps the blocks nobody holds in a **free queue**. You write the policy:
``BlockAllocatorBase`` (in ``minibatch/kv/block_pool.py``; read ``minibatch/kv/block_allocator.py``'s
docstring first) gives you the state and everything that only reads it:

    self._ref[b]        ref count of block b (how many block tables hold it)
    self._free          the free queue: an OrderedDict used as an ordered set of block ids, front = taken
                        next. self._free.popitem(last=False) takes the front; self._free[b] = None puts b at
                        the back; del self._free[b] takes b out from anywhere. A fresh pool holds 0, 1, 2, ...
    self._seqs[seq_id]  a _Seq: .blocks (the block table), .num_slots (token slots held), .chain (the
                        (hash, serial) of its leading blocks registered in the prefix cache)
    self._get(seq_id)   the _Seq, or UnknownSequenceError
    self._cache         block hash -> block id, and self._entries: block id -> CacheEntry (the prefix cache)
    self._evict(b)      drop block b's cache entry, if it has one
    self._plan(tokens)  (tokens, hits, fresh, free) for a new sequence: hits = self._lookup(tokens) (or [] with
                        caching off), fresh = blocks to take from the queue, free = queue blocks usable for them
    self._check_new_id, blocks_needed(n), can_allocate, truncate (calls your _release), check_invariants()

    A fresh pool of 8 blocks of 4:    free queue [0 1 2 3 4 5 6 7]
    allocate("a", 10 tokens)      ->  a: [0 1 2]  (3 blocks; the last holds 2 tokens, 2 slots spare)
    allocate("b", 4 tokens)       ->  b: [3]      free queue [4 5 6 7]
    free("a")                     ->  blocks go to the BACK, tail first: free queue [4 5 6 7 2 1 0]
    fork("b", "c")                ->  c: [3], ref count of 3 = 2
    append_slots("c", 1)          ->  block 3 is full: c gets a new block, c: [3 4]; nothing to copy
    (had b held 3 tokens, c would write into shared block 3: copy-on-write, c gets [4] and (3, 4) is returned)

**Copy-on-write** (Sec. 4.4). A block with ref count > 1 is never written. ``append_slots`` writes into the
sequence's last block when it is partly filled (num_slots % block_size != 0); if that block is shared, the
sequence gets a fresh block in its place (the shared one's ref count drops by one) and the pair
(shared, fresh) is returned, so the engine copies the K/V over before the step writes.

**Prefix caching** (vLLM's automatic prefix caching). Once a *full* block's K/V is computed
(``mark_computed``), it is registered under a hash chained over its parent block's hash and its own tokens
(``hash_block_tokens(parent_hash, tuple(tokens))``, parent_hash None for block 0), so a new sequence with the
same leading tokens reuses those physical blocks (``allocate`` returns how many tokens it found) and skips
computing them. A block keeps its entry when it is freed: it sits in the free queue, still findable, until it
reaches the front and is taken for something else (``_take_fresh`` evicts it then). So the **least recently
freed** cached block is evicted first. A hit on a free block takes it out of the queue.

Every failed call raises before it changes anything (check first, then act).

Suggested order: ``_take_fresh``, ``_release``, ``allocate``, ``append_slots``, ``free`` (prefix caching off:
``_lookup`` is not called), then ``fork`` and copy-on-write, then ``mark_computed`` and ``_lookup``.

Run the tests:  MINIBATCH_STUDENT=block_allocator python -m pytest tests/exercises -m ex6
Run the engine on it:  exercises.patch_engine("block_allocator") (exercises/README.md)
"""
from __future__ import annotations

from minibatch.kv.block_allocator import (BlockAllocatorBase, CacheEntry, NoFreeBlocksError, _as_count, _Seq,  # noqa: F401
                                          hash_block_tokens)


class BlockAllocator(BlockAllocatorBase):
    # -- the free queue -----------------------------------------------------------------
    def _take_fresh(self) -> int:
        """Take the block at the front of the free queue for a new owner: drop its old cache entry (it will be
        overwritten), set its ref count to 1, return its id. (The caller checked that one is free.)"""
        raise NotImplementedError("Exercise 6: BlockAllocator._take_fresh (exercises/ex6_block_allocator.py)")

    def _release(self, blocks: list) -> None:
        """One table lets go of ``blocks``: each ref count drops by one, and a block that reaches 0 joins the
        BACK of the free queue. Go through them last block first (tail first): a sequence's last blocks are
        the least likely to be shared by a later prompt, so they should be evicted first. A freed block keeps
        its cache entry."""
        raise NotImplementedError("Exercise 6: BlockAllocator._release (exercises/ex6_block_allocator.py)")

    # -- the prefix cache -----------------------------------------------------------------
    def _lookup(self, tokens: list) -> list:
        """[(block, hash, serial)] of the longest cached prefix of ``tokens``, in whole blocks: block i of
        the prompt is found when ``self._cache`` has the chained hash of tokens[i*bs:(i+1)*bs] and the entry
        it points to really holds those tokens (``entry.tokens``) after the same parent (``entry.parent_serial``
        is the serial of the entry found for block i - 1, None for block 0): a hash is an index, not a proof.
        Stop at the first miss. Never cover the last token: at most (len(tokens) - 1) // bs blocks, so there is
        always one token left to compute (its logits are needed). Read only; count nothing here."""
        raise NotImplementedError("Exercise 6: BlockAllocator._lookup (exercises/ex6_block_allocator.py)")

    # -- sequences ------------------------------------------------------------------------
    def allocate(self, seq_id, token_ids) -> int:
        """A new sequence holding ``token_ids`` (a non-empty list of ints): blocks_needed(len(token_ids))
        blocks, its cached prefix first (``self._plan``), then fresh ones. Returns the number of leading tokens
        whose K/V the cache already holds (a multiple of block_size).

        Raise NoFreeBlocksError (from minibatch.kv.block_allocator: the scheduler catches that one) when
        fewer blocks are free than it needs fresh (a hit on a free block uses a queue block too), ValueError
        for an id already allocated (``self._check_new_id``). Take the hits before the fresh blocks (a fresh
        block taken first could evict a hit). Its chain starts as the hits' (hash, serial). With prefix
        caching on, count ``self.queries += (len - 1) // bs`` (blocks that could have been found) and
        ``self.hits += len(hits)``."""
        raise NotImplementedError("Exercise 6: BlockAllocator.allocate (exercises/ex6_block_allocator.py)")

    def append_slots(self, seq_id, num_new_tokens: int) -> list:
        """Grow the sequence by ``num_new_tokens`` slots (decode: 1; verify: 1 + k drafts): take blocks from the
        free queue as the last one fills. Returns the copy-on-write pairs [(src, dst)] (at most one: the
        partly filled last block, if shared). A partly filled last block that is private but still cached
        (after a ``truncate``) loses its entry: its content is about to change.

        0 new tokens: return [] and change nothing. A negative count: ValueError. Not enough free blocks for
        the new ones (and the copy): NoFreeBlocksError, nothing changed."""
        raise NotImplementedError("Exercise 6: BlockAllocator.append_slots (exercises/ex6_block_allocator.py)")

    def mark_computed(self, seq_id, num_computed_tokens: int, token_ids) -> None:
        """The K/V of the first ``num_computed_tokens`` of ``token_ids`` is now in the cache: register every
        *full* block among them that is not yet in the sequence's chain (in order, from len(chain)): hash
        it after its parent; if the block already has an entry (a hit, or shared by fork) extend the chain
        with it; else if the hash is already cached in another block (same tokens, same parent: check)
        extend the chain with that entry's serial (and register nothing); else make a new
        ``CacheEntry(hash, tokens, parent_serial, self._next_serial)`` (then ``_next_serial += 1``) and put it
        in both ``self._entries[block]`` and ``self._cache[hash]``. Never register a block before it is
        computed: another sequence would read K/V nobody wrote.

        ValueError unless 0 <= num_computed_tokens <= min(num_slots, len(token_ids)). With prefix caching off,
        do nothing (after that check)."""
        raise NotImplementedError("Exercise 6: BlockAllocator.mark_computed (exercises/ex6_block_allocator.py)")

    def fork(self, parent_id, child_id) -> None:
        """Parallel sampling: the child shares every block of the parent (each ref count + 1), with the same
        num_slots and chain. Nothing is copied now; a write into a shared block copies it (append_slots).

        ``child_id`` must be new: ValueError when it is already allocated (replacing its table would leak its
        blocks), UnknownSequenceError for an unknown parent; either way nothing changes."""
        raise NotImplementedError("Exercise 6: BlockAllocator.fork (exercises/ex6_block_allocator.py)")

    def free(self, seq_id) -> None:
        """The sequence is gone: release its blocks (``_release``) and forget it."""
        raise NotImplementedError("Exercise 6: BlockAllocator.free (exercises/ex6_block_allocator.py)")
