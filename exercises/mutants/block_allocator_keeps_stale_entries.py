"""Mutant (exercise 6): _take_fresh reuses a free block without evicting its cache entry: the prefix cache
still points at the block after a new owner has overwritten it."""
from minibatch.kv.block_allocator import BlockAllocator as Reference, NoFreeBlocksError, _Seq  # noqa: F401


class BlockAllocator(Reference):
    def _take_fresh(self):
        block, _ = self._free.popitem(last=False)       # BUG: self._evict(block) forgotten
        self._ref[block] = 1
        return block
