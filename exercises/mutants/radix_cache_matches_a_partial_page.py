"""Mutant (exercise 12): a key that is not page-aligned also matches its partial last page, against a child whose
first page starts with those tokens: the request reuses a block whose KV holds tokens it does not have."""
from minibatch.kv.radix_cache import RadixCache as Reference


class RadixCache(Reference):
    def match_prefix(self, key):
        blocks, node = super().match_prefix(key)
        rest = tuple(key)[len(blocks) * self.page_size:]
        if 0 < len(rest) < self.page_size:                 # BUG: a partial page is matched too
            for first, child in node.children.items():
                if first[:len(rest)] == rest:
                    return blocks + child.value[:1], node
        return blocks, node
