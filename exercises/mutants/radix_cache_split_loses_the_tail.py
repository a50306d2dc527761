"""Mutant (exercise 12): a split keeps the head of the edge and drops its tail: the cached tokens past the split
point (and their blocks) fall out of the tree."""
from minibatch.kv.radix_cache import RadixCache as Reference


class RadixCache(Reference):
    def _split_node(self, child, split_len):
        pages = split_len // self.page_size
        new = self._new_node(child.parent, child.key[:split_len], child.value[:pages])
        new.lock_ref, new.last_access_time = child.lock_ref, child.last_access_time
        child.parent.children[self._child_key(new.key)] = new
        if child.lock_ref == 0:                           # (the sizes follow the blocks it lost)
            self.evictable_size_ -= len(child.value) - pages
        else:
            self.protected_size_ -= len(child.value) - pages
        return new                                        # BUG: child's tail is not hung under the new node
