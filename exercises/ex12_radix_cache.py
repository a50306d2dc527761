"""Exercise 12: the radix cache (SGLang's RadixAttention, Zheng et al. 2024, Sec. 3; SGLang's
``python/sglang/srt/mem_cache/radix_cache.py``).

A prefix cache as a tree. Each **node** (``TreeNode``) is an edge labelled with a run of token ids, its ``key``,
and holds the KV blocks of those tokens, its ``value``: one block per **page** of ``page_size`` tokens (a page is a
block), so ``len(key) == page_size * len(value)``. The path from the root spelled by a prompt's tokens is the
longest prefix of it that is cached. You write what changes the tree; the base class ``RadixCacheBase`` gives you
the state below and every method that only reads it. This docstring is the whole contract: you need not read the
base class (``minibatch/kv/radix_cache.py``).

The state (yours to change, in the methods you write):

    self.page_size          tokens per page (set by the constructor)
    self.root_node          a TreeNode with no key and no blocks, lock_ref 1 for ever (never evicted)
    node.children           a dict: the first page of a child's key (a tuple of page_size token ids) -> the child
    node.parent, node.key (a tuple), node.value (a list of block ids), node.id (creation order)
    node.lock_ref           how many running requests hold the path through this node
    node.last_access_time   the tick of the last match_prefix or insert that went through it
    self.evictable_size_    blocks in nodes with lock_ref == 0       } keep both exact: the allocator counts
    self.protected_size_    blocks in nodes with lock_ref > 0        } the evictable ones as free blocks

Given methods: self._tick() -> a new tick (call it once per match_prefix or insert, and stamp every node the call
goes through with it); self._new_node(parent, key, value) -> a TreeNode (not yet in parent.children);
self._page_aligned(key) -> its whole pages, as a tuple; self._child_key(key) -> its first page (the children's
dict key); self._key_match(edge, key) -> how many leading tokens they share, counted in whole pages;
self.evictable_leaves() -> the nodes with no children and lock_ref 0; self.nodes(), self.all_blocks(),
self.peek(key), self.path_key(node), self.evictable_size(), self.protected_size(), self.check_invariants().

**What the tests check** (SGLang's behaviour, part of the specification):

* whole pages only: a key that is not page-aligned matches (and inserts) only its whole pages;
* a match or an insert that ends inside an edge, at a page boundary, SPLITS the node there: a new node takes the
  head of the edge (and its blocks, its lock_ref, its last_access_time) and the old node keeps the tail as its
  child. Nothing is lost: a later match of the whole edge still finds every block;
* a duplicate insert adds nothing: pages the tree holds keep the tree's blocks, and count once;
* ``evict(n)`` frees exactly ``n`` blocks (or all evictable ones, if fewer), taking unlocked LEAVES, least recently
  ACCESSED first (a match counts as an access, not only an insert); a leaf longer than what is still needed gives up
  only its tail pages (tail page first in the list returned); a parent becomes a leaf, and evictable, only once its
  LAST child is gone (and only if unlocked). A locked node is never evicted;
* ``inc_lock_ref(node)`` / ``dec_lock_ref(node)`` add / take one lock on every node from ``node`` up to the root
  (the root excluded), moving blocks between the evictable and protected counts when a count leaves / reaches 0;
  ``dec_lock_ref`` of an unlocked node is a ValueError.

    page_size 2.  insert([1, 2, 3, 4], [10, 11])  ->  root -(1 2 3 4)-> [10 11]                  returns 0
                  match_prefix([1, 2, 9, 9, 5])   ->  ([10], the new node (1 2)): the edge is split
                                                     root -(1 2)-> [10] -(3 4)-> [11]
                  insert([1, 2, 5, 6], [20, 21])  ->  returns 2 (page (1 2) was there: it keeps block 10)
                                                     root -(1 2)-> [10] -(3 4)-> [11]
                                                                        -(5 6)-> [21]
                  evict(1)                        ->  [11]  (the leaf (3 4): accessed before (5 6))

Run the tests:  MINIBATCH_STUDENT=radix_cache python -m pytest tests/exercises -m ex12
Run the engine on it:  exercises.patch_engine("radix_cache"), then LLM(..., prefix_cache="radix")
"""
from __future__ import annotations

import heapq  # noqa: F401 (a heap orders the evictable leaves)

from minibatch.kv.radix_cache import RadixCacheBase, TreeNode  # noqa: F401


class RadixCache(RadixCacheBase):
    def match_prefix(self, key) -> tuple:
        """(the blocks of the longest cached prefix of ``key``, in whole pages, as a list; the node where that prefix
        ends). Walk from the root along the child whose key starts with the next page; if the match ends inside a
        child's edge, split it there (``_split_node``) so that the node returned ends exactly at the match. Stamp
        the root and every node on the path with one new tick. An empty match returns ([], self.root_node)."""
        raise NotImplementedError("Exercise 12: RadixCache.match_prefix (exercises/ex12_radix_cache.py)")

    def insert(self, key, value) -> int:
        """Add ``key``'s whole pages with their blocks ``value`` (value[i] holds page i; a ValueError if there are
        fewer blocks than pages). Walk (and split) as ``match_prefix`` does; the pages past the path become one new
        leaf with their blocks, evictable (unlocked). Stamp the path and the new leaf with one new tick. Returns how
        many tokens of the key the tree held already (those pages keep the tree's blocks)."""
        raise NotImplementedError("Exercise 12: RadixCache.insert (exercises/ex12_radix_cache.py)")

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut ``child``'s edge after ``split_len`` tokens (a whole number of pages, less than the edge): a new node
        in ``child``'s place under its parent takes the head of the key and its blocks, child's lock_ref and
        last_access_time; ``child`` keeps the tail and becomes the new node's only child. Returns the new node."""
        raise NotImplementedError("Exercise 12: RadixCache._split_node (exercises/ex12_radix_cache.py)")

    def evict(self, num_blocks: int) -> list:
        """Free ``num_blocks`` blocks, or every evictable one if fewer; return them in the order freed. Take the
        least recently accessed unlocked leaf (ties by node.id); a leaf with more blocks than still needed gives up
        its tail pages only (last page first), otherwise it leaves its parent, which may become an evictable leaf
        in its turn. Keep ``evictable_size_`` exact."""
        raise NotImplementedError("Exercise 12: RadixCache.evict (exercises/ex12_radix_cache.py)")

    def inc_lock_ref(self, node: TreeNode) -> None:
        """A request holds the path from ``node`` up to the root (excluded): one more lock on each node; a node
        whose count leaves 0 moves its blocks from evictable to protected."""
        raise NotImplementedError("Exercise 12: RadixCache.inc_lock_ref (exercises/ex12_radix_cache.py)")

    def dec_lock_ref(self, node: TreeNode) -> None:
        """The request lets the path go: one lock less on each node from ``node`` up to the root (excluded); a node
        whose count reaches 0 moves its blocks back to evictable. A ValueError (changing nothing) if ``node`` is not
        locked."""
        raise NotImplementedError("Exercise 12: RadixCache.dec_lock_ref (exercises/ex12_radix_cache.py)")
