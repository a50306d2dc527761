"""Mutant (exercise 12): a parent becomes evictable when any child goes, not its last: an inner node is evicted
while other branches still hang under it."""
import heapq

from minibatch.kv.radix_cache import RadixCache as Reference


class RadixCache(Reference):
    def evict(self, num_blocks):
        heap = [(n.last_access_time, n.id, n) for n in self.evictable_leaves()]
        heapq.heapify(heap)
        out = []
        while len(out) < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            if leaf.parent is None or self._child_key(leaf.key) not in leaf.parent.children:
                continue                                 # (evicted already)
            k = min(num_blocks - len(out), len(leaf.value))
            out += reversed(leaf.value[len(leaf.value) - k:])
            self.evictable_size_ -= k
            if k < len(leaf.value):
                leaf.key, leaf.value = leaf.key[:-k * self.page_size], leaf.value[:-k]
                continue
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key)]
            if parent is not self.root_node and parent.lock_ref == 0:      # BUG: children left or not
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return out
