"""The radix tree view: SGLang's prefix cache (``prefix_cache="radix"``, kv/radix_cache.py) beside the block table.

Each trace of a radix run lists the tree after its step (``StepTrace.radix_nodes``, parents first), and this view
draws it left to right, the root at the left:

* a **node** is a box: the run of tokens on its edge (its first tokens as text, and how many), its blocks (one a
  page, the ids the block pool and the block tables show), and its ``lock_ref`` (how many running sequences' paths
  go through it: a locked node is never evicted);
* a locked node is framed thick in black; an unlocked inner node is plain (it becomes evictable when its last
  child goes);
* an **evictable leaf** (no children, lock_ref 0: what ``evict`` frees next, least recently used first) is grey and
  hatched, as the pool's cached-free blocks.

``draw_radix_blocks(traces, step)`` puts it beside the pool and the block tables (``blocks.py``), so a block id in
a box can be found in the pool. From the traces only, as every renderer: the drawing is what the trace recorded.
The dashboard (``draw_step``, so the widget and the animation) puts the tree in a column of its own;
``radix_boxes`` is the layout, which the live page (serve/live.py) is sent too, so every view places the nodes
alike. matplotlib is imported only to draw: ``radix_boxes`` loads without it.
"""
from __future__ import annotations

from minibatch.viz.common import (CACHED_FREE_COLOR, EDGE_COLOR, FREE_COLOR, as_traces, find_step, has_radix_tree,
                                  new_axes, style)
from minibatch.viz.tree_data import token_label

__all__ = ["has_radix_tree", "block_runs", "radix_boxes", "radix_title", "legend_handles", "draw_radix_tree",
           "draw_radix_blocks"]


def _text(tokens: list) -> str:
    """A node's first tokens as text: printable ASCII kept, a newline as the two characters \\n, others as '.'."""
    out = []
    for tok in tokens:
        lab = token_label(tok)
        out.append("\\n" if tok == 10 else lab[1:-1] if len(lab) == 3 and 32 <= tok < 127 else ".")
    return "".join(out)


def block_runs(blocks: list, most: int = 2) -> str:
    """Block ids as runs, e.g. [4, 5, 6, 7, 9] -> '4-7,9'; past ``most`` runs an ellipsis."""
    runs = []
    for b in blocks:
        if runs and b == runs[-1][1] + 1:
            runs[-1][1] = b
        else:
            runs.append([b, b])
    text = ",".join(f"{a}" if a == z else f"{a},{z}" if z == a + 1 else f"{a}-{z}" for a, z in runs[:most])
    return text + ("…" if len(runs) > most else "")


def radix_boxes(traces, step: int) -> list:
    """The tree after ``step`` as boxes to draw, from ``radix_nodes``: [{"id", "parent", "num_tokens", "text",
    "blocks", "lock_ref", "evictable", "root", "depth", "row", "label"}], parents first. ``row``: the leaves in
    order, a parent at the middle of its children's rows; ``label``: the lines a box shows (its first tokens, how
    many, its blocks in brackets, its lock_ref)."""
    t = find_step(as_traces(traces), step)
    boxes = {}
    for node_id, parent, n, first, blocks, lock_ref, evictable in t.radix_nodes:
        boxes[node_id] = dict(id=node_id, parent=parent, num_tokens=n, text=_text(first), blocks=list(blocks),
                              lock_ref=lock_ref, evictable=bool(evictable), root=parent == -1,
                              depth=0 if parent == -1 else boxes[parent]["depth"] + 1, children=[])
        if parent != -1:
            boxes[parent]["children"].append(node_id)
    leaves = [0]

    def place(b):                      # post-order: leaves take the next row, a parent the middle of its children
        if not b["children"]:
            b["row"] = leaves[0]
            leaves[0] += 1
        else:
            rows = [place(boxes[c]) for c in b["children"]]
            b["row"] = (rows[0] + rows[-1]) / 2
        return b["row"]

    for b in boxes.values():
        if b["root"]:
            place(b)
        b["label"] = "root" if b["root"] else \
            f"{b['text']}\n{b['num_tokens']} tok\n[{block_runs(b['blocks'])}]\nlock_ref {b['lock_ref']}"
    return [{k: v for k, v in b.items() if k != "children"} for b in boxes.values()]


def radix_title(boxes) -> str:
    n, e = len(boxes) - 1, sum(b["evictable"] for b in boxes)
    return (f"radix tree: {n} node{'s' * (n != 1)}, {sum(len(b['blocks']) for b in boxes)} blocks,\n"
            f"{e} evictable lea{'ves' if e != 1 else 'f'}")


def legend_handles() -> list:
    from matplotlib.patches import Patch
    return [Patch(facecolor=FREE_COLOR, edgecolor="black", linewidth=2.2, label="locked node (lock_ref > 0)"),
            Patch(facecolor=FREE_COLOR, edgecolor=EDGE_COLOR, label="unlocked inner node"),
            Patch(facecolor=CACHED_FREE_COLOR, edgecolor=EDGE_COLOR, hatch="//", label="evictable leaf (evict's next)")]


