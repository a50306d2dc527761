"""Mutant (exercise 6): _release frees a block only when its ref count is 1 and never decrements a shared
block's count, so after a fork and a free the shared blocks still count two holders (and leak for ever)."""
from minibatch.kv.block_allocator import BlockAllocator as Reference, NoFreeBlocksError, _Seq  # noqa: F401


class BlockAllocator(Reference):
    def _release(self, blocks):
        for b in reversed(blocks):
            if self._ref[b] == 1:                       # BUG: a shared block's count is not decremented
                self._ref[b] = 0
                self._free[b] = None
