"""Mutant (exercise 6): a prefix-cache hit on a free block raises its ref count but leaves it in the free
queue, so the next fresh block taken can be that same block: two sequences then write into one block."""
from minibatch.kv.block_allocator import BlockAllocator as Reference, NoFreeBlocksError, _Seq  # noqa: F401


class BlockAllocator(Reference):
    def allocate(self, seq_id, token_ids):
        self._check_new_id(seq_id)
        tokens, hits, fresh, free = self._plan(token_ids)
        if fresh > free:
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs {fresh} fresh blocks, {free} are free")
        blocks = []
        for b, _, _ in hits:                            # BUG: "del self._free[b]" when its count was 0
            self._ref[b] += 1
            blocks.append(b)
        blocks += [self._take_fresh() for _ in range(fresh)]
        if self.enable_prefix_caching:
            self.queries += (len(tokens) - 1) // self.block_size
            self.hits += len(hits)
        self._seqs[seq_id] = _Seq(blocks, len(tokens), [(h, s) for _, h, s in hits])
        return len(hits) * self.block_size