# A box's text, longest first: its label; its size, blocks and lock count, shorter; its lock count alone.
LABELS = [lambda b: b["label"],
          lambda b: "root" if b["root"] else
          f"{b['num_tokens']} tok\n[{block_runs(b['blocks'], 1)}]\nlock {b['lock_ref']}",
          lambda b: "" if b["root"] else str(b["lock_ref"])]
LABEL_KEYS = ["", "; lock: lock_ref", "; in a box: its lock_ref"]     # what the title adds, to read them


def _fits(ax, width: float, height: float):
    """A test of whether a label fits a box ``width`` x ``height`` of ``ax``'s extent, at the preset's small font.
    The extent is the one the figure's layout engine gives it now (a legend or title added later takes some
    height: 10 % of it is kept in hand)."""
    fig = ax.figure
    if fig.get_layout_engine() is not None:
        fig.get_layout_engine().execute(fig)
    box, px = ax.get_window_extent(), style().small * fig.dpi / 72
    room_w, room_h = box.width * width, 0.9 * box.height * height

    def fits(label: str) -> bool:
        lines = label.split("\n")
        return max(map(len, lines)) * 0.62 * px <= room_w and len(lines) * 1.3 * px <= room_h   # monospace
    return fits


def draw_radix_tree(traces, step: int, ax=None) -> dict:
    """Draw the radix tree after ``step``. Returns {"ax", "boxes": radix_boxes, each with the "patch" drawn and
    the text "shown" in it (its ``label``, or, where some label would not fit its box, the next of ``LABELS``
    that every box fits, or nothing), "legend": [handles]}."""
    from matplotlib.patches import FancyBboxPatch
    traces = as_traces(traces)
    t = find_step(traces, step)
    if not t.radix_nodes:
        raise ValueError(f"step {step} has no radix tree in its trace: record a run with prefix_cache='radix'")
    st = style()
    boxes = radix_boxes(traces, step)
    ax = new_axes(ax, (7, 4))
    where = {b["id"]: b for b in boxes}
    w, h = 0.86, 0.8
    depth, rows = max(b["depth"] for b in boxes), max(b["row"] for b in boxes)
    ax.set_axis_off()                                     # before measuring: no tick labels take room, the title
    ax.set_title(radix_title(boxes), fontsize=st.font, loc="left")      # does (a few words more come after)
    fits = _fits(ax, w / (depth + 1.1), h / (rows + 1.1))
    # the longest labels every box fits (a long decode grows a chain of one-page nodes: narrow boxes)
    level = next((i for i, shown in enumerate(LABELS) if all(fits(shown(b)) for b in boxes)), len(LABELS))
    for b in boxes:
        x, y = b["depth"], b["row"]
        if not b["root"]:
            p = where[b["parent"]]
            ax.plot([p["depth"] + w / 2, x - w / 2], [p["row"], y], color=EDGE_COLOR, linewidth=1, zorder=1)
        locked = b["lock_ref"] > 0 and not b["root"]
        b["patch"] = ax.add_patch(FancyBboxPatch(
            (x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02", zorder=2,
            facecolor=CACHED_FREE_COLOR if b["evictable"] else FREE_COLOR, hatch="//" if b["evictable"] else None,
            edgecolor="black" if locked else EDGE_COLOR, linewidth=2.2 if locked else 0.8))
        b["shown"] = LABELS[level](b) if level < len(LABELS) else ""
        if b["shown"]:
            ax.text(x, y, b["shown"], ha="center", va="center", fontsize=st.small, zorder=3, family="monospace")
    ax.set_xlim(-0.55, depth + 0.55)
    ax.set_ylim(rows + 0.55, -0.55)
    ax.set_title(radix_title(boxes) + LABEL_KEYS[min(level, len(LABELS) - 1)], fontsize=st.font, loc="left")
    return {"ax": ax, "boxes": boxes, "legend": legend_handles()}


def draw_radix_blocks(traces, step: int) -> dict:
    """The block pool, the block tables and the radix tree after ``step``, side by side (one figure)."""
    import matplotlib.pyplot as plt

    from minibatch.viz.blocks import draw_blocks
    from minibatch.viz.common import figsize_for
    fig = plt.figure(figsize=figsize_for((18, 5.5)), layout="constrained")
    pool_ax, tables_ax, tree_ax = fig.subplots(1, 3, width_ratios=[1, 1.1, 1.6])
    blocks = draw_blocks(traces, step, ax=pool_ax, tables_ax=tables_ax, legend=False)
    tree = draw_radix_tree(traces, step, ax=tree_ax)
    fig.legend(handles=blocks["legend"] + tree["legend"], loc="outside lower center", ncols=4,
               fontsize=style().small, frameon=False)
    return {"fig": fig, "blocks": blocks, "tree": tree}
