"""Which proposer a ``speculative_config`` builds: the registry, resolved where the engine is built.

vLLM's ``GPUModelRunner`` chooses its drafter the same way (``if method == "ngram": NgramProposer(...)``), so
the proposers below never import the engine or each other: each takes the target, its head and the engine's
config as arguments. The config was checked already (``spec_decode/config.py``, by ``EngineConfig``).
"""
from __future__ import annotations

from minibatch.model.heads import head_for
from minibatch.model.weights import HEADS_OF, load_model
from minibatch.spec_decode.config import HEAD_METHODS, tree_settings
from minibatch.spec_decode.draft_model import DraftModelProposer
from minibatch.spec_decode.eagle import EagleProposer
from minibatch.spec_decode.eagle3 import Eagle3Proposer
from minibatch.spec_decode.early_exit import EarlyExitProposer
from minibatch.spec_decode.medusa import MedusaProposer
from minibatch.spec_decode.ngram import NgramProposer


def make_proposer(spec_config, target, draft, engine_config):
    """The proposer ``speculative_config`` asks for (checked already by EngineConfig), or None."""
    if spec_config is None:
        return None
    method, k = spec_config["method"], spec_config.get("num_speculative_tokens")
    name = target.config.name
    tree_cfg = tree_settings(spec_config, name if name in HEADS_OF else "target")     # Medusa's: its heads' tree
    if method == "ngram":
        return NgramProposer(k, spec_config.get("prompt_lookup_max", 3), spec_config.get("prompt_lookup_min", 1))
    if method in HEAD_METHODS:
        head = head_for(method, target, directory=spec_config.get("model"))   # llama_medusa for the Llama
        if method == "medusa":
            return MedusaProposer(head, k, tree=None if tree_cfg is None else tree_cfg["choices"])
        if method in ("eagle", "eagle3"):
            cls = EagleProposer if method == "eagle" else Eagle3Proposer
            if tree_cfg is None:
                return cls(target, head, k, engine_config)
            return cls(target, head, tree_cfg["depth"], engine_config, tree=tree_cfg)
        return EarlyExitProposer(target, head, k, engine_config, kv_reuse=spec_config.get("kv_reuse", True))
    if draft is None:
        draft = load_model("draft", device=target.device, dtype=target.dtype)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size}) differs from the target's "
                         f"({target.config.vocab_size}): its tokens would mean something else")
    if draft.config.n_ctx < target.config.n_ctx:
        raise ValueError(f"the draft's context ({draft.config.n_ctx}) is shorter than the target's "
                         f"({target.config.n_ctx})")
    return DraftModelProposer(draft, k, engine_config)
