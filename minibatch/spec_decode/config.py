"""``speculative_config``: vLLM's keys, checked once when the engine's config is made, and the token tree it
asks for. Which proposer class a method builds is the engine's choice (``engine/proposers.py``), so this room
never imports upward: the proposers take what they need as arguments.
"""
from __future__ import annotations

import os
from typing import Optional

from minibatch.kv import tree
from minibatch.spec_decode.medusa_tree import load_tree
from minibatch.spec_decode.ngram import check_ngram_sizes
from minibatch.spec_decode.typical import check_typical_config

METHODS = ("draft", "ngram", "medusa", "early_exit", "eagle", "eagle3")
HEAD_METHODS = ("medusa", "early_exit", "eagle", "eagle3")          # a trained head on the frozen target (minibatch/model/heads.py)
MAX_SPECULATIVE_TOKENS = 16
KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
        "acceptance", "posterior_threshold", "posterior_alpha",      # these three: typical.py (lossy, opt-in)
        "tree", "num_draft_tokens", "depth", "topk",                 # token trees (tree.py)
        "kv_reuse"}                                                  # early exit: LayerSkip's KV reuse (early_exit.py)
TREE_KINDS = {"medusa": "static", "eagle": "dynamic", "eagle3": "dynamic"}    # who makes which tree ("static" also: a list of choices)
TREE_DEFAULTS = {"num_draft_tokens": 16, "depth": 5, "topk": 4}      # EAGLE-2's dynamic tree, sized for a CPU


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
    if k is None and spec_config.get("tree") is not None:
        pass                                # a tree's depth says how far it drafts
    elif not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
    check_tree_config(spec_config)
    model = spec_config.get("model")
    if model is not None and (method not in HEAD_METHODS or not isinstance(model, (str, os.PathLike))):
        raise ValueError(f"speculative_config['model'] is a checkpoint directory for {list(HEAD_METHODS)}; got "
                         f"{model!r} for method {method!r}")
    if method == "ngram":
        check_ngram_sizes(spec_config.get("prompt_lookup_min", 1), spec_config.get("prompt_lookup_max", 3))
    if "kv_reuse" in spec_config and (method != "early_exit" or not isinstance(spec_config["kv_reuse"], bool)):
        raise ValueError(f"speculative_config['kv_reuse'] is True or False, for method 'early_exit' (whether its "
                         f"verify reuses the drafter's first layers); got {spec_config['kv_reuse']!r} for {method!r}")
    check_typical_config(spec_config)


def _int_in(spec_config, key, lo, hi):
    v = spec_config.get(key, TREE_DEFAULTS[key])
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"speculative_config[{key!r}] must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def check_tree_config(spec_config) -> None:
    """A tree only where the method can make one, with sane sizes; a chain (no "tree") is the default."""
    method, kind = spec_config["method"], spec_config.get("tree")
    if kind is None:
        extra = {"num_draft_tokens", "depth", "topk"} & set(spec_config)
        if extra:
            raise ValueError(f"speculative_config keys {sorted(extra)} size a token tree; add \"tree\" "
                             f"({TREE_KINDS}) or leave them out")
        return
    if method not in TREE_KINDS:
        raise ValueError(f"method {method!r} drafts a chain and cannot make a token tree; trees: "
                         + ", ".join(f"{m} ({t!r})" for m, t in TREE_KINDS.items()))
    if spec_config.get("acceptance", "rejection") != "rejection":
        raise ValueError("typical acceptance is for chains only; a tree is verified by the lossless tree rule")
    if isinstance(kind, (list, tuple)):
        if method != "medusa":
            raise ValueError("a tree of your own choices (a list) is for method 'medusa' (its heads' ranks)")
        tree.from_choices(kind)             # raises on a malformed one
        if {"depth", "topk"} & set(spec_config):
            raise ValueError("'depth' and 'topk' size EAGLE-2's dynamic tree; a list of choices is the tree itself")
        return
    if kind != TREE_KINDS[method]:
        raise ValueError(f"speculative_config['tree'] for {method!r} is {TREE_KINDS[method]!r} (or, for medusa, "
                         f"a list of choices); got {kind!r}")
    max_nodes = tree.MAX_TREE_NODES - 1
    if kind == "static":
        if {"depth", "topk"} & set(spec_config):
            raise ValueError("'depth' and 'topk' size EAGLE-2's dynamic tree; Medusa's static tree is shipped "
                             "(choose its size with 'num_draft_tokens')")
        if "num_draft_tokens" in spec_config:
            _int_in(spec_config, "num_draft_tokens", 1, max_nodes)
        return
    dynamic_tree_sizes(spec_config)


def dynamic_tree_sizes(spec_config) -> dict:
    """EAGLE-2's tree sizes, checked, defaults filled in: {"num_draft_tokens", "depth", "topk"}. depth is
    num_speculative_tokens when that is given (the tree drafts that deep), else "depth", else the default."""
    k = spec_config.get("num_speculative_tokens")
    n = _int_in(spec_config, "num_draft_tokens", 1, tree.MAX_TREE_NODES - 1)
    depth = _int_in(spec_config, "depth", 1, MAX_SPECULATIVE_TOKENS) if "depth" in spec_config or k is None else k
    if k is not None and k != depth:
        raise ValueError(f"num_speculative_tokens ({k}) and depth ({depth}) disagree: a tree drafts depth tokens "
                         f"deep (give one of them)")
    if not 1 <= depth <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"a dynamic tree's depth must be in [1, {MAX_SPECULATIVE_TOKENS}], got {depth}")
    topk = _int_in(spec_config, "topk", 1, 16)
    grown = topk + (depth - 1) * topk * topk            # the nodes EAGLE-2 grows before it re-ranks
    if n > grown:
        raise ValueError(f"num_draft_tokens={n} but a tree of depth {depth} and topk {topk} grows only {grown} "
                         f"nodes to choose from")
    return {"num_draft_tokens": n, "depth": depth, "topk": topk}


def tree_settings(spec_config, model: str = "target") -> Optional[dict]:
    """The tree a checked speculative_config asks for: None (a chain), {"choices": [...]} (Medusa's static
    tree, given, or shipped for ``model``'s heads) or {"num_draft_tokens", "depth", "topk"} (EAGLE-2's)."""
    kind = spec_config.get("tree")
    if kind is None:
        return None
    if isinstance(kind, (list, tuple)):
        return {"choices": [tuple(c) for c in kind]}
    if kind == "static":
        return {"choices": load_tree(spec_config.get("num_draft_tokens"), model)}
    return dynamic_tree_sizes(spec_config)
