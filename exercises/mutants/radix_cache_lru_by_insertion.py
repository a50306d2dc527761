"""Mutant (exercise 12): a match does not count as an access (only inserts stamp the path): eviction is LRU by
insertion, and a prefix every request uses is evicted as if nobody had."""
from minibatch.kv.radix_cache import RadixCache as Reference


class RadixCache(Reference):
    def match_prefix(self, key):
        key = self._page_aligned(key)
        node, blocks = self.root_node, []
        while key and self._child_key(key) in node.children:       # BUG: no tick, no stamp
            child = node.children[self._child_key(key)]
            n = self._key_match(child.key, key)
            if n < len(child.key):
                child = self._split_node(child, n)
            blocks += child.value
            node, key = child, key[n:]
        return blocks, node
