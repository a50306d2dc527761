"""The host pool view: the KV cache's second tier, drawn beside the device pool (``blocks.py``).

A run with a memory hierarchy (``preemption_mode="swap"`` or ``kv_offload_space``; engine/memory_hierarchy.py)
keeps blocks in host memory too. Each trace lists them (``host_block_tables``: the swapped-out sequences' host
blocks; ``offloaded_blocks``: the prefix cache's host tier; ``num_host_blocks``), and this view draws that pool
as a grid like the device's:

* a **swapped-out** block wears its sequence's colour, cross-hatched: live data of a preempted request, which
  comes back to the device before it runs again (PagedAttention §4.5);
* a **host-tier** block is grey, hatched the other way from the device's cached-free blocks: a copy of a full
  prefix block under its chained hash, loaded back instead of prefilled when a prompt misses the device pool;
* a free host block is white;
* a thick blue frame marks a block that arrived in the host pool this step (swapped out, or stored to the tier).

From the traces only, as every renderer: what the engine held is what the trace says it held.
"""
from __future__ import annotations

import math

from matplotlib.patches import Patch, Rectangle

from minibatch.viz.common import CACHED_FREE_COLOR, EDGE_COLOR, FREE_COLOR, as_traces, find_step, style
from minibatch.viz.palette import seq_color, seq_order

HOST_TIER_COLOR = CACHED_FREE_COLOR   # a cache, as the device's cached-free blocks: grey
ARRIVED_COLOR = "#0072B2"      # Okabe-Ito blue: moved over PCIe this step


def has_host_pool(traces) -> bool:
    """Whether any step of the run has a host pool to draw."""
    return any(getattr(t, "num_host_blocks", 0) > 0 for t in as_traces(traces))


def _holdings(t) -> tuple:
    owners = {}
    for sid, table in t.host_block_tables.items():
        for b in table:
            if not 0 <= b < t.num_host_blocks:
                raise ValueError(f"step {t.step}: {sid}'s host block table holds host block {b}, outside the host "
                                 f"pool of {t.num_host_blocks}")
            owners.setdefault(b, [])
            if sid not in owners[b]:
                owners[b].append(sid)
    tier = set(t.offloaded_blocks)
    if tier & set(owners):
        raise ValueError(f"step {t.step}: host blocks {sorted(tier & set(owners))} are both swapped and in the tier")
    return owners, tier


def host_cells(traces, step: int) -> list:
    """The host pool after ``step``, one dict a block: {"block", "state": 'swapped' | 'offloaded' | 'free',
    "owners": [seq ids], "arrived": bool (not in that state the step before)}. Empty without a host pool."""
    traces = as_traces(traces)
    t = find_step(traces, step)
    i = traces.index(t)
    owners, tier = _holdings(t)
    before_owners, before_tier = _holdings(traces[i - 1]) if i else ({}, set())
    cells = []
    for b in range(t.num_host_blocks):
        state = "swapped" if b in owners else "offloaded" if b in tier else "free"
        arrived = (state == "swapped" and owners[b] != before_owners.get(b)) or \
                  (state == "offloaded" and b not in before_tier)
        cells.append({"block": b, "state": state, "owners": owners.get(b, []), "arrived": arrived})
    return cells


def host_features(traces) -> set:
    """What the host view shows somewhere in the run: 'swapped', 'offloaded', 'host-free', 'arrived'."""
    found = set()
    for t in as_traces(traces):
        if t.host_block_tables:
            found.add("swapped")
        if t.offloaded_blocks:
            found.add("offloaded")
        if t.num_host_blocks and t.num_free_host_blocks:
            found.add("host-free")
    if found & {"swapped", "offloaded"}:
        found.add("arrived")
    return found


def host_legend_handles(features=None) -> list:
    handles = {
        "swapped": Patch(facecolor="white", edgecolor=EDGE_COLOR, hatch="xx",
                         label="swapped out (its sequence's colour)"),
        "offloaded": Patch(facecolor=HOST_TIER_COLOR, edgecolor=EDGE_COLOR, hatch="\\\\",
                           label="host tier (prefix copy)"),
        "host-free": Patch(facecolor=FREE_COLOR, edgecolor=EDGE_COLOR, label="free host block"),
        "arrived": Patch(facecolor="white", edgecolor=ARRIVED_COLOR, linewidth=2.5, label="reached host this step")}
    return [h for name, h in handles.items() if features is None or name in features]


def host_title(t, cells) -> str:
    n = {s: sum(c["state"] == s for c in cells) for s in ("swapped", "offloaded", "free")}
    return (f"host pool: {n['swapped']} swapped,\n{n['offloaded']} host tier, {n['free']} free\n"
            f"{t.offload_hits}/{t.offload_queries} loaded back")


def draw_host_pool(traces, step: int, ax, ncols=None, order=None) -> dict:
    """Draw the host pool after ``step`` onto ``ax``. Returns {"ax", "cells": host_cells + "patches",
    "legend": [handles]}."""
    traces = as_traces(traces)
    t = find_step(traces, step)
    order = order or seq_order(traces)
    st = style()
    cells = host_cells(traces, step)
    n = max(t.num_host_blocks, 1)
    ncols = ncols or (8 if n <= 48 else 16 if n <= 256 else 32)
    nrows = math.ceil(n / ncols)
    for c in cells:
        x, y = c["block"] % ncols, c["block"] // ncols
        if c["state"] == "swapped":
            fill, hatch = seq_color(c["owners"][0], order), "xx"
        elif c["state"] == "offloaded":
            fill, hatch = HOST_TIER_COLOR, "\\\\"
        else:
            fill, hatch = FREE_COLOR, None
        edge = dict(edgecolor=ARRIVED_COLOR, linewidth=2.5) if c["arrived"] else dict(edgecolor=EDGE_COLOR,
                                                                                       linewidth=0.8)
        c["patches"] = [ax.add_artist(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor=fill, hatch=hatch,
                                                **edge))]
    ax.set_xlim(0, ncols)
    ax.set_ylim(nrows, 0)
    ax.set_aspect("equal")
    ax.set_xticks([i + 0.5 for i in range(0, ncols, 4)], [str(i) for i in range(0, ncols, 4)], fontsize=st.small)
    ax.set_yticks([r + 0.5 for r in range(nrows)][::max(1, nrows // 8)],
                  [str(r * ncols) for r in range(nrows)][::max(1, nrows // 8)], fontsize=st.small)
    ax.tick_params(length=0, labeltop=True, labelbottom=False, pad=2)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(host_title(t, cells), fontsize=st.font, loc="left")
    return {"ax": ax, "cells": cells, "legend": host_legend_handles(host_features(traces))}
