"""Structured outputs inside the engine: a mask per sampled row, and a matcher per sequence that follows its tokens.

A sequence with ``SamplingParams.structured_outputs`` holds a matcher (``Sequence.grammar``: teaching.py's
``TeachingMatcher`` or backend.py's ``LLGuidanceMatcher``, one interface: ``allowed()`` [256] bool,
``is_accepting()``, ``accept(token)``, ``rollback(n)``). Its state is always "after this sequence's output
tokens": the scheduler calls ``advance`` where it appends accepted tokens (``_append``), and nothing else moves
it, so preemption (which keeps ``token_ids``) keeps the state too, and a forked child starts its own.

One step, in the model runner, just before sampling (``apply_grammar_bitmask``):
- a sequence mid-prefill has no logits row: nothing to mask (chunked prefill);
- a plain row is masked with the matcher's current ``allowed()``;
- a verify step has rows 0..k (or the nodes of a token tree): row j's mask is the matcher's state after the
  drafts on the path to node j (``row_masks``: accept them, read the mask, roll back). A draft outside the
  grammar has target probability 0 under its parent row's mask, so the rejection sampler always rejects it
  (it accepts when u * q(x) < p(x), false for p(x) = 0; greedy: it is never the argmax), and the rows under it
  are never read. Masking the target before the rejection sampler keeps speculation lossless: the sampler
  reproduces whatever distribution the target rows hold (Leviathan et al. 2023, Thm. 1), here the masked one.

A row whose mask is empty (the grammar has ended there) is left whole: whatever is drawn there is dropped by
``advance``, which stops at the end of the grammar with finish_reason "stop" (accepting) or "dead_end" (no byte
allowed short of an accepting state: the libraries prune such states, so this is the guard that a matcher which
gets there finishes its request instead of sampling from an empty mask for ever).
"""
from __future__ import annotations

from typing import Optional

import torch

DEAD_END = "dead_end"                        # the finish_reason of a constraint that left no byte allowed


def advance(matcher, tokens: list) -> tuple[list, Optional[str]]:
    """Feed accepted tokens to the matcher -> (the tokens the grammar takes, the finish reason or None).
    Tokens after the grammar has ended are dropped."""
    kept = []
    for t in tokens:
        if not matcher.accept(t):
            return kept, "stop" if matcher.is_accepting() else DEAD_END
        kept.append(t)
    if not matcher.allowed().any():          # nothing may follow: finish now, never sample an empty row
        return kept, "stop" if matcher.is_accepting() else DEAD_END
    return kept, None


def row_masks(matcher, drafts: list, parents: Optional[list] = None) -> torch.Tensor:
    """[1 + k, 256] bool: row j is the mask after the drafts on the path root -> node j (a chain when parents
    is None: [-1, 0, ..., k-1]). Rows under a draft the grammar refuses, and rows where it has ended, stay
    all True (never used, and never an all -inf row). The matcher ends where it began."""
    k = len(drafts)
    parents = list(range(-1, k)) if parents is None else parents
    children = [[] for _ in range(k + 1)]
    for j in range(1, k + 1):
        children[parents[j]].append(j)
    masks = torch.ones(k + 1, 256, dtype=torch.bool)

    def visit(j: int) -> None:                # depth first: accept the child's draft, visit, roll back
        m = matcher.allowed()
        if m.any():
            masks[j] = m
        for c in children[j]:
            if matcher.accept(drafts[c - 1]):
                visit(c)
                matcher.rollback(1)
    visit(0)
    return masks


def apply_grammar_bitmask(logits: torch.Tensor, scheduled: list, rows: list) -> torch.Tensor:
    """logits [N, V] at the step's sampled rows -> the same with every byte a sequence's grammar refuses at -inf.
    scheduled: the ScheduledSeqs; rows[b]: sequence b's rows of the N ([] mid-prefill)."""
    todo = [b for b, s in enumerate(scheduled) if rows[b] and s.seq.grammar is not None]
    if not todo:
        return logits
    allowed = torch.ones(logits.shape, dtype=torch.bool)                      # [N, V]
    for b in todo:
        s = scheduled[b]
        allowed[rows[b]] = row_masks(s.seq.grammar, s.spec_token_ids, s.spec_parents)
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
