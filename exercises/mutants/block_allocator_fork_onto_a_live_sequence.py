"""Mutant (exercise 6): fork never checks the child's id: forking onto a sequence that is still live replaces
its block table, and the blocks that table held leak (their ref counts never drop)."""
from minibatch.kv.block_allocator import BlockAllocator as Reference, NoFreeBlocksError, _Seq  # noqa: F401


class BlockAllocator(Reference):
    def fork(self, parent_id, child_id):
        p = self._get(parent_id)                        # BUG: no self._check_new_id(child_id)
        for b in p.blocks:
            self._ref[b] += 1
        self._seqs[child_id] = _Seq(list(p.blocks), p.num_slots, list(p.chain))
