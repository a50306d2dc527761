"""Mutant (exercise 6): the query counter counts len(tokens) // block_size blocks, the last token's block
included, although the lookup never covers the last token: one query too many whenever the prompt fills its
last block exactly."""
from minibatch.kv.block_allocator import BlockAllocator as Reference, NoFreeBlocksError, _Seq  # noqa: F401


class BlockAllocator(Reference):
    def allocate(self, seq_id, token_ids):
        queries = self.queries
        cached = super().allocate(seq_id, token_ids)
        if self.enable_prefix_caching:
            self.queries = queries + len(token_ids) // self.block_size      # BUG: not (len - 1) // bs
        return cached
