"""The radix cache: SGLang's prefix cache, a radix tree over token runs (RadixAttention, Zheng et al. 2024, §3).

The hash chain (``block_allocator.py``) finds a prefix one block at a time, in a dict. The radix tree keeps every
cached prefix as a *path*: each **node** (``TreeNode``) is an edge labelled with a run of token ids (its ``key``)
and holds the KV blocks of those tokens (its ``value``). A prompt's cached prefix is the path its tokens spell out
from the root (``match_prefix``); a computed one is added as a new branch where its tokens leave the tree
(``insert``). Two prompts sharing a template share the template's nodes, so the tree *shows* what is shared.

Pages. minibatch's KV lives in blocks of ``block_size`` slots, so a page is a block: a key is a run of whole pages
(``len(key) == page_size * len(value)``, one block id per page) and a match counts whole pages only, so a key
that is not page-aligned matches only its whole pages (its partial last page is never looked at). Two children of
one node differ in their first page: ``children`` is keyed by it.

Splits. A match (or an insert) that ends inside an edge, at a page boundary, splits the node there: a new node
takes the matched head of the edge (and its blocks) and the old node keeps the tail as its only child. Nothing is
lost or copied; the new node inherits the old one's lock count and access time.

Locks and eviction (§3.2). A running request holds its path: ``inc_lock_ref(node)`` adds one to every node from
``node`` up to the root, ``dec_lock_ref`` takes it back. A node no request holds (``lock_ref == 0``) is
*evictable*; ``evictable_size()`` counts their blocks. ``evict(n)`` frees exactly ``n`` blocks (or every evictable
one, if fewer): it takes unlocked **leaves**, least recently *accessed* first (a match or an insert through a node
touches it, and every node above it), and a parent whose last child goes becomes a leaf in its turn. So a shared
stem outlives its branches. A leaf longer than what is still needed gives up only its tail pages. Every block in
the tree is there exactly once; the tree does not own blocks: it returns the evicted ones to its caller (the block
allocator, ``radix_allocator.py``), which owns the ref counts and the free queue.

Time is a counter (one tick per ``match_prefix`` or ``insert``), not a clock, so that runs replay exactly.

``RadixCacheBase`` holds the tree's state and everything that only reads it (``peek``, the sizes, the invariant
checker); ``RadixCache`` adds what changes it: ``match_prefix``, ``insert``, ``evict``, the lock refs (exercise 12
is to write it: ``exercises/ex12_radix_cache.py``). SGLang's names throughout
(``python/sglang/srt/mem_cache/radix_cache.py``).
"""
from __future__ import annotations

import heapq
from typing import Optional


class TreeNode:
    """One edge of the radix tree: a run of whole pages, and their blocks."""

    def __init__(self, node_id: int, parent: Optional["TreeNode"] = None, key: tuple = (), value: Optional[list] = None,
                 last_access_time: int = 0):
        self.id = node_id                          # creation order (ties in the eviction heap; stable drawings)
        self.parent = parent
        self.children: dict = {}                   # first page (a tuple of page_size token ids) -> TreeNode
        self.key: tuple = key                      # token ids, page_size * len(value) of them
        self.value: list = [] if value is None else value   # block ids, one per page of key
        self.lock_ref = 0                          # requests whose path runs through this node
        self.last_access_time = last_access_time   # the tick of the last match or insert through it

    def __repr__(self):
        return f"TreeNode(id={self.id}, pages={len(self.value)}, lock_ref={self.lock_ref}, t={self.last_access_time})"


