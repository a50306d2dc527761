"""A token tree step as plain data (no matplotlib): what ``viz.tree`` draws and the text view prints.

``step_tree(traces, step, seq_id)`` reads one sequence's verified tree from a trace (``SeqStep.draft_parents``,
``draft_token_ids``, ``accepted_path``, ``root_token_id``, ``new_token_ids``) and checks it is a tree with a
root-to-node accepted path; ``tree_rows`` lays the nodes out (the drafter's first-ranked branch on row 0);
``tree_trace`` makes a one-step trace from a hand-written parent list, to draw a tree without an engine.
"""
from __future__ import annotations

from minibatch.kv.tree import chain_parents, check_parents, children, depths
from minibatch.trace import SeqStep, StepTrace
from minibatch.viz.common import TraceError, as_traces, find_step

TREE_LABELS = {"eagle": "EAGLE-2 dynamic tree", "medusa": "Medusa static tree"}


def token_label(tok) -> str:
    """A byte token, readable: ``repr`` of its char for ASCII (' ', '\\n', 'a'), ``'\\xe2'`` past it
    (a lone byte of a multi-byte UTF-8 character is no character), '?' when unknown."""
    if tok is None:
        return "?"
    tok = int(tok)
    return repr(chr(tok)) if tok < 128 else f"'\\x{tok:02x}'"


def tree_label(method, chain: bool = False) -> str:
    """'EAGLE-2 dynamic tree', 'Medusa static tree', ... from the trace's speculative method."""
    if chain:
        return "a chain" + (f" ({method})" if method else "")
    return TREE_LABELS.get(method, f"token tree ({method})" if method else "token tree")


def tree_steps(traces) -> list:
    """The step numbers in which some sequence verified a token tree (``draft_parents`` recorded)."""
    return [t.step for t in as_traces(traces) if any(s.draft_parents for s in t.scheduled)]


def _pick(traces, t, seq_id) -> SeqStep:
    if seq_id is not None:
        s = next((s for s in t.scheduled if s.seq_id == seq_id), None)
        if s is None:
            raise TraceError(f"{seq_id!r} was not scheduled in step {t.step} "
                             f"(scheduled: {', '.join(x.seq_id for x in t.scheduled) or 'nobody'})")
        if not (s.proposed or s.draft_parents):
            raise TraceError(f"{seq_id!r} verified no drafts in step {t.step} (a {s.phase} step): no token tree")
        return s
    drafted = [s for s in t.scheduled if s.proposed or s.draft_parents]
    if not drafted:
        with_tree = tree_steps(traces)
        hint = (f"; steps with a token tree: {', '.join(map(str, with_tree[:8]))}" + (", ..." if len(with_tree) > 8
                                                                                      else "")
                if with_tree else "; this run verified no token tree (speculative_config needs a 'tree')")
        raise TraceError(f"step {t.step} verified no drafts, so it has no token tree to draw{hint}")
    return next((s for s in drafted if s.draft_parents), drafted[0])


def _root_from_history(traces, t, seq_id):
    """A trace recorded before SeqStep.root_token_id: the root is the last token the sequence got earlier."""
    for u in reversed(traces[:traces.index(t)]):
        s = next((s for s in u.scheduled if s.seq_id == seq_id and s.new_token_ids), None)
        if s is not None:
            return s.new_token_ids[-1]
    return None


