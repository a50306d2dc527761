"""Mutant (exercise 12): dec_lock_ref lets go of the node only, not of the path above it: when a request finishes,
its prefix stays locked for ever, and its blocks never come back to the pool."""
from minibatch.kv.radix_cache import RadixCache as Reference


class RadixCache(Reference):
    def dec_lock_ref(self, node):
        if node is self.root_node:
            return
        if node.lock_ref <= 0:
            raise ValueError(f"dec_lock_ref: {node} is not locked")
        node.lock_ref -= 1                                # BUG: the ancestors keep their lock
        if node.lock_ref == 0:
            self.evictable_size_ += len(node.value)
            self.protected_size_ -= len(node.value)