class RadixCacheBase:
    """The tree's state and its readings. State: ``root_node`` (no key, no blocks, locked for ever, so it is never
    evicted); ``evictable_size_`` / ``protected_size_`` the blocks of unlocked / locked nodes; ``_clock`` the last
    tick; ``_next_id`` the next node's id."""

    def __init__(self, page_size: int):
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.page_size = page_size
        self.reset()

    def reset(self) -> None:
        """An empty tree (the blocks it held are the caller's to take back first)."""
        self._clock, self._next_id = 0, 0
        self.root_node = self._new_node()
        self.root_node.lock_ref = 1
        self.evictable_size_ = 0
        self.protected_size_ = 0

    # -- helpers ---------------------------------------------------------------------------
    def _new_node(self, parent=None, key: tuple = (), value=None) -> TreeNode:
        node = TreeNode(self._next_id, parent, key, value, self._clock)
        self._next_id += 1
        return node

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _page_aligned(self, key) -> tuple:
        """The whole pages of ``key``: a partial last page is never matched nor inserted."""
        key = tuple(key)
        return key[:len(key) // self.page_size * self.page_size]

    def _child_key(self, key: tuple) -> tuple:
        return key[:self.page_size]

    def _key_match(self, edge: tuple, key: tuple) -> int:
        """Tokens of ``key``'s head equal to ``edge``'s, counted in whole pages."""
        ps, n = self.page_size, 0
        while n < min(len(edge), len(key)) and edge[n:n + ps] == key[n:n + ps]:
            n += ps
        return n

    # -- readings ---------------------------------------------------------------------------
    def evictable_size(self) -> int:
        """Blocks in nodes no request holds: what ``evict`` can free."""
        return self.evictable_size_

    def protected_size(self) -> int:
        """Blocks in locked nodes."""
        return self.protected_size_

    def peek(self, key) -> tuple[list, int]:
        """(the blocks of ``key``'s longest cached prefix, how many of them sit in unlocked nodes), changing
        nothing: no split, no access. The allocator's question "could this prompt be allocated?" must not count
        as a use."""
        key, node, blocks, unlocked = self._page_aligned(key), self.root_node, [], 0
        while key and self._child_key(key) in node.children:
            child = node.children[self._child_key(key)]
            n = self._key_match(child.key, key)
            pages = child.value[:n // self.page_size]
            blocks += pages
            unlocked += len(pages) if child.lock_ref == 0 else 0
            if n < len(child.key):
                break
            node, key = child, key[n:]
        return blocks, unlocked

    def nodes(self) -> list:
        """Every node but the root, parents before children (children in first-page order)."""
        out, stack = [], [self.root_node]
        while stack:
            node = stack.pop()
            if node is not self.root_node:
                out.append(node)
            stack += [node.children[k] for k in sorted(node.children, reverse=True)]
        return out

    def all_blocks(self) -> list:
        return [b for node in self.nodes() for b in node.value]

    def path_key(self, node: TreeNode) -> tuple:
        """The token ids from the root down to the end of ``node``."""
        parts = []
        while node is not None:
            parts.append(node.key)
            node = node.parent
        return tuple(t for part in reversed(parts) for t in part)

    def evictable_leaves(self) -> list:
        return [n for n in self.nodes() if not n.children and n.lock_ref == 0]

    def snapshot(self) -> list:
        """The tree as plain data, parents first: equal snapshots mean equal trees (tests use it)."""
        return [(self.path_key(n), list(n.value), n.lock_ref, n.last_access_time) for n in self.nodes()] + \
            [("clock", self._clock)]

    # -- invariants ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        ps, seen, evictable, protected = self.page_size, set(), 0, 0
        assert self.root_node.lock_ref >= 1 and not self.root_node.key and not self.root_node.value
        for node in self.nodes():
            p = node.parent
            assert p is not None and p.children.get(self._child_key(node.key)) is node, f"{node} is not its parent's"
            assert node.value and len(node.key) == ps * len(node.value), f"{node}: key is not its pages' tokens"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()) >= 0, \
                f"{node}: a lock below it does not hold it"
            # a match or an insert touches the whole path, so nothing is newer than its parent
            assert p is self.root_node or p.last_access_time >= node.last_access_time, f"{node}: newer than its parent"
            assert not seen & set(node.value), f"blocks {sorted(seen & set(node.value))} twice in the tree"
            seen |= set(node.value)
            evictable += len(node.value) if node.lock_ref == 0 else 0
            protected += len(node.value) if node.lock_ref > 0 else 0
        assert (evictable, protected) == (self.evictable_size_, self.protected_size_), \
            f"evictable/protected sizes {self.evictable_size_}/{self.protected_size_}, counted {evictable}/{protected}"


class RadixCache(RadixCacheBase):
    """What changes the tree: match (splitting), insert, evict, and the locks of running requests."""

    def match_prefix(self, key) -> tuple[list, TreeNode]:
        """(the blocks of the longest cached prefix of ``key``, in whole pages; the node where it ends). A match
        that ends inside an edge splits it there, so the returned node ends exactly at the match. The path is
        touched (the LRU order of eviction)."""
        key, now = self._page_aligned(key), self._tick()
        node, blocks = self.root_node, []
        node.last_access_time = now
        while key and self._child_key(key) in node.children:
            child = node.children[self._child_key(key)]
            n = self._key_match(child.key, key)
            if n < len(child.key):
                child = self._split_node(child, n)
            child.last_access_time = now
            blocks += child.value
            node, key = child, key[n:]
        return blocks, node

    def insert(self, key, value) -> int:
        """Add ``key``'s whole pages, their blocks ``value`` (one per page); returns how many tokens of it the tree
        held already (those pages keep the tree's blocks: a duplicate is not added twice). The path is touched."""
        key = self._page_aligned(key)
        value = list(value)
        if len(value) < len(key) // self.page_size:
            raise ValueError(f"insert: {len(key) // self.page_size} pages but only {len(value)} blocks")
        now, node, i = self._tick(), self.root_node, 0
        node.last_access_time = now
        while i < len(key) and self._child_key(key[i:]) in node.children:
            child = node.children[self._child_key(key[i:])]
            n = self._key_match(child.key, key[i:])
            if n < len(child.key):
                child = self._split_node(child, n)
            child.last_access_time = now
            node, i = child, i + n
        if i < len(key):                                   # the rest is new: one leaf
            leaf = self._new_node(node, key[i:], value[i // self.page_size:len(key) // self.page_size])
            leaf.last_access_time = now
            node.children[self._child_key(leaf.key)] = leaf
            self.evictable_size_ += len(leaf.value)
        return i

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut ``child``'s edge after ``split_len`` tokens (a page boundary): a new node takes the head, ``child``
        keeps the tail under it. Returns the new node."""
        pages = split_len // self.page_size
        new = self._new_node(child.parent, child.key[:split_len], child.value[:pages])
        new.lock_ref, new.last_access_time = child.lock_ref, child.last_access_time
        child.parent.children[self._child_key(new.key)] = new
        child.key, child.value, child.parent = child.key[split_len:], child.value[pages:], new
        new.children = {self._child_key(child.key): child}
        return new

    def evict(self, num_blocks: int) -> list:
        """Free ``num_blocks`` blocks (or every evictable one, if fewer) from unlocked leaves, least recently
        accessed first; returns them (a leaf's tail page first). A parent left childless and unlocked is a leaf
        next."""
        heap = [(n.last_access_time, n.id, n) for n in self.evictable_leaves()]
        heapq.heapify(heap)
        out = []
        while len(out) < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            k = min(num_blocks - len(out), len(leaf.value))
            out += reversed(leaf.value[len(leaf.value) - k:])
            self.evictable_size_ -= k
            if k < len(leaf.value):                        # enough: the leaf keeps its head pages
                leaf.key, leaf.value = leaf.key[:-k * self.page_size], leaf.value[:-k]
                continue
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key)]
            if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return out

    def inc_lock_ref(self, node: TreeNode) -> None:
        """A request holds the path from ``node`` up: none of it can be evicted."""
        while node is not self.root_node:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.value)
                self.protected_size_ += len(node.value)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """The request is done with the path from ``node`` up: nodes nobody else holds become evictable."""
        if node is not self.root_node and node.lock_ref <= 0:      # (then no node above it is locked by it either)
            raise ValueError(f"dec_lock_ref: {node} is not locked")
        while node is not self.root_node:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size_ += len(node.value)
                self.protected_size_ -= len(node.value)
            node = node.parent
