"""Mutant (exercise 12): eviction stops one block before the number asked: the allocator finds its free queue a
block short."""
from minibatch.kv.radix_cache import RadixCache as Reference


class RadixCache(Reference):
    def evict(self, num_blocks):
        return super().evict(max(0, num_blocks - 1))      # BUG: off by one
