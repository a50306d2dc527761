"""Occupancy and throughput over a run, and two runs side by side.

Two curves tell most of the batching story (vLLM §2.3/§6, Orca §5):

* ``draw_kv_usage``: blocks in use / cached-but-free / free after every step,
  a stacked area up to ``num_blocks``. Paging keeps "used" close to what the
  live sequences really hold; static batching that reserves whole max-length
  contexts wastes the rest.
* ``draw_throughput``: tokens in each step's flat batch, split by phase,
  under the token budget (``max_num_batched_tokens``). Continuous batching
  keeps the bars high; a static batch thins out as its members finish.

``draw_comparison`` puts two runs of the same workload in two columns with
shared axes, so "static takes longer and fills less" is read off directly.
"""
from __future__ import annotations

import numpy as np

from minibatch.viz.common import (CACHED_FREE_COLOR, EDGE_COLOR, FONT_SIZE, PHASE_COLORS, SMALL_FONT, as_traces, new_axes,
                         seq_order)

USED_COLOR = "#4477AA"      # Tol bright blue: blocks a live sequence points at


def kv_usage(traces) -> dict:
    """Per step: {"steps", "used", "cached_free", "free", "num_blocks"} (numpy arrays of block counts).
    "free" excludes cached-but-free blocks, so used + cached_free + free = num_blocks."""
    traces = as_traces(traces)
    used = np.array([t.num_blocks - t.num_free_blocks for t in traces])
    cached_free = np.array([sum(t.ref_counts[b] == 0 for b in t.cached_blocks) for t in traces])
    return {"steps": np.array([t.step for t in traces]), "used": used, "cached_free": cached_free,
            "free": np.array([t.num_free_blocks for t in traces]) - cached_free,
            "num_blocks": max(t.num_blocks for t in traces)}


def tokens_per_step(traces) -> dict:
    """Per step: {"steps", "prefill", "decode", "resumed", "total", "budget"} (token counts)."""
    traces = as_traces(traces)
    out = {"steps": np.array([t.step for t in traces])}
    for phase in ("prefill", "decode", "resumed"):
        out[phase] = np.array([sum(s.num_tokens for s in t.scheduled if s.phase == phase) for t in traces])
    out["total"] = np.array([t.num_batched_tokens for t in traces])
    out["budget"] = np.array([t.token_budget for t in traces])
    return out


def summarize(traces) -> dict:
    """A run in a few numbers: what a comparison table shows."""
    traces = as_traces(traces)
    kv, tok = kv_usage(traces), tokens_per_step(traces)
    proposed = sum(s.proposed for t in traces for s in t.scheduled)
    accepted = sum(s.accepted for t in traces for s in t.scheduled)
    return {"steps": len(traces), "tokens": int(tok["total"].sum()),
            "tokens_per_step": float(tok["total"].mean()),
            "kv_used_fraction": float((kv["used"] / kv["num_blocks"]).mean()),
            "generated": sum(len(s.new_token_ids) for t in traces for s in t.scheduled),
            "padding_slot_steps": sum(t.num_padding_slots for t in traces),
            "preemptions": sum(len(t.preempted) for t in traces),
            "acceptance_rate": accepted / proposed if proposed else None}


def usage_legend_handles() -> list:
    from matplotlib.lines import Line2D                 # matplotlib only where drawing: the numbers above
    from matplotlib.patches import Patch                #   serve the text view without it
    return [Patch(facecolor=USED_COLOR, label="used block"),
            Patch(facecolor=CACHED_FREE_COLOR, hatch="//", edgecolor=EDGE_COLOR, label="cached-free block"),
            Patch(facecolor="white", edgecolor=EDGE_COLOR, label="free block"),
            Line2D([], [], color="black", linestyle="--", label="token budget")]


def _window(ax, steps, upto, highlight):
    """Fix the x range to the whole run and mark the current step."""
    ax.set_xlim(steps[0] - 0.6, steps[-1] + 0.6)
    if highlight is not None:
        ax.axvline(highlight, color="black", linewidth=2)
    keep = steps <= upto if upto is not None else np.ones(len(steps), bool)
    return keep