def step_tree(traces, step: int, seq_id=None) -> dict:
    """One sequence's token tree in ``step`` (``seq_id`` None: the first in batch order that verified a tree,
    else a chain), as plain data:

        seq_id, step, method, kind ('EAGLE-2 dynamic tree', ...), chain (a chain drawn as a tree),
        parents [N+1], tokens [N+1] (tokens[0] the root's, None if unknown), labels, depths, positions
        (context_len + depth), context_len, children, accepted (the path [0, c1, ..., ca]),
        states ('root' | 'accepted' | 'rejected' per node), target_token / target_label / target_kind
        ('bonus' or 'correction', the token the target put after the path; None if not recorded),
        first_branch_accepted (drafts the drafter's first-ranked branch alone would have kept).
    Raises TraceError when the step verified no drafts for it."""
    traces = as_traces(traces)
    t = find_step(traces, step)
    s = _pick(traces, t, seq_id)
    chain = not s.draft_parents
    try:
        parents = chain_parents(s.proposed) if chain else check_parents(list(s.draft_parents))
    except ValueError as e:
        raise TraceError(f"step {t.step}, {s.seq_id}: the recorded tree is not one: {e}") from None
    path = list(range(s.accepted + 1)) if chain else list(s.accepted_path or [0])
    drafts = list(s.draft_token_ids) or [None] * (len(parents) - 1)     # (traces before drafts were recorded)
    if len(parents) != len(drafts) + 1:
        raise TraceError(f"step {t.step}, {s.seq_id}: {len(s.draft_token_ids)} draft tokens for a tree of "
                         f"{len(parents) - 1} drafts")
    if path[0] != 0 or any(parents[b] != a for a, b in zip(path, path[1:])):
        raise TraceError(f"step {t.step}, {s.seq_id}: the accepted path {path} is not a root-to-node path "
                         f"of the tree {parents}")
    root = s.root_token_id if s.root_token_id is not None else _root_from_history(traces, t, s.seq_id)
    tokens = [root] + drafts
    kids = children(parents)
    first = 0
    while first + 1 < len(path) and kids[path[first]][0] == path[first + 1]:
        first += 1
    on_path = set(path)
    target = s.new_token_ids[len(path) - 1] if len(s.new_token_ids) >= len(path) else None
    d = depths(parents)
    return {"seq_id": s.seq_id, "step": t.step, "method": t.speculative_method,
            "kind": tree_label(t.speculative_method, chain), "chain": chain, "parents": parents, "tokens": tokens,
            "labels": [token_label(x) for x in tokens], "depths": d, "context_len": s.num_computed_before,
            "positions": [s.num_computed_before + x for x in d], "children": kids, "accepted": path,
            "states": ["root"] + ["accepted" if i in on_path else "rejected" for i in range(1, len(parents))],
            "target_token": target, "target_label": token_label(target) if target is not None else None,
            "target_kind": "bonus" if s.bonus else "correction", "first_branch_accepted": first}


def tree_rows(parents, extra_child_of=None) -> list:
    """Row of each node (and, with ``extra_child_of``, of one more node, listed last: the target's token,
    a last child of that node): leaves take rows top to bottom depth first, children in node order (the
    drafter's ranking), and a parent sits on its first child's row, so the first-ranked branch is row 0."""
    kids = children(parents)
    n = len(parents)
    if extra_child_of is not None:
        kids = [list(k) for k in kids] + [[]]
        kids[extra_child_of].append(n)
    row, stack, nxt = [None] * len(kids), [(0, False)], 0
    while stack:                       # depth first, iteratively (a tree is up to 64 nodes deep)
        i, done = stack.pop()
        if not kids[i]:
            row[i], nxt = nxt, nxt + 1
        elif done:
            row[i] = row[kids[i][0]]
        else:
            stack.append((i, True))
            stack += [(c, False) for c in reversed(kids[i])]
    return row


def tree_trace(parents, draft_tokens, accepted_path, next_token=None, root_token=None, context_len: int = 0,
               seq_id: str = "s0", method=None, step: int = 0) -> StepTrace:
    """A one-step trace holding one sequence's verified tree, from a hand-written parent list: what
    ``draw_tree`` / ``draw_tree_mask`` / ``text_view`` read, without an engine. Tokens are byte ids (or
    one-character strings); ``next_token`` is the target's token after the path."""
    as_id = lambda x: ord(x) if isinstance(x, str) else x                                   # noqa: E731
    parents = check_parents(list(parents))
    drafts = [as_id(x) for x in draft_tokens]
    path = list(accepted_path)
    new = [drafts[i - 1] for i in path[1:]] + ([as_id(next_token)] if next_token is not None else [])
    leaf = path[-1] not in parents
    s = SeqStep(seq_id, seq_id, "decode", len(parents), context_len, context_len, len(new), proposed=len(drafts),
                accepted=len(path) - 1, bonus=int(leaf), new_token_ids=new, draft_token_ids=drafts,
                draft_parents=parents, accepted_path=path,
                root_token_id=as_id(root_token) if root_token is not None else None)
    return StepTrace(step=step, time=0.0, duration=0.0, scheduling="continuous", scheduled=[s], admitted=[],
                     preempted=[], finished=[], waiting=[], running=[seq_id], block_tables={seq_id: [0]},
                     num_blocks=1, block_size=max(context_len + 1, 1), ref_counts=[1], cached_blocks=[],
                     num_free_blocks=0, num_batched_tokens=len(parents), token_budget=len(parents), max_num_seqs=1,
                     speculative_method=method)
