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
* with a memory hierarchy (a trace with ``num_host_blocks > 0``), the host pool
  beside the device pool (``host_pool.py``): swapped-out blocks in their
  sequence's colour, host-tier blocks grey.

Layout rules, so any number of blocks and rows reads on a notebook and on a
slide: a stand-alone figure uses constrained layout (titles, row labels and
the legend are placed around each other, never on top); tick labels are
thinned and cell text is left out when it would not fit its cell; the
logical-block axis sits on top, under the title, next to the rows it labels;
the legend lists only what occurs in the run.
"""
from __future__ import annotations

import math

from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from minibatch.viz.common import (CACHED_FREE_COLOR, EDGE_COLOR, FREE_COLOR, UNKNOWN_OWNER_COLOR, as_traces,
                                  axes_size_pt, evicted_blocks, figsize_for, find_step, new_axes, short_label,
                                  style, styled, text_color_on, text_width_pt)
from minibatch.viz.host_pool import draw_host_pool, has_host_pool
from minibatch.viz.palette import seq_color, seq_order

EVICTED_COLOR = "#D55E00"      # Okabe-Ito vermillion, as "preempted": something was lost this step


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


def block_state(trace, b: int) -> str:
    """'used' (ref count > 0), 'cached-free' (ref count 0, prefix-cache entry kept) or 'free'."""
    if trace.ref_counts[b] > 0:
        return "used"
    return "cached-free" if b in set(trace.cached_blocks) else "free"


def pool_features(traces) -> set:
    """What the pool view shows somewhere in the run: 'free', 'cached-free', 'shared', 'cached', 'evicted'."""
    traces = as_traces(traces)
    found = set()
    for i, t in enumerate(traces):
        cached = set(t.cached_blocks)
        if any(rc == 0 and b not in cached for b, rc in enumerate(t.ref_counts)):
            found.add("free")
        if any(t.ref_counts[b] == 0 for b in cached):
            found.add("cached-free")
        if any(rc > 1 for rc in t.ref_counts):
            found.add("shared")
        if any(t.ref_counts[b] > 0 for b in cached):
            found.add("cached")
        if i and set(traces[i - 1].cached_blocks) - cached:
            found.add("evicted")
    return found


def pool_legend_handles(features=None) -> list:
    """Legend entries of the pool view; ``features`` (pool_features) keeps only what occurs."""
    handles = {
        "free": Patch(facecolor=FREE_COLOR, edgecolor=EDGE_COLOR, label="free block"),
        "cached-free": Patch(facecolor=CACHED_FREE_COLOR, edgecolor=EDGE_COLOR, hatch="//",
                             label="cached-free block"),
        "shared": Patch(facecolor="white", edgecolor="black", linewidth=2.5,
                        label="shared block (\u00d7N = ref count)"),
        "cached": Line2D([], [], marker="o", linestyle="none", color="white", markeredgecolor="black",
                         label="block in prefix cache"),
        "evicted": Patch(facecolor="white", edgecolor=EVICTED_COLOR, linewidth=2.5, linestyle="--",
                         label="cache entry evicted this step")}
    return [h for name, h in handles.items() if features is None or name in features]


def pool_title(counts: dict) -> str:
    """'KV block pool: 17 used, 6 cached-free, 1 free, 1 evicted' (evicted only when there are some)."""
    return (f"KV block pool: {counts['used']} used, {counts['cached-free']} cached-free, {counts['free']} free"
            + (f", {counts['evicted']} evicted" if counts["evicted"] else ""))


def _pool_columns(num_blocks: int) -> int:
    return 8 if num_blocks <= 48 else 16 if num_blocks <= 256 else 32


def thin_ticks(n: int, room_pt: float, widest: str, size: float) -> int:
    """Label every k-th of ``n`` ticks sharing ``room_pt`` points so that labels as wide as ``widest`` never touch."""
    need = text_width_pt(widest, size) + size * 0.6
    per = room_pt / max(n, 1)
    return max(1, math.ceil(need / per)) if per > 0 else n


def blocks_figure(figsize=(13, 5), host: bool = False):
    """A figure holding the pool and, beside it, the block tables (constrained layout); host=True puts the
    host pool between them and returns three Axes (device pool, host pool, tables)."""
    import matplotlib.pyplot as plt
    fig = plt.figure(figsize=figsize_for((figsize[0] * 1.35, figsize[1]) if host else figsize), layout="constrained")
    return fig.subplots(1, 3, width_ratios=[1, 1, 1.2]) if host else fig.subplots(1, 2, width_ratios=[1, 1.2])


@styled
def draw_blocks(traces, step: int, ax=None, tables_ax=None, ncols=None, order=None, legend=True,
                host_ax=None) -> dict:
    """Draw the block pool after ``step``; with ``ax=None`` a new figure holds the
    pool and, beside it, the block tables (``tables_ax`` does that for a given Axes),
    and, for a run with a host pool, the host pool between them (``host_ax``).
    ``ncols`` overrides the grid width; ``order`` (seq_order) fixes the colours;
    ``legend=False`` leaves the legend to the caller (the dashboard has one for all views).

    Returns {"ax", "cells": [{"block", "state", "owners", "ref_count", "cached", "patches"}],
             "labels": {block: ref-count text}, "counts": {state: n}, "tables": ... or None,
             "host": host_pool.draw_host_pool's result or None, "legend": [handles]}.
    """
    traces = as_traces(traces)
    t = find_step(traces, step)
    order = order or seq_order(traces)
    st = style()
    if ax is None:
        if has_host_pool(traces):
            ax, host_ax, tables_ax = blocks_figure(host=True)
        else:
            ax, tables_ax = blocks_figure()
    ncols = ncols or _pool_columns(t.num_blocks)
    nrows = math.ceil(t.num_blocks / ncols)
    w_pt, h_pt = axes_size_pt(ax)
    cell_pt = min(w_pt / ncols, h_pt / nrows)              # aspect is equal: the tighter side wins
    write_rc = cell_pt * 0.9 >= text_width_pt("\u00d79", st.small, "bold") and cell_pt * 0.9 >= st.small * 1.3
    owners, cached, evicted = block_owners(t), set(t.cached_blocks), evicted_blocks(traces, step)
    cells, labels, dots = [], {}, []
    for b in range(t.num_blocks):
        x, y = b % ncols, b // ncols
        state, rc = block_state(t, b), t.ref_counts[b]
        patches, shared = [], rc > 1
        if state == "used":
            fills = [seq_color(s, order) for s in owners[b]] or [UNKNOWN_OWNER_COLOR]
        else:
            fills = [CACHED_FREE_COLOR if state == "cached-free" else FREE_COLOR]
        edge = dict(edgecolor="black", linewidth=2.5) if shared else dict(edgecolor=EDGE_COLOR, linewidth=0.8)
        if len(fills) == 1 and not shared:                  # one patch: fill and frame together
            patches.append(ax.add_artist(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor=fills[0],
                                                   hatch="//" if state == "cached-free" else None, **edge)))
        else:
            w = 0.9 / len(fills)
            for i, color in enumerate(fills):               # one sliver per owner, then the frame
                patches.append(ax.add_artist(Rectangle((x + 0.05 + i * w, y + 0.05), w, 0.9,
                                                       facecolor=color, edgecolor="none")))
            ax.add_artist(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, fill=False, **edge))
        if shared:
            labels[b] = f"\u00d7{rc}"
            if write_rc:                                    # on a white chip: legible across the slivers
                ax.text(x + 0.5, y + 0.5, labels[b], ha="center", va="center", fontsize=st.small,
                        fontweight="bold", color="black",
                        bbox=dict(boxstyle="round,pad=0.1", facecolor="white", edgecolor="none", alpha=0.85))
        if state == "used" and b in cached:                 # full block, findable by its hash
            dots.append((x + 0.83, y + 0.2))
        if b in evicted:
            ax.add_artist(Rectangle((x + 0.1, y + 0.1), 0.8, 0.8, fill=False, edgecolor=EVICTED_COLOR,
                                   linewidth=2.5, linestyle="--"))
        cells.append({"block": b, "state": state, "owners": owners[b], "ref_count": rc,
                      "cached": b in cached, "evicted": b in evicted, "patches": patches})
    if dots:                                                # one artist for every dot: frames draw faster
        ax.plot(*zip(*dots), "o", markersize=max(3.0, min(7.0, cell_pt / 6)), color="white",
                markeredgecolor="black", markeredgewidth=1.0, linestyle="none")
    counts = {s: sum(c["state"] == s for c in cells) for s in ("used", "cached-free", "free")}
    counts["evicted"] = len(evicted)
    ax.set_xlim(0, ncols)
    ax.set_ylim(nrows, 0)
    ax.set_aspect("equal")
    every = thin_ticks(ncols, cell_pt * ncols, str(ncols - 1), st.small)
    ax.set_xticks([i + 0.5 for i in range(0, ncols, every)], [str(i) for i in range(0, ncols, every)],
                  fontsize=st.small)
    every_row = max(1, math.ceil(st.small * 1.3 / max(cell_pt, 1e-6)))
    ax.set_yticks([r + 0.5 for r in range(0, nrows, every_row)],
                  [str(r * ncols) for r in range(0, nrows, every_row)], fontsize=st.small)
    ax.tick_params(length=0, labeltop=True, labelbottom=False, pad=2)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(pool_title(counts) + f"\nblock id = row + column, {t.block_size} tokens each",
                 fontsize=st.font, loc="left")
    handles = pool_legend_handles(pool_features(traces))
    host = draw_host_pool(traces, step, host_ax, order=order) if host_ax is not None else None
    if host is not None:
        handles = handles + host["legend"]
    if legend and handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, 0), ncols=1 if len(handles) < 3 else 2,
                  fontsize=st.small, frameon=False, borderaxespad=0.2)
    tables = draw_block_tables(traces, step, ax=tables_ax, order=order) if tables_ax is not None else None
    return {"ax": ax, "cells": cells, "labels": labels, "counts": counts, "tables": tables, "host": host,
            "legend": handles}


@styled
def draw_block_tables(traces, step: int, ax=None, max_rows=None, order=None) -> dict:
    """One row per live sequence after ``step``: logical block i -> physical id. ``max_rows`` caps the rows
    drawn (default: as many as fit the Axes at the preset's text size); the rest are counted below.

    Returns {"ax", "rows": {seq id: [physical ids]}, "patches": {seq id: [Rectangle]}, "hidden": n}.
    """
    traces = as_traces(traces)
    t = find_step(traces, step)
    order = order or seq_order(traces)
    st = style()
    ax = new_axes(ax, (7, 4))
    w_pt, h_pt = axes_size_pt(ax)
    row_pt = st.small * 1.7                                 # a row label needs its text height and a gap
    fit_rows = max(1, int((h_pt - row_pt) // row_pt))
    max_rows = min(max_rows or fit_rows, fit_rows)
    # The frame is sized for the whole run, so an animation's layout does not jump.
    width = max([len(tb) for tr in traces for tb in tr.block_tables.values()] + [8])
    live = sorted(t.block_tables, key=order.get)
    height = min(max_rows, max([len(tr.block_tables) for tr in traces] + [1]))
    shown, hidden = live[:max_rows], max(0, len(live) - max_rows)
    widest = max([str(b) for tb in t.block_tables.values() for b in tb] + ["0"], key=len)
    cell_w, cell_h = w_pt / width, h_pt / (max(height, len(shown)) + (1 if hidden else 0))
    write_ids = cell_w * 0.9 >= text_width_pt(widest, st.small, "bold") and cell_h * 0.8 >= st.small * 1.15
    rows, patches = {}, {}
    for y, sid in enumerate(shown):
        color = seq_color(sid, order)
        rows[sid], patches[sid] = list(t.block_tables[sid]), []
        for i, b in enumerate(t.block_tables[sid]):
            shared = t.ref_counts[b] > 1
            patches[sid].append(ax.add_artist(Rectangle(
                (i + 0.05, y + 0.1), 0.9, 0.8, facecolor=color,
                edgecolor="black" if shared else EDGE_COLOR, linewidth=2.5 if shared else 0.8)))
            if write_ids:
                ax.text(i + 0.5, y + 0.5, str(b), ha="center", va="center", fontsize=st.small,
                        fontweight="bold" if shared else "normal", color=text_color_on(color))
    bottom = max(height, len(shown))
    if not live:
        ax.text(0.1, 0.5, "no live sequence: every block table has been freed", fontsize=st.small, va="center")
    if hidden:
        ax.text(0, bottom + 0.5, f"... and {hidden} more sequences", fontsize=st.small, va="center")
    ax.set_xlim(0, width)
    ax.set_ylim(bottom + (1 if hidden else 0), 0)
    ax.set_yticks([y + 0.5 for y in range(len(shown))], [short_label(s) for s in shown], fontsize=st.small)
    every = thin_ticks(width, w_pt, str(width - 1), st.small)
    ax.set_xticks([i + 0.5 for i in range(0, width, every)], [str(i) for i in range(0, width, every)],
                  fontsize=st.small)
    ax.tick_params(length=0, labeltop=True, labelbottom=False, pad=2)   # the axis next to the rows it labels
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title("block tables: logical block -> physical id\n(bold edge: shared block)",
                 fontsize=st.font, loc="left")
    return {"ax": ax, "rows": rows, "patches": patches, "hidden": hidden}
