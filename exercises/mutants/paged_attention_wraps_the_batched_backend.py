"""Mutant (exercise 2), a wrapper: hands the step to the engine's other backend, ``paged_attention_batched`` (the
same signature). Right wherever that backend is the reference; a student release computes it through exercise 2
itself, so it must fail there."""
from minibatch.kv.backends import paged_attention_batched


def paged_attention_torch(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
    return paged_attention_batched(query, key_cache, value_cache, block_tables, seq_lens,   # BUG: the engine's
                                   query_start_loc, scale)
