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
* ``"medusa"``: heads on the target's last hidden state (``medusa.py``), no extra model pass.
* ``"early_exit"``: the target's own first E layers + an adapter (``early_exit.py``), in the target's cache; its
  verify starts at layer E for the rows it drafted (``verify_start``, LayerSkip's KV reuse; ``"kv_reuse": False``
  recomputes them).
* ``"eagle"``: one block drafting in feature space (``eagle.py``), its K/V one more layer of the target's cache.

The methods that add a trained module to the target load it from ``minibatch/model/checkpoints/``
(``<method>.safetensors``, checksum verified), or from the directory ``speculative_config["model"]``.
"""
from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Optional

METHODS = ("draft", "ngram", "medusa", "early_exit", "eagle")
HEAD_METHODS = ("medusa", "early_exit", "eagle")            # a trained head on the frozen target (minibatch/model/heads.py)
MAX_SPECULATIVE_TOKENS = 16
KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
        "acceptance", "posterior_threshold", "posterior_alpha",      # these three: typical.py (lossy, opt-in)
        "tree", "num_draft_tokens", "depth", "topk",                 # token trees (tree.py)
        "kv_reuse"}                                                  # early exit: LayerSkip's KV reuse (early_exit.py)
TREE_KINDS = {"medusa": "static", "eagle": "dynamic"}    # who makes which tree ("static" also: a list of choices)
TREE_DEFAULTS = {"num_draft_tokens": 16, "depth": 5, "topk": 4}      # EAGLE-2's dynamic tree, sized for a CPU


@dataclass
class MidStackStart:
    """A verify that starts mid-stack for some rows (LayerSkip's KV reuse, ``early_exit.py``), as a proposer
    hands it to the model runner: the first ``num_rows[b]`` rows of scheduled sequence b have been through
    blocks 0 .. layer-1 already, their K/V at those layers lie in the sequence's own slots (the step's slot
    mapping), and ``hidden`` is their residual stream entering block ``layer``."""
    layer: int
    num_rows: list                   # [B] per scheduled sequence, batch order; 0: all its rows run every block
    hidden: object                   # torch.Tensor [R, C], R = sum(num_rows), batch order, each sequence's rows in order


class Proposer(abc.ABC):
    method: str = ""
    hidden_states: tuple = ()        # which of the target's hidden states it reads (GPT.forward's numbering)
    sequential_passes = "k"          # draft passes one after the other per step ("k", or a number)
    all_hidden = False               # True: hidden_states at every token of the step, not only the logits rows
    tree_nodes = 0                   # a tree proposer: the most draft nodes it proposes (0: a chain)
    num_lookahead_slots = 0          # a tree proposer: slots a verify may write past a sequence's last token and
                                     # then drop (all N nodes, conservatively; a chain needs none beyond max_tokens)

    def __init__(self, k: int):
        self.k = k

    @abc.abstractmethod
    def propose(self, seqs: list, runner_output, scheduler_output) -> None:
        """Set ``spec_token_ids`` (and ``spec_probs``) on each of ``seqs``: running, in decode."""

    def free(self, seq) -> None:
        """Forget a sequence that finished or was preempted (its drafts are no longer wanted)."""

    # A proposer that drafts inside the target's KV cache (early exit, EAGLE) asks the engine for room there:
    extra_kv_layers = 0              # cache layers of its own, after the target's (EAGLE's head)

    def num_scratch_blocks(self, max_num_seqs: int, block_size: int) -> int:
        """Blocks past the allocator's pool for the K/V of positions it drafts (``scratch.py``)."""
        return 0

    def bind(self, allocator, kv_cache, first_scratch_block: int, num_scratch_blocks: int) -> None:
        """Called once by the engine: the target's allocator (to read block tables) and its cache."""

    def verify_start(self, scheduled: list, slot_mapping, query_start_loc: list) -> Optional[MidStackStart]:
        """Called by the model runner before a forward that verifies drafts, after the step's copy-on-write,
        with the step's ``ScheduledSeq`` list, its slot mapping [T] and its query_start_loc [B+1] (a list).
        A proposer whose drafting computed some of the verified rows' first layers exactly as the target
        would (early exit) may write their K/V into those rows' slots and return where the verify may start
        for them; the default, None, runs every row through every block."""
        return None


