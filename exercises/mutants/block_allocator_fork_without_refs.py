"""Mutant (exercise 6): fork copies the parent's block table but does not raise the ref counts: the blocks
look private, so neither sequence copies before writing, and freeing one frees the other's blocks."""
from minibatch.kv.block_allocator import BlockAllocator as Reference, NoFreeBlocksError, _Seq  # noqa: F401


class BlockAllocator(Reference):
    def fork(self, parent_id, child_id):
        p = self._get(parent_id)
        self._check_new_id(child_id)
        self._seqs[child_id] = _Seq(list(p.blocks), p.num_slots, list(p.chain))   # BUG: no self._ref[b] += 1
