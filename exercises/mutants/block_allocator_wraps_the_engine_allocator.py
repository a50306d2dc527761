"""Mutant (exercise 6), a wrapper: a subclass of the engine's own ``BlockAllocator`` that adds nothing. Right
wherever that class is the reference; in a student release it is a stand-in built over exercise 6 itself, so it
must fail there."""
from minibatch.kv.block_allocator import BlockAllocator as _EngineAllocator


class BlockAllocator(_EngineAllocator):      # BUG: the engine's allocator
    pass
