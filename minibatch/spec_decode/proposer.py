"""Proposers for speculative decoding: who guesses the next k tokens.

Both proposers answer one question per step, for every running sequence in
decode: "what are the next up to k tokens?" The target model then checks all
of them in one forward (``LLMEngine._verify``), so a cheap good guess turns one
target forward into several tokens.

* ``NgramProposer`` (prompt lookup decoding, Saxena 2023): copy what followed
  the last occurrence of the current n-gram in the sequence's own context.
  No model, no probabilities (q is one-hot).
* ``DraftModelProposer`` (Leviathan et al. 2023; Chen et al. 2023): run the
  small distilled ``draft`` model autoregressively for k steps. It has its own
  paged KV cache and its own block allocator (the draft's K/V are of a
  different shape, so they cannot live in the target's blocks). After
  verification its cache is rolled back to the tokens the target accepted.
"""
from __future__ import annotations


METHODS = ("draft", "ngram")
MAX_SPECULATIVE_TOKENS = 16

def proposal_budget(seq, k: int) -> int:
    """Proposal length for this step: never past max_tokens (the +1 is the bonus token)."""
    return max(0, min(k, seq.params.max_tokens - len(seq.output_ids) - 1))


def decode_ready(seq) -> bool:
    return seq.num_uncomputed == 1 and bool(seq.output_ids) and not seq.is_finished


def make_proposer(spec_config, target, draft, engine_config):
    """Validate ``speculative_config`` (vLLM's keys) and build the proposer, or None."""
    if spec_config is None:
        return None
    if not isinstance(spec_config, dict):
        raise TypeError(f"speculative_config must be a dict, got {type(spec_config).__name__}")
    unknown = set(spec_config) - {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
    if unknown:
        raise ValueError(f"unknown speculative_config keys {sorted(unknown)}")
    method = spec_config.get("method")
    if method not in METHODS:
        raise ValueError(f"unknown speculative method {method!r}; choose one of {list(METHODS)}")
    k = spec_config.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
    from minibatch.spec_decode.draft_model import DraftModelProposer
    from minibatch.spec_decode.ngram import NgramProposer
    if method == "ngram":
        return NgramProposer(k, spec_config.get("prompt_lookup_max", 3), spec_config.get("prompt_lookup_min", 1))
    if draft is None:
        from minibatch.model.weights import load_model
        draft = load_model("draft", device=target.device, dtype=target.dtype)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size}) differs from the target's "
                         f"({target.config.vocab_size}): its tokens would mean something else")
    if draft.config.n_ctx < target.config.n_ctx:
        raise ValueError(f"the draft's context ({draft.config.n_ctx}) is shorter than the target's "
                         f"({target.config.n_ctx})")
    return DraftModelProposer(draft, k, engine_config)
