"""Mutant (exercise 6): copy-on-write gives the writer a fresh block but forgets to drop the shared block's
ref count, so the block counts a holder that left it."""
from minibatch.kv.block_allocator import BlockAllocator as Reference, NoFreeBlocksError, _Seq  # noqa: F401


class BlockAllocator(Reference):
    def append_slots(self, seq_id, num_new_tokens):
        s = self._get(seq_id)
        new = num_new_tokens
        if new < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {new}")
        if not new:
            return []
        n_old = s.num_slots
        grow = self.blocks_needed(n_old + new) - len(s.blocks)
        last = s.blocks[-1] if n_old % self.block_size else None
        cow = last is not None and self._ref[last] > 1
        if grow + cow > len(self._free):
            raise NoFreeBlocksError(f"{seq_id!r} needs {grow + cow} blocks")
        pairs = []
        if cow:
            dst = self._take_fresh()
            s.blocks[-1] = dst                          # BUG: self._ref[last] -= 1 forgotten
            pairs.append((last, dst))
        elif last is not None:
            self._evict(last)
        s.blocks += [self._take_fresh() for _ in range(grow)]
        s.num_slots += new
        return pairs
