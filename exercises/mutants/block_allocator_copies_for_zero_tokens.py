"""Mutant (exercise 6): append_slots(seq, 0) goes through the copy-on-write path: a sequence whose partly filled
last block is shared gets a private copy (and a block from the queue) although it writes nothing."""
from minibatch.kv.block_allocator import BlockAllocator as Reference, NoFreeBlocksError, _as_count, _Seq  # noqa: F401


class BlockAllocator(Reference):
    def append_slots(self, seq_id, num_new_tokens):
        s = self._get(seq_id)
        new = _as_count(num_new_tokens, "num_new_tokens")
        if new < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {new}")
        # BUG: no early return for 0 new tokens
        grow = self.blocks_needed(s.num_slots + new) - len(s.blocks)
        last = s.blocks[-1] if s.num_slots % self.block_size else None
        cow = last is not None and self._ref[last] > 1
        if grow + cow > len(self._free):
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs {grow + cow} blocks")
        pairs = []
        if cow:
            dst = self._take_fresh()
            self._ref[last] -= 1
            s.blocks[-1] = dst
            pairs.append((last, dst))
        elif last is not None:
            self._evict(last)
        s.blocks += [self._take_fresh() for _ in range(grow)]
        s.num_slots += new
        return pairs
