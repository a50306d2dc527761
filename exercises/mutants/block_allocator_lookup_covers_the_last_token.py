"""Mutant (exercise 6): _lookup matches every full block of the prompt, the one holding its last token
included: a prompt of whole blocks then has nothing left to compute, and the engine has no logits to sample
its first token from."""
from minibatch.kv.block_allocator import BlockAllocator as Reference, hash_block_tokens


class BlockAllocator(Reference):
    def _lookup(self, tokens):
        bs, found, parent_hash, parent_serial = self.block_size, [], None, None
        for i in range(len(tokens) // bs):              # BUG: not (len(tokens) - 1) // bs
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash_block_tokens(parent_hash, chunk)
            e = self._entries.get(self._cache.get(h))
            if e is None or e.tokens != chunk or e.parent_serial != parent_serial:
                break
            found.append((self._cache[h], h, e.serial))
            parent_hash, parent_serial = h, e.serial
        return found
