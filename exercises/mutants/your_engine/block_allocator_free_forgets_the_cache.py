"""Mutant (exercise 11, in exercise 6's file): ``free`` returns the blocks to the free queue but drops their
prefix-cache entries, as if a freed block's K/V were gone. The text stays right (a miss only recomputes), but a
preempted sequence finds nothing of its own when readmitted, nor a later request the prefix of one that finished."""
from minibatch.kv.block_allocator import BlockAllocator as Reference


class BlockAllocator(Reference):
    def free(self, seq_id):
        blocks = self.block_table(seq_id)
        super().free(seq_id)
        for b in blocks:
            if self.ref_count(b) == 0:
                self._evict(b)                    # BUG: a free block keeps its cache entry until it is taken
