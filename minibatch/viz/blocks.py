"""The block table view: the physical KV block pool, and who points where.

PagedAttention (Kwon et al., SOSP'23, §4.1-4.3) stores a sequence's keys and
values in fixed-size **blocks** scattered anywhere in one pool; the
sequence's **block table** maps its logical block i (tokens
``i*block_size .. (i+1)*block_size-1``) to a physical block id. Two pictures
make that visible:

* ``draw_blocks``: the pool as a grid (block id = row label + column), each
  block filled with the colour of the sequence(s) whose table holds it. A
  block held by several tables (a prefix-cache hit, or a parallel-sampling
  fork) is split into one sliver per owner and labelled with its **ref
  count** ("×2"); a free block that still holds a **prefix-cache** entry is
  grey and hatched (reusable without recompute until it is evicted); a
  truly free block is white; a dot marks in-use blocks that are cached; a
  dashed vermillion frame marks a block whose cache entry was **evicted** in
  this step (least recently freed first: it was taken for new tokens).
* ``draw_block_tables``: one row per live sequence, logical index on x, the
  physical id written in each cell: the indirection the kernel follows.
"""
from __future__ import annotations

import math

from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from minibatch.viz.common import (CACHED_FREE_COLOR, EDGE_COLOR, FONT_SIZE, FREE_COLOR, SMALL_FONT,
                         UNKNOWN_OWNER_COLOR, as_traces, evicted_blocks, find_step, new_axes, seq_color,
                         seq_order, short_label, text_color_on)


def block_owners(trace) -> list:
    """owners[b] = the live sequences whose block table holds physical block b."""
    owners = [[] for _ in range(trace.num_blocks)]
    for sid, table in trace.block_tables.items():
        for b in table:
            if not 0 <= b < trace.num_blocks:
                raise ValueError(f"step {trace.step}: {sid}'s block table holds block {b}, "
                                 f"outside the pool of {trace.num_blocks}")
            if sid not in owners[b]:
                owners[b].append(sid)
    return owners


EVICTED_COLOR = "#D55E00"      # Okabe-Ito vermillion, as "preempted": something was lost this step


def block_state(trace, b: int) -> str:
    """'used' (ref count > 0), 'cached-free' (ref count 0, prefix-cache entry kept) or 'free'."""
    if trace.ref_counts[b] > 0:
        return "used"
    return "cached-free" if b in set(trace.cached_blocks) else "free"


def pool_legend_handles() -> list:
    return [Patch(facecolor=FREE_COLOR, edgecolor=EDGE_COLOR, label="free block"),
            Patch(facecolor=CACHED_FREE_COLOR, edgecolor=EDGE_COLOR, hatch="//", label="cached-free block"),
            Patch(facecolor="white", edgecolor="black", linewidth=2.5, label="shared block (\u00d7N = ref count)"),
            Line2D([], [], marker="o", linestyle="none", color="white", markeredgecolor="black",
                   label="block in prefix cache"),
            Patch(facecolor="white", edgecolor=EVICTED_COLOR, linewidth=2.5, linestyle="--",
                  label="cache entry evicted this step")]


def pool_title(counts: dict) -> str:
    """'KV block pool: 17 used, 6 cached-free, 1 free, 1 evicted' (evicted only when there are some)."""
    return (f"KV block pool: {counts['used']} used, {counts['cached-free']} cached-free, {counts['free']} free"
            + (f", {counts['evicted']} evicted" if counts["evicted"] else ""))


def _pool_columns(num_blocks: int) -> int:
    return 8 if num_blocks <= 48 else 16 if num_blocks <= 256 else 32


