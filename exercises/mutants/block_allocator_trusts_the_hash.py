"""Mutant (exercise 6): _lookup takes a hash match as proof: it never checks the entry's tokens or its parent,
so a hash collision (or a hash that forgets the parent) hands out a block holding other tokens."""
from minibatch.kv.block_allocator import BlockAllocator as Reference, hash_block_tokens


class BlockAllocator(Reference):
    def _lookup(self, tokens):
        bs, found, parent_hash = self.block_size, [], None
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash_block_tokens(parent_hash, chunk)
            e = self._entries.get(self._cache.get(h))
            if e is None:                               # BUG: e.tokens and e.parent_serial not checked
                break
            found.append((self._cache[h], h, e.serial))
            parent_hash = h
        return found