def proposal_budget(seq, k: int) -> int:
    """Proposal length for this step: never past max_tokens (the +1 is the bonus token)."""
    return max(0, min(k, seq.params.max_tokens - seq.num_output_tokens - 1))


def hidden_rows(seqs, runner_output, scheduler_output) -> dict:
    """seq id -> the row of the runner's hidden states that produced the sequence's newest token.

    After a verify step that accepted a drafts it is ``logits_rows[b][a]``; after a decode or the last
    prefill chunk, ``logits_rows[b][0]``. A child of n > 1 forked this step was not scheduled itself: it
    shares its parent's prompt, so it reads the parent's (prefill) row. A sequence with no row this step
    (not scheduled: the token budget ran out) is left out, and keeps the drafts it has."""
    where = {s.seq.seq_id: b for b, s in enumerate(scheduler_output.scheduled)}
    rows = {}
    for seq in seqs:
        b = where.get(seq.seq_id)
        if b is not None and runner_output.logits_rows[b]:
            rows[seq.seq_id] = runner_output.logits_rows[b][runner_output.num_accepted[b]]
        elif b is None and seq.index > 0 and seq.num_output_tokens == 1:     # a fresh fork
            pb = where.get(seq.request.seqs[0].seq_id)
            if pb is not None and runner_output.logits_rows[pb]:
                rows[seq.seq_id] = runner_output.logits_rows[pb][0]
    return rows


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
        from minibatch.spec_decode.ngram import check_ngram_sizes
        check_ngram_sizes(spec_config.get("prompt_lookup_min", 1), spec_config.get("prompt_lookup_max", 3))
    if "kv_reuse" in spec_config and (method != "early_exit" or not isinstance(spec_config["kv_reuse"], bool)):
        raise ValueError(f"speculative_config['kv_reuse'] is True or False, for method 'early_exit' (whether its "
                         f"verify reuses the drafter's first layers); got {spec_config['kv_reuse']!r} for {method!r}")
    from minibatch.spec_decode.typical import check_typical_config
    check_typical_config(spec_config)


def _int_in(spec_config, key, lo, hi):
    v = spec_config.get(key, TREE_DEFAULTS[key])
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"speculative_config[{key!r}] must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def check_tree_config(spec_config) -> None:
    """A tree only where the method can make one, with sane sizes; a chain (no "tree") is the default."""
    from minibatch.spec_decode import tree
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
    from minibatch.spec_decode import tree
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


def tree_settings(spec_config) -> Optional[dict]:
    """The tree a checked speculative_config asks for: None (a chain), {"choices": [...]} (Medusa's static
    tree, shipped or given) or {"num_draft_tokens", "depth", "topk"} (EAGLE-2's dynamic tree)."""
    kind = spec_config.get("tree")
    if kind is None:
        return None
    if isinstance(kind, (list, tuple)):
        return {"choices": [tuple(c) for c in kind]}
    if kind == "static":
        from minibatch.spec_decode.medusa_tree import load_tree
        return {"choices": load_tree(spec_config.get("num_draft_tokens"))}
    return dynamic_tree_sizes(spec_config)


def make_proposer(spec_config, target, draft, engine_config):
    """The proposer ``speculative_config`` asks for (checked already by EngineConfig), or None."""
    if spec_config is None:
        return None
    method, k = spec_config["method"], spec_config.get("num_speculative_tokens")
    tree_cfg = tree_settings(spec_config)
    if method == "ngram":
        from minibatch.spec_decode.ngram import NgramProposer
        return NgramProposer(k, spec_config.get("prompt_lookup_max", 3), spec_config.get("prompt_lookup_min", 1))
    if method in HEAD_METHODS:
        from minibatch.model.heads import load_head
        head = load_head(method, target, directory=spec_config.get("model"))
        if method == "medusa":
            from minibatch.spec_decode.medusa import MedusaProposer
            return MedusaProposer(head, k, tree=None if tree_cfg is None else tree_cfg["choices"])
        if method == "eagle":
            from minibatch.spec_decode.eagle import EagleProposer
            if tree_cfg is None:
                return EagleProposer(target, head, k, engine_config)
            return EagleProposer(target, head, tree_cfg["depth"], engine_config, tree=tree_cfg)
        from minibatch.spec_decode.early_exit import EarlyExitProposer
        return EarlyExitProposer(target, head, k, engine_config, kv_reuse=spec_config.get("kv_reuse", True))
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
