"""Mutant (exercise 12): eviction takes every leaf, locked or not: a running request's prefix is freed under it."""
import heapq

from minibatch.kv.radix_cache import RadixCache as Reference


class RadixCache(Reference):
    def evict(self, num_blocks):
        heap = [(n.last_access_time, n.id, n) for n in self.nodes() if not n.children]   # BUG: no lock check
        heapq.heapify(heap)
        out = []
        while len(out) < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            k = min(num_blocks - len(out), len(leaf.value))
            out += reversed(leaf.value[len(leaf.value) - k:])
            self.evictable_size_ -= k
            if k < len(leaf.value):
                leaf.key, leaf.value = leaf.key[:-k * self.page_size], leaf.value[:-k]
                continue
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key)]
            if parent is not self.root_node and not parent.children:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return out
