"""Mutant (exercise 12), a wrapper: a subclass of the engine's own ``RadixCache`` that adds nothing. Right wherever
that class is the reference; in a student release it is a stand-in built over exercise 12 itself, so it must fail
there."""
from minibatch.kv.radix_cache import RadixCache as _EngineTree


class RadixCache(_EngineTree):      # BUG: the engine's tree
    pass
