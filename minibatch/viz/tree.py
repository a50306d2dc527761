"""Token trees drawn: what one verify step tried for a sequence, and the one path the target kept.

Tree speculation (``minibatch/kv/tree.py``: SpecInfer; Medusa §2.1.2; EAGLE-2) verifies a root
(the last accepted token) and N draft nodes with parent pointers in one target forward, and keeps the
longest accepted root-to-leaf path. The trace records it per sequence (``SeqStep.draft_parents``,
``draft_token_ids``, ``accepted_path``, ``root_token_id``, ``new_token_ids``); two views draw it:

    draw_tree(rec, step)        depth left to right (a node at depth d sits at position context + d, so
                                siblings share one); each node's children top to bottom in the order the
                                drafter ranked them, so the top row is the drafter's first-ranked branch
                                (what a chain would have proposed) and every row below is a second-best
                                guess a chain throws away:

                                    ' ' ── ' ' ── 'r' ── 'e' ── [bonus 't']
                                     │      └──── 'e'
                                     └──── '"' ── 's'

                                nodes are labelled by their byte (``repr`` of the char; ``'\\xe2'`` past
                                ASCII), the root wears its sequence's colour, the accepted path is filled
                                and joined by thick edges, rejected nodes are muted, and the target's own
                                token follows the path: the **bonus** token when the path reached a leaf,
                                else the **correction** (drawn as one more child of the path's last node).
    draw_tree_mask(rec, step)   the tree mask as a heat map over root + nodes: row = query node, column =
                                key node it attends to (its ancestors and itself, ``tree.ancestor_mask``;
                                every node also sees the whole cached context, not drawn). The accepted
                                path's cells are in the accepted colour: a plain causal triangle, which is
                                why copying the path to consecutive slots leaves an ordinary chain.

A chain's verify step (k drafts, no parents) draws as the tree ``[-1, 0, 1, ..., k-1]``; a step that
verified no drafts for the sequence has no tree (``TraceError``). The tree's kind comes from the trace's
method (``StepTrace.speculative_method``): EAGLE's dynamic trees and Medusa's static ones draw the same way.

``step_tree`` (``tree_data.py``, matplotlib-free like ``text``) is the data both views draw and the text view
prints; ``tree_trace`` makes a one-step trace from a hand-written parent list, to draw a tree without an engine.
"""
from __future__ import annotations

from minibatch.kv.tree import ancestor_mask
from minibatch.viz.common import (PHASE_COLORS, SPEC_REJECTED_COLOR, SPEC_TARGET_COLOR, as_traces,
                                  axes_size_pt, new_axes, style, styled, text_color_on, text_width_pt,
                                  wrap_title)
from minibatch.viz.tree_data import step_tree, tree_rows

TREE_SIZE = (9, 4.8)               # draw_tree at the default preset (inches)
MASK_SIZE = (6.4, 5.6)             # draw_tree_mask at the default preset
TREE_COLORS = {
    "accepted": PHASE_COLORS["decode"],     # a draft the target kept: the timeline's accepted sliver
    "rejected": SPEC_REJECTED_COLOR,        # ... and one it threw away: an empty sliver there, muted here
    "target": SPEC_TARGET_COLOR,            # the target's own token after the path (bonus or correction)
}
MUTED_TEXT = "#767676"             # a rejected node's label: 4.5:1 on white, readable but quiet
MUTED_EDGE = "#BBBBBB"             # an edge to a rejected node
MASK_COLORS = ["#FFFFFF", "#5A5A5A", PHASE_COLORS["decode"]]   # hidden; seen; seen, both on the accepted path


# -- the drawings -----------------------------------------------------------------------------------------------
def legend_handles() -> list:
    from matplotlib.patches import Patch
    return [Patch(facecolor=TREE_COLORS["accepted"], label="accepted draft"),
            Patch(facecolor=TREE_COLORS["rejected"], edgecolor=PHASE_COLORS["decode"], label="rejected draft"),
            Patch(facecolor=TREE_COLORS["target"], label="target's token")]


def _title(view, width_pt, size) -> str:
    """'token tree of r0, step 5 · EAGLE-2 dynamic tree, 16 drafts · accepted path 0→2→6: 2 drafts + bonus 'a'
    · the first-ranked branch alone: 0', broken into lines that fit ``width_pt``."""
    n, a = len(view["parents"]) - 1, len(view["accepted"]) - 1
    path = view["accepted"]
    arrows = "\u2192".join(map(str, path))
    if len(path) > 4 and text_width_pt(f"accepted path {arrows}", size) > width_pt:
        arrows = "\u2192".join(map(str, path[:2])) + "\u2192\u2026\u2192" + "\u2192".join(map(str, path[-2:]))
    kept = f"{a} draft{'s' * (a != 1)}"
    if view["target_label"] is not None:
        kept += f" + {view['target_kind']} {view['target_label']}"
    kind = f"{view['kind']}, " if view["method"] or view["chain"] else ""       # (a hand-written tree: no kind)
    parts = [f"token tree of {view['seq_id']}, step {view['step']}", f"{kind}{n} drafts",
             f"accepted path {arrows}", kept]
    if not view["chain"] and view["first_branch_accepted"] < a:
        parts.append(f"the first-ranked branch alone: {view['first_branch_accepted']}")
    return wrap_title("  \u00b7  ".join(parts), width_pt, size, weight="normal")


