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

The methods (``speculative_config={"method": ..., "num_speculative_tokens": k}``, checked by ``config.py``;
the engine builds the one asked for, ``engine/proposers.py``):
* ``"ngram"``: prompt lookup (``ngram.py``), no model at all.
* ``"draft"``: a small distilled model (``draft_model.py``) with its own paged cache.
* ``"medusa"``: heads on the target's last hidden state (``medusa.py``), no extra model pass.
* ``"early_exit"``: the target's own first E layers + an adapter (``early_exit.py``), in the target's cache; its
  verify starts at layer E for the rows it drafted (``verify_start``, LayerSkip's KV reuse; ``"kv_reuse": False``
  recomputes them).
* ``"eagle"``: one block drafting in feature space (``eagle.py``), its K/V one more layer of the target's cache.
* ``"eagle3"``: EAGLE's drafting from three fused target states, trained by a training-time test (``eagle3.py``).

The methods that add a trained module to the target load it from ``minibatch/model/checkpoints/``
(``<method>.safetensors`` for the GPT target, ``<model>_<method>.safetensors`` for another model:
``weights.head_preset``; checksum verified), or from the directory ``speculative_config["model"]``.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional

from minibatch.sampling.sampler import make_generator


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
        self.generators: dict = {}   # seq id -> the proposer's own sampling generator (``_generator``)

    @abc.abstractmethod
    def propose(self, seqs: list, runner_output, scheduler_output) -> None:
        """Set ``spec_token_ids`` (and ``spec_probs``) on each of ``seqs``: running, in decode."""

    def free(self, seq) -> None:
        """Forget a sequence that finished or was preempted (its drafts are no longer wanted). A subclass that
        keeps more per sequence forgets it too, and calls this."""
        self.generators.pop(seq.seq_id, None)

    def _generator(self, seq):
        """A seeded request drafts from its own seeded generator, so its output is reproducible in any batch;
        None for an unseeded one (it draws from the global generator)."""
        if seq.params.seed is not None and seq.seq_id not in self.generators:
            self.generators[seq.seq_id] = make_generator(seq.params.seed + 7919 * (seq.index + 1))
        return self.generators.get(seq.seq_id)

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
