"""Mutant (exercise 12): an insert counts every page of its key as new, also those the tree held already: the
evictable size grows past the blocks the tree really has (the allocator then counts free blocks it cannot give)."""
from minibatch.kv.radix_cache import RadixCache as Reference


class RadixCache(Reference):
    def insert(self, key, value):
        had = super().insert(key, value)
        self.evictable_size_ += had // self.page_size     # BUG: the pages already there, counted again
        return had