@styled
def draw_tree(traces, step: int, seq_id=None, ax=None, numbers=None, legend=True, order=None) -> dict:
    """Draw one sequence's token tree in ``step`` (see the module doc) on ``ax`` (a new figure when None).
    ``numbers``: write each node's index beside its byte (None: where it fits); ``order``: a seq_order
    dict (the root's colour). Returns {"ax", "view" (step_tree's data), "accepted" (the path's nodes),
    "nodes": [{"node", "label", "state", "color", "xy", "text"}], "target": {...} or None,
    "edges": {(parent, child): Line2D}, "legend"}. Raises TraceError on a step without a tree."""
    from matplotlib.colors import to_rgba
    from minibatch.viz.palette import seq_color, seq_order
    traces = as_traces(traces)
    view = step_tree(traces, step, seq_id)
    st = style()
    ax = new_axes(ax, TREE_SIZE)
    parents, path, labels = view["parents"], view["accepted"], view["labels"]
    has_target = view["target_label"] is not None
    rows = tree_rows(parents, path[-1] if has_target else None)
    cols = [*view["depths"]] + ([view["depths"][path[-1]] + 1] if has_target else [])
    n_cols, n_rows = max(cols) + 1, max(rows) + 1
    w_pt, h_pt = axes_size_pt(ax)
    col_pt = w_pt / (n_cols + 0.2)
    texts = [f"{i} {lab}" for i, lab in enumerate(labels)]
    if numbers is None:               # the node's index beside its byte, where the widest still leaves a gap
        numbers = max(text_width_pt(x, st.small, "bold", "monospace") for x in texts) + 1.6 * st.small <= col_pt
    if not numbers:
        texts = list(labels)
    root_color = seq_color(view["seq_id"], order or seq_order(traces))
    on_path = set(path)
    edges = {}
    for i in range(1, len(parents)):
        p = parents[i]
        kept = i in on_path
        edges[(p, i)] = ax.plot([cols[p], cols[i]], [rows[p], rows[i]], zorder=1, solid_capstyle="round",
                                color=TREE_COLORS["accepted"] if kept else MUTED_EDGE,
                                linewidth=3.2 if kept else 1.2)[0]
    nodes = []
    for i, (text, state) in enumerate(zip(texts, view["states"])):
        face = {"root": root_color, "accepted": TREE_COLORS["accepted"]}.get(state, TREE_COLORS["rejected"])
        ink = text_color_on(to_rgba(face)) if state != "rejected" else MUTED_TEXT
        artist = ax.text(cols[i], rows[i], text, ha="center", va="center", fontsize=st.small, family="monospace",
                         fontweight="normal" if state == "rejected" else "bold", color=ink, zorder=3,
                         bbox=dict(boxstyle="round,pad=0.3", facecolor=face,
                                   edgecolor=PHASE_COLORS["decode"] if state == "rejected" else "none",
                                   linewidth=0.8))
        nodes.append({"node": i, "label": labels[i], "state": state, "color": to_rgba(face),
                      "xy": (cols[i], rows[i]), "text": artist})
    target = None
    if has_target:
        x, y, last = cols[-1], rows[-1], path[-1]
        ax.plot([cols[last], x], [rows[last], y], zorder=1, color=TREE_COLORS["target"], linewidth=2.2,
                linestyle=(0, (2, 1.5)))
        word = view["target_kind"]                 # named in the title and the legend; the box holds the byte
        artist = ax.text(x, y, view["target_label"], ha="center", va="center", fontsize=st.small,
                         family="monospace", fontweight="bold", color="white", zorder=3,
                         bbox=dict(boxstyle="round,pad=0.3", facecolor=TREE_COLORS["target"], edgecolor="none"))
        target = {"kind": word, "token": view["target_token"], "label": view["target_label"],
                  "color": to_rgba(TREE_COLORS["target"]), "xy": (x, y), "after": last, "text": artist}
    ax.set_xlim(-0.55, max(cols) + 0.55)
    ax.set_ylim(n_rows - 0.5, -0.6)
    c = view["context_len"]
    ax.set_xticks(range(n_cols), ["root"] + [str(d) for d in range(1, n_cols)], fontsize=st.small)
    ax.set_yticks([])
    ax.tick_params(length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel(f"depth d (at position {c} + d: siblings share a position)" if c else
                  "depth d (siblings share a position)", fontsize=st.font)
    ax.set_title(_title(view, w_pt, st.font), fontsize=st.font, loc="left")
    handles = legend_handles()
    if legend:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=st.small,
                  frameon=False, borderaxespad=0.3)
    return {"ax": ax, "view": view, "accepted": list(path), "nodes": nodes, "target": target, "edges": edges,
            "numbers": numbers, "legend": handles}


