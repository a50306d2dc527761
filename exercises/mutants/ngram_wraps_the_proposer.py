"""Mutant (exercise 5), a wrapper: asks the engine's n-gram proposer (``NgramProposer``) for the drafts. Right
wherever the proposer runs the reference; a student release proposes through exercise 5 itself, so it must fail
there."""
import types

from minibatch.spec_decode.ngram import NgramProposer


def ngram_propose(token_ids, k, n_max=3, n_min=1):
    seq = types.SimpleNamespace(token_ids=list(token_ids), params=types.SimpleNamespace(max_tokens=k + 1),
                                num_output_tokens=0, spec_token_ids=None)
    NgramProposer(k, n_max, n_min).propose([seq])                 # BUG: the engine's proposer
    return list(seq.spec_token_ids)
