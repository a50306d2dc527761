"""Exercise 6: the block allocator (vLLM / PagedAttention, Kwon et al., SOSP'23, Sec. 4.2-4.4; vLLM v1's
KV cache manager for the prefix cache).

The KV cache is a pool of ``num_blocks`` blocks of ``block_size`` token slots. The allocator decides which
physical block each sequence's logical blocks live in (its **block table**), counts how many tables hold each
block (its **ref count**), and keeps the blocks nobody holds in a **free queue**. You write the policy; the
base class ``BlockAllocatorBase`` gives you the state below and every method that only reads it. This
docstring is the whole contract: you need not read the base class (``minibatch/kv/block_pool.py``).

The state (yours to change, in the methods you write):

    self.block_size, self.num_blocks, self.enable_prefix_caching      (set by the constructor)
    self._ref           a list: self._ref[b] = ref count of block b (how many block tables hold it)
    self._free          the free queue: an OrderedDict used as an ordered set of block ids, front = taken
                        next. self._free.popitem(last=False) takes the front; self._free[b] = None puts b at
                        the back; del self._free[b] takes b out from anywhere. A fresh pool holds 0, 1, 2, ...
    self._seqs          a dict seq_id -> _Seq(blocks, num_slots, chain): ``blocks`` the block table (a list),
                        ``num_slots`` the token slots it holds, ``chain`` a list of (hash, serial), one per
                        leading full block registered in the prefix cache (below)
    self._cache         a dict block hash -> block id         } the prefix cache: one entry per registered
    self._entries       a dict block id -> CacheEntry         } block, in both dicts
    CacheEntry(block_hash, tokens, parent_serial, serial)   (importable below): the block's hash, its tokens
                        (a tuple of block_size ints), the serial of the entry its parent block matched (None
                        for a first block), and its own serial: a number taken from self._next_serial (then
                        add 1), never reused, so a stale entry can never pass for a newer one with its hash
    self.hits, self.queries   the prefix cache's counters (allocate updates them)

Given methods: self._get(seq_id) -> the _Seq, or UnknownSequenceError; self._check_new_id(seq_id): ValueError
for an id already allocated; self._evict(b) drops block b's cache entry (from both dicts), if it has one;
self.blocks_needed(n) = ceil(n / block_size); self._plan(token_ids) -> (tokens, hits, fresh, free) for a new
sequence: the tokens as a list (ValueError if empty), hits = self._lookup(tokens) ([] with caching off),
fresh = blocks_needed(len) - len(hits), free = the queue blocks usable for the fresh ones (the queue less the
hits that sit in it); can_allocate(tokens) (uses _plan); truncate(seq_id, n) (calls your _release);
check_invariants() and the read-only views the tests use (block_table, ref_counts, free_block_ids, ...).
Errors: NoFreeBlocksError (the scheduler catches it), UnknownSequenceError, ValueError.

**The policies the tests check** (vLLM's; part of the specification, not a matter of taste):

* a fresh block comes from the FRONT of the free queue; a block whose ref count reaches 0 goes to the BACK;
* a sequence's blocks are released LAST BLOCK FIRST (tail first): its last blocks, the least likely to be
  shared by a later prompt, reach the front, and are evicted, first;
* a freed block keeps its cache entry until it is taken for something else: the least recently freed cached
  block is evicted first (LRU over the queue), never the most recently freed;
* every failed call raises before it changes anything (check first, then act).

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
reaches the front and is taken for something else (``_take_fresh`` evicts it then). A hit on a free block
takes it out of the queue.

A worked order of attack, and how the prefix cache's pieces fit together, are in ``exercises/hints/ex6.md``
(your instructor may hand it out).

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
        *full* block among them that is not yet in the sequence's chain, in order, each hashed after its parent
        (``hash_block_tokens(parent_hash, tuple(tokens))``), and extend the chain with its (hash, serial). A
        block that already has an entry (a hit, or shared by fork) is not registered again; a block whose content
        is already cached in another block (same hash, same tokens, same parent) joins the chain with that
        entry's serial and registers nothing. Never register a block before it is computed: another sequence
        would read K/V nobody wrote.

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