def _ticks(n: int, path, cell_pt: float, need_pt: float) -> list:
    """Node labels along a mask axis: every node where a label fits its cell, else every 2nd, 4th, ...,
    plus the accepted path's nodes wherever they do not crowd a neighbour."""
    every = next((e for e in (1, 2, 4, 8, 16, 32) if cell_pt * e >= need_pt), 64)
    ticks = list(range(0, n, every))
    for i in path:
        if all(abs(i - j) >= every for j in ticks if j != i):
            ticks.append(i)
    return sorted(set(ticks))


@styled
def draw_tree_mask(traces, step: int, seq_id=None, ax=None, legend=True) -> dict:
    """The tree mask of one sequence's tree in ``step`` as a heat map: row i = query node i, column j = key
    node j, filled where i attends to j (``tree.ancestor_mask`` of the recorded parents); cells where both
    are on the accepted path in the accepted colour, and those rows' and columns' labels too. Returns
    {"ax", "view", "mask" (list of lists of bool), "codes" (0 hidden, 1 seen, 2 seen on the path),
    "image", "accepted", "legend"}. Raises TraceError on a step without a tree."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    traces = as_traces(traces)
    view = step_tree(traces, step, seq_id)
    st = style()
    ax = new_axes(ax, MASK_SIZE)
    parents, path = view["parents"], view["accepted"]
    mask = ancestor_mask(parents).tolist()
    on_path = set(path)
    codes = [[(2 if i in on_path and j in on_path else 1) if seen else 0 for j, seen in enumerate(row)]
             for i, row in enumerate(mask)]
    n = len(parents)
    image = ax.imshow(codes, cmap=ListedColormap(MASK_COLORS), vmin=-0.5, vmax=2.5, interpolation="nearest",
                      aspect="equal")
    ax.set_xticks([x - 0.5 for x in range(1, n)], minor=True)
    ax.set_yticks([x - 0.5 for x in range(1, n)], minor=True)
    ax.grid(which="minor", color="#DDDDDD", linewidth=0.6)
    ax.tick_params(which="minor", length=0)
    w_pt, h_pt = axes_size_pt(ax)
    cell_pt = min(w_pt, h_pt) / n
    xticks = _ticks(n, path, cell_pt, 1.3 * text_width_pt(str(n - 1), st.small, "bold"))   # labels side by side
    yticks = _ticks(n, path, cell_pt, 1.25 * st.small)                                      # ... one above another
    ax.xaxis.set_ticks_position("top")
    ax.xaxis.set_label_position("top")
    ax.set_xticks(xticks, [str(i) for i in xticks], fontsize=st.small)
    ax.set_yticks(yticks, [str(i) for i in yticks], fontsize=st.small)
    ax.tick_params(which="major", length=0, labelsize=st.small)
    for axis, ticks in ((ax.xaxis, xticks), (ax.yaxis, yticks)):   # the path's rows and columns: in its colour
        for tick, i in zip(axis.get_major_ticks(), ticks):
            if i in on_path:
                for lab in (tick.label1, tick.label2):
                    lab.set_color(PHASE_COLORS["decode"])
                    lab.set_fontweight("bold")
    ax.set_xlabel("key node j (attended to)", fontsize=st.font)
    ax.set_ylabel("query node i", fontsize=st.font)
    ax.set_title(wrap_title(f"tree mask of {view['seq_id']}, step {view['step']}  ·  node i attends to its "
                            f"ancestors and itself  ·  (and to the cached context, not drawn)",
                            max(w_pt, 1.0), st.font, weight="normal"), fontsize=st.font, loc="left")
    handles = [Patch(facecolor=MASK_COLORS[1], label="attends"),
               Patch(facecolor=MASK_COLORS[2], label="attends, both on the accepted path"),
               Patch(facecolor=MASK_COLORS[0], edgecolor="#BBBBBB", label="masked (sibling, cousin, later)")]
    if legend:
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02), fontsize=st.small,
                  frameon=False, ncols=1)
    return {"ax": ax, "view": view, "mask": mask, "codes": codes, "image": image, "accepted": list(path),
            "legend": handles}
