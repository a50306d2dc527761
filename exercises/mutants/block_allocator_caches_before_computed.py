"""Mutant (exercise 6): mark_computed registers every full block of the sequence's tokens, not only the
computed ones: a prefix-cache hit then hands another sequence a block whose K/V nobody has written yet."""
from minibatch.kv.block_allocator import BlockAllocator as Reference, NoFreeBlocksError, _Seq  # noqa: F401


class BlockAllocator(Reference):
    def mark_computed(self, seq_id, num_computed_tokens, token_ids):
        s = self._get(seq_id)
        full = min(s.num_slots, len(token_ids))        # BUG: every full block held, computed or not
        super().mark_computed(seq_id, num_computed_tokens, token_ids)
        if num_computed_tokens < full:
            super().mark_computed(seq_id, full, token_ids)
