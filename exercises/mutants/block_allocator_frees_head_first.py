"""Mutant (exercise 6): _release returns a sequence's blocks first block first, so its shared prompt blocks
(block 0: the most likely to be reused) reach the front of the queue and are evicted before its tail."""
from minibatch.kv.block_allocator import BlockAllocator as Reference, NoFreeBlocksError, _Seq  # noqa: F401


class BlockAllocator(Reference):
    def _release(self, blocks):
        for b in blocks:                                # BUG: not reversed(blocks)
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
