"""Mutant (exercise 6): allocate never checks that enough blocks are free: it takes what there is and fails
half-way with a KeyError from the empty queue, having changed the pool, instead of NoFreeBlocksError before
changing anything (the scheduler catches that one to preempt or wait)."""
from minibatch.kv.block_allocator import BlockAllocator as Reference, NoFreeBlocksError, _Seq  # noqa: F401


class BlockAllocator(Reference):
    def allocate(self, seq_id, token_ids):
        self._check_new_id(seq_id)
        tokens, hits, fresh, free = self._plan(token_ids)
        blocks = []                                     # BUG: no "if fresh > free: raise NoFreeBlocksError"
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