def draw_blocks(traces, step: int, ax=None, tables_ax=None, ncols=None, order=None) -> dict:
    """Draw the block pool after ``step``; with ``ax=None`` a new figure holds the
    pool and, beside it, the block tables (``tables_ax`` does that for a given Axes).
    ``ncols`` overrides the grid width; ``order`` (seq_order) fixes the colours.

    Returns {"ax", "cells": [{"block", "state", "owners", "ref_count", "cached", "patches"}],
             "labels": {block: ref-count text}, "counts": {state: n}, "tables": ... or None}.
    """
    traces = as_traces(traces)
    t = find_step(traces, step)
    order = order or seq_order(traces)
    if ax is None:
        import matplotlib.pyplot as plt
        fig, (ax, tables_ax) = plt.subplots(1, 2, figsize=(13, 4.5), width_ratios=[1, 1.3])
    ncols = ncols or _pool_columns(t.num_blocks)
    nrows = math.ceil(t.num_blocks / ncols)
    owners, cached, evicted = block_owners(t), set(t.cached_blocks), evicted_blocks(traces, step)
    cells, labels = [], {}
    for b in range(t.num_blocks):
        x, y = b % ncols, b // ncols
        state, rc = block_state(t, b), t.ref_counts[b]
        patches = []
        if state == "used":
            fills = [seq_color(s, order) for s in owners[b]] or [UNKNOWN_OWNER_COLOR]
            w = 0.9 / len(fills)
            for i, color in enumerate(fills):               # one sliver per owner
                patches.append(ax.add_patch(Rectangle((x + 0.05 + i * w, y + 0.05), w, 0.9,
                                                      facecolor=color, edgecolor="none")))
        else:
            patches.append(ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, edgecolor="none",
                                                  facecolor=CACHED_FREE_COLOR if state == "cached-free" else FREE_COLOR,
                                                  hatch="//" if state == "cached-free" else None)))
        shared = rc > 1
        ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, fill=False,
                               edgecolor="black" if shared else EDGE_COLOR, linewidth=2.5 if shared else 0.8))
        if shared:
            labels[b] = f"\u00d7{rc}"
            ax.text(x + 0.5, y + 0.5, labels[b], ha="center", va="center", fontsize=FONT_SIZE,   # on a white
                    fontweight="bold", color="black",                   # chip: legible across the slivers
                    bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.85))
        if state == "used" and b in cached:                 # full block, findable by its hash
            ax.plot(x + 0.83, y + 0.2, "o", markersize=6, color="white", markeredgecolor="black",
                    markeredgewidth=1.0)
        if b in evicted:
            ax.add_patch(Rectangle((x + 0.1, y + 0.1), 0.8, 0.8, fill=False, edgecolor=EVICTED_COLOR,
                                   linewidth=2.5, linestyle="--"))
        cells.append({"block": b, "state": state, "owners": owners[b], "ref_count": rc,
                      "cached": b in cached, "evicted": b in evicted, "patches": patches})
    counts = {s: sum(c["state"] == s for c in cells) for s in ("used", "cached-free", "free")}
    counts["evicted"] = len(evicted)
    ax.set_xlim(0, ncols)
    ax.set_ylim(nrows, 0)
    ax.set_aspect("equal")
    ax.set_xticks([i + 0.5 for i in range(ncols)], [str(i) for i in range(ncols)], fontsize=SMALL_FONT)
    ax.set_yticks([r + 0.5 for r in range(nrows)], [str(r * ncols) for r in range(nrows)], fontsize=SMALL_FONT)
    ax.tick_params(length=0, labeltop=True, labelbottom=False)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(pool_title(counts) + f"  (block = row + column, {t.block_size} tokens each)",
                 fontsize=FONT_SIZE, loc="left")
    ax.legend(handles=pool_legend_handles(), loc="upper left", bbox_to_anchor=(0, -0.02), ncols=2,
              fontsize=SMALL_FONT, frameon=False)
    tables = draw_block_tables(traces, step, ax=tables_ax, order=order) if tables_ax is not None else None
    return {"ax": ax, "cells": cells, "labels": labels, "counts": counts, "tables": tables}


def draw_block_tables(traces, step: int, ax=None, max_rows: int = 10, order=None) -> dict:
    """One row per live sequence after ``step``: logical block i -> physical id.

    Returns {"ax", "rows": {seq id: [physical ids]}, "patches": {seq id: [Rectangle]}, "hidden": n}.
    """
    traces = as_traces(traces)
    t = find_step(traces, step)
    order = order or seq_order(traces)
    ax = new_axes(ax, (7, 4))
    # The frame is sized for the whole run, so an animation's layout does not jump.
    width = max([len(tb) for tr in traces for tb in tr.block_tables.values()] + [8])
    height = min(max_rows, max([len(tr.block_tables) for tr in traces] + [5]))
    live = sorted(t.block_tables, key=order.get)
    shown, hidden = live[:max_rows], max(0, len(live) - max_rows)
    write_ids = width <= 16                                # a 10-pt number needs ~0.25 inch
    rows, patches = {}, {}
    for y, sid in enumerate(shown):
        color = seq_color(sid, order)
        rows[sid], patches[sid] = list(t.block_tables[sid]), []
        for i, b in enumerate(t.block_tables[sid]):
            shared = t.ref_counts[b] > 1
            patches[sid].append(ax.add_patch(Rectangle(
                (i + 0.05, y + 0.1), 0.9, 0.8, facecolor=color,
                edgecolor="black" if shared else EDGE_COLOR, linewidth=2.5 if shared else 0.8)))
            if write_ids:
                ax.text(i + 0.5, y + 0.5, str(b), ha="center", va="center", fontsize=SMALL_FONT,
                        fontweight="bold" if shared else "normal", color=text_color_on(color))
    if hidden:
        ax.text(0, height + 0.3, f"... and {hidden} more sequences", fontsize=SMALL_FONT, va="top")
    ax.set_xlim(0, width)
    ax.set_ylim(max(height, len(shown)) + (0.6 if hidden else 0), 0)
    ax.set_yticks([y + 0.5 for y in range(len(shown))], [short_label(s) for s in shown], fontsize=SMALL_FONT)
    step_x = 1 if width <= 16 else max(1, width // 8)
    ax.set_xticks([i + 0.5 for i in range(0, width, step_x)], [str(i) for i in range(0, width, step_x)],
                  fontsize=SMALL_FONT)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_xlabel("logical block", fontsize=SMALL_FONT)
    ax.set_title("block tables (logical -> physical; bold edge = shared)", fontsize=FONT_SIZE, loc="left")
    return {"ax": ax, "rows": rows, "patches": patches, "hidden": hidden}
