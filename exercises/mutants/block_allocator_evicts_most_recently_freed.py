"""Mutant (exercise 6): a fresh block is taken from the back of the free queue, the most recently freed one:
the prefix cache evicts the blocks most likely to be reused first (LIFO instead of LRU)."""
from minibatch.kv.block_allocator import BlockAllocator as Reference, NoFreeBlocksError, _Seq  # noqa: F401


class BlockAllocator(Reference):
    def _take_fresh(self):
        block, _ = self._free.popitem(last=True)        # BUG: the back, not the front
        self._evict(block)
        self._ref[block] = 1
        return block
