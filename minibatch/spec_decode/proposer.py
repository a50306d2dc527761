"""Proposers for speculative decoding: who guesses the next k tokens, and when.

Every method answers one question, for every running sequence in decode: "what
are the next up to k tokens?" The target model then checks all of them in one
forward, the next step's verify (the model runner and the rejection sampler), so
a cheap good guess turns one target forward into several tokens.

When: ``propose`` runs *after* a step's results are applied (vLLM V1's order), with
that step's ``ModelRunnerOutput`` in hand, and writes the drafts onto each
sequence (``seq.spec_token_ids`` and, when the proposer has a distribution,
``seq.spec_probs``) for the scheduler to take into the next step. A proposer
that reads the target's hidden states (Medusa's heads, EAGLE's feature) names
them in ``hidden_states`` and finds them in the runner output, so proposing
costs it no extra target pass.

The methods (``speculative_config={"method": ..., "num_speculative_tokens": k}``):
* ``"ngram"``: prompt lookup (``ngram.py``), no model at all.
* ``"draft"``: a small distilled model (``draft_model.py``) with its own paged cache.
"""
from __future__ import annotations

import abc

METHODS = ("draft", "ngram")
MAX_SPECULATIVE_TOKENS = 16
KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}


class Proposer(abc.ABC):
    method: str = ""
    hidden_states: tuple = ()        # which of the target's hidden states it reads (GPT.forward's numbering)

    def __init__(self, k: int):
        self.k = k

    @abc.abstractmethod
    def propose(self, seqs: list, runner_output, scheduler_output) -> None:
        """Set ``spec_token_ids`` (and ``spec_probs``) on each of ``seqs``: running, in decode."""

    def free(self, seq) -> None:
        """Forget a sequence that finished or was preempted (its drafts are no longer wanted)."""


def proposal_budget(seq, k: int) -> int:
    """Proposal length for this step: never past max_tokens (the +1 is the bonus token)."""
    return max(0, min(k, seq.params.max_tokens - seq.num_output_tokens - 1))


def check_speculative_config(spec_config) -> None:
    """Validate ``speculative_config`` (vLLM's keys) once, when the engine's config is made."""
    if not isinstance(spec_config, dict):
        raise TypeError(f"speculative_config must be a dict, got {type(spec_config).__name__}")
    unknown = set(spec_config) - KEYS
    if unknown:
        raise ValueError(f"unknown speculative_config keys {sorted(unknown)}; known: {sorted(KEYS)}")
    method = spec_config.get("method")
    if method not in METHODS:
        raise ValueError(f"unknown speculative method {method!r}; choose one of {list(METHODS)}")
    k = spec_config.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
    if method == "ngram":
        from minibatch.spec_decode.ngram import check_ngram_sizes
        check_ngram_sizes(spec_config.get("prompt_lookup_min", 1), spec_config.get("prompt_lookup_max", 3))


def make_proposer(spec_config, target, draft, engine_config):
    """The proposer ``speculative_config`` asks for (checked already by EngineConfig), or None."""
    if spec_config is None:
        return None
    method, k = spec_config["method"], spec_config["num_speculative_tokens"]
    if method == "ngram":
        from minibatch.spec_decode.ngram import NgramProposer
        return NgramProposer(k, spec_config.get("prompt_lookup_max", 3), spec_config.get("prompt_lookup_min", 1))
    from minibatch.spec_decode.draft_model import DraftModelProposer
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
