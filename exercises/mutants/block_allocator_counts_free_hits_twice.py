"""Mutant (exercise 6): allocate compares the fresh blocks it needs with the whole free queue, forgetting that
a prefix-cache hit on a free block leaves the queue too: with the pool nearly full it takes one block too many
(a KeyError half-way) where it should raise NoFreeBlocksError before changing anything."""
from minibatch.kv.block_allocator import BlockAllocator as Reference, NoFreeBlocksError, _Seq  # noqa: F401


class BlockAllocator(Reference):
    def allocate(self, seq_id, token_ids):
        self._check_new_id(seq_id)
        tokens, hits, fresh, free = self._plan(token_ids)
        if fresh > len(self._free):                     # BUG: not "free", which leaves the hits out
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs {fresh} fresh blocks")
        blocks = []
        for b, _, _ in hits:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
            blocks.append(b)
        self._seqs[seq_id] = _Seq(blocks, len(tokens), [(h, s) for _, h, s in hits])
        blocks += [self._take_fresh() for _ in range(fresh)]
        if self.enable_prefix_caching:
            self.queries += (len(tokens) - 1) // self.block_size
            self.hits += len(hits)
        return len(hits) * self.block_size