def draw_kv_usage(traces, ax=None, upto=None, highlight=None) -> dict:
    """Stacked area of used / cached-free / free blocks over steps (through ``upto``).
    Returns kv_usage(...) plus "ax" and "shown" (how many steps were drawn)."""
    traces = as_traces(traces)
    ax = new_axes(ax, (8, 3))
    kv = kv_usage(traces)
    keep = _window(ax, kv["steps"], upto, highlight)
    x = kv["steps"][keep]
    ax.stackplot(x, kv["used"][keep], kv["cached_free"][keep], kv["free"][keep], step=None,
                 colors=[USED_COLOR, CACHED_FREE_COLOR, "white"], edgecolor=EDGE_COLOR, linewidth=0.5,
                 hatch=[None, "//", None], labels=["used", "cached-free", "free"])
    ax.set_ylim(0, kv["num_blocks"])
    ax.set_ylabel("KV blocks", fontsize=SMALL_FONT)
    ax.tick_params(labelsize=SMALL_FONT)
    ax.set_title(f"KV cache occupancy ({kv['num_blocks']} blocks)", fontsize=FONT_SIZE, loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=SMALL_FONT, frameon=False)
    return {**kv, "ax": ax, "shown": int(keep.sum())}


def draw_throughput(traces, ax=None, upto=None, highlight=None) -> dict:
    """Tokens per step as bars stacked by phase, and the token budget as a dashed line.
    Returns tokens_per_step(...) plus "ax" and "shown"."""
    traces = as_traces(traces)
    ax = new_axes(ax, (8, 3))
    tok = tokens_per_step(traces)
    keep = _window(ax, tok["steps"], upto, highlight)
    bottom = np.zeros(int(keep.sum()))
    for phase in ("decode", "prefill", "resumed"):
        ax.bar(tok["steps"][keep], tok[phase][keep], bottom=bottom, width=0.8, color=PHASE_COLORS[phase],
               label=f"{phase} tokens")
        bottom += tok[phase][keep]
    ax.step(tok["steps"], tok["budget"], where="mid", color="black", linestyle="--", linewidth=1.2,
            label="token budget")
    ax.set_ylim(0, max(tok["budget"].max(), tok["total"].max()) * 1.1)
    ax.set_ylabel("tokens / step", fontsize=SMALL_FONT)
    ax.set_xlabel("iteration (engine step)", fontsize=SMALL_FONT)
    ax.tick_params(labelsize=SMALL_FONT)
    ax.set_title("tokens in the flat batch", fontsize=FONT_SIZE, loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=SMALL_FONT, frameon=False)
    return {**tok, "ax": ax, "shown": int(keep.sum())}


def draw_comparison(traces_a, traces_b, labels=("static", "continuous"), fig=None) -> dict:
    """Two runs of one workload in two columns: timeline, KV occupancy, tokens per step.
    Both columns share the x range (the longer run's) and the sequence colours.
    Returns {"fig", labels[0]: {...}, labels[1]: {...}, "summary": {label: summarize(...)}}."""
    from minibatch.viz.timeline import draw_timeline
    runs = [as_traces(traces_a), as_traces(traces_b)]
    if len(labels) != 2:
        raise ValueError(f"labels must name the two runs, got {labels!r}")
    if fig is None:
        import matplotlib.pyplot as plt
        fig = plt.figure(figsize=(14, 8.5))
    grid = fig.add_gridspec(3, 2, height_ratios=[2.2, 1, 1], hspace=0.5, wspace=0.15,
                            left=0.06, right=0.98, top=0.93, bottom=0.17)
    order = seq_order(runs[0] + runs[1])                 # one colour per request across both runs
    first, last = min(r[0].step for r in runs), max(r[-1].step for r in runs)
    kv_top = max(t.num_blocks for r in runs for t in r)
    tok_top = 1.1 * max(max(t.token_budget, t.num_batched_tokens) for r in runs for t in r)
    out, handles = {"fig": fig, "summary": {}}, {}
    for col, (run, label) in enumerate(zip(runs, labels)):
        s = summarize(run)
        axes = [fig.add_subplot(grid[row, col]) for row in range(3)]
        res = {"timeline": draw_timeline(run, ax=axes[0], legend=False, order=order),
               "kv": draw_kv_usage(run, ax=axes[1]), "throughput": draw_throughput(run, ax=axes[2])}
        for ax in axes:
            ax.set_xlim(first - 0.6, last + 0.6)
            ax.get_legend() and ax.get_legend().remove()     # one shared legend below instead
        for h in res["timeline"]["legend"]:
            handles.setdefault(h.get_label(), h)
        axes[1].set_ylim(0, kv_top)
        axes[2].set_ylim(0, tok_top)
        axes[0].set_title(f"{label}: {s['steps']} steps, {s['tokens_per_step']:.1f} tokens/step, "
                          f"KV {100 * s['kv_used_fraction']:.0f}% used", fontsize=FONT_SIZE, loc="left")
        out[label], out["summary"][label] = res, s
    fig.legend(handles=list(handles.values()) + usage_legend_handles(), loc="lower center", ncols=7,
               fontsize=SMALL_FONT, frameon=False)
    return out
