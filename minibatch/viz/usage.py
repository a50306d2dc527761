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

Scales follow the data, not the limits: 30 blocks in use of 128, or 4 decode
tokens a step under a 512-token budget, would be flat lines at the bottom of
an axis drawn to the limit. So the y axis fits what the run used; the
capacity and the budget are drawn as dashed lines only where they fall near
that range, and named in the title otherwise. Rare prefill spikes (far above
the typical step) run off the top of the tokens axis, marked with a triangle,
so that decode-only steps stay visible; the legend says how high they went.
"""
from __future__ import annotations

import numpy as np

from minibatch.viz.common import (CACHED_FREE_COLOR, EDGE_COLOR, PHASE_COLORS, as_traces, figsize_for, new_axes,
                                  style, styled)

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
    """A run in a few numbers, under the names the comparison's titles use (``minibatch.stats.run_stats``
    computes them: one definition per figure)."""
    from minibatch.stats import run_stats
    r = run_stats(as_traces(traces))
    return {"steps": r["num_steps"], "tokens": r["num_batched_tokens"], "tokens_per_step": r["mean_tokens_per_step"],
            "kv_used_fraction": r["kv_usage_mean"], "generated": r["generated_tokens"],
            "padding_slot_steps": r["padding_slot_steps"], "preemptions": r["preemptions"],
            "acceptance_rate": r.get("acceptance_rate")}


def nice_ceiling(x: float) -> float:
    """The smallest of 1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8 x 10^k that is >= x (an axis top that reads well)."""
    if x <= 1:
        return 1.0
    base = 10 ** np.floor(np.log10(x))
    return float(next(m * base for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10) if m * base >= x - 1e-9))


def fit_scale(data_max: float, limit: float, typical: float = None) -> dict:
    """{"top", "limit_shown", "clipped"}: an axis top fitted to the data. With ``typical`` (the usual value),
    a maximum over 8x that is a spike (the usual bars would be a sliver under it): the axis fits 3x the
    typical value and the spikes run off the top.
    The limit (capacity, budget) is drawn only when it lies within half again of that top."""
    top = max(1.0, data_max * 1.1)
    clipped = typical is not None and data_max > 8 * max(typical, 1.0)
    if clipped:
        top = 3 * max(typical, 1.0)
    shown = limit <= 1.5 * top
    if shown:
        top = max(top, limit * 1.05)
    top = nice_ceiling(top)
    return {"top": top, "limit_shown": bool(shown), "clipped": bool(data_max > top)}


def throughput_scale(total, budget: float) -> dict:
    """The tokens axis: fit_scale with the 75th percentile of the steps as the typical step."""
    return {**fit_scale(float(total.max()), budget, typical=float(np.percentile(total, 75))),
            "max": float(total.max())}


CAPACITY_STYLE = dict(color="black", linestyle=":", linewidth=1.8)    # the pool's size: dotted
BUDGET_STYLE = dict(color="black", linestyle="--", linewidth=1.2)      # the token budget: dashed


def _limit_line(label: str, style: dict):
    from matplotlib.lines import Line2D
    return Line2D([], [], label=label, **style)


def _window(ax, steps, upto, highlight, xlim=None):
    """Fix the x range (the whole run, or ``xlim`` = (first, last) step) and mark the current step."""
    first, last = xlim or (steps[0], steps[-1])
    ax.set_xlim(first - 0.6, last + 0.6)
    if highlight is not None:
        ax.axvline(highlight, color="black", linewidth=2)
    return steps <= upto if upto is not None else np.ones(len(steps), bool)


@styled
def draw_kv_usage(traces, ax=None, upto=None, highlight=None, xlim=None, legend=True, top=None) -> dict:
    """Stacked area of used and cached-free blocks over steps (through ``upto``), on an axis fitted to
    the run (``top`` fixes it instead); the pool's capacity as a dashed line when it is near that range.
    Returns kv_usage(...) plus "ax", "shown" (steps drawn), "top" (the axis top) and "legend" (handles)."""
    from matplotlib.patches import Patch               # matplotlib only where drawing: the numbers above
    from matplotlib.ticker import MaxNLocator           #   serve the text view and the demo summary without it
    traces = as_traces(traces)
    st = style()
    ax = new_axes(ax, (8, 3))
    kv = kv_usage(traces)
    keep = _window(ax, kv["steps"], upto, highlight, xlim)
    x = kv["steps"][keep]
    ax.stackplot(x, kv["used"][keep], kv["cached_free"][keep], colors=[USED_COLOR, CACHED_FREE_COLOR],
                 edgecolor=EDGE_COLOR, linewidth=0.5, hatch=[None, "//"])
    scale = fit_scale(float((kv["used"] + kv["cached_free"]).max()), kv["num_blocks"]) if top is None else \
        {"top": float(top), "limit_shown": kv["num_blocks"] <= top}
    handles = []
    if kv["used"].any():
        handles.append(Patch(facecolor=USED_COLOR, label="used block"))
    if kv["cached_free"].any():
        handles.append(Patch(facecolor=CACHED_FREE_COLOR, hatch="//", edgecolor=EDGE_COLOR, label="cached-free block"))
    if scale["limit_shown"]:
        ax.axhline(kv["num_blocks"], **CAPACITY_STYLE)
        handles.append(_limit_line("capacity (all blocks)", CAPACITY_STYLE))
        title = f"KV cache occupancy (capacity {kv['num_blocks']} blocks)"
    else:
        title = f"KV cache occupancy (capacity {kv['num_blocks']} blocks, above this scale)"
    ax.set_ylim(0, scale["top"])
    ax.set_ylabel("KV blocks", fontsize=st.small)
    ax.tick_params(labelsize=st.small)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=4, integer=True))
    ax.set_title(title, fontsize=st.font, loc="left")
    if legend:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=st.small, frameon=False)
    return {**kv, "ax": ax, "shown": int(keep.sum()), "top": scale["top"], "legend": handles}


@styled
def draw_throughput(traces, ax=None, upto=None, highlight=None, xlim=None, legend=True, top=None) -> dict:
    """Tokens per step as bars stacked by phase, on an axis fitted to the run (``top`` fixes it instead);
    the token budget as a dashed line when it is near that range; spikes above the axis get a triangle.
    Returns tokens_per_step(...) plus "ax", "shown", "top", "clipped" (steps off the scale), "legend"."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator
    traces = as_traces(traces)
    st = style()
    ax = new_axes(ax, (8, 3))
    tok = tokens_per_step(traces)
    keep = _window(ax, tok["steps"], upto, highlight, xlim)
    budget = float(tok["budget"].max())
    scale = throughput_scale(tok["total"], budget) if top is None else \
        {"top": float(top), "limit_shown": budget <= top, "clipped": tok["total"].max() > top,
         "max": float(tok["total"].max())}
    bottom, handles = np.zeros(int(keep.sum())), []
    for phase in ("decode", "prefill", "resumed"):
        if tok[phase].any():
            ax.bar(tok["steps"][keep], tok[phase][keep], bottom=bottom, width=0.8, color=PHASE_COLORS[phase])
            handles.append(Patch(facecolor=PHASE_COLORS[phase], label=f"{phase} tokens"))
        bottom += tok[phase][keep]
    if scale["limit_shown"]:
        ax.step(tok["steps"], tok["budget"], where="mid", **BUDGET_STYLE)
        handles.append(_limit_line("token budget", BUDGET_STYLE))
        title = "tokens in the flat batch"
    else:
        title = f"tokens in the flat batch (budget {int(budget)}, above this scale)"
    lo, hi = xlim or (tok["steps"][0], tok["steps"][-1])
    shown = tok["steps"][keep]
    over = shown[(bottom > scale["top"]) & (shown >= lo) & (shown <= hi)]   # markers are not clipped: keep
    if len(over):
        ax.plot(over, np.full(len(over), scale["top"]), linestyle="none", marker="^", color="black",
                markersize=st.small * 0.6, clip_on=False, zorder=6)
    if scale["clipped"]:
        handles.append(Line2D([], [], linestyle="none", marker="^", color="black",
                              label=f"step above the scale (max {int(scale['max'])})"))
    ax.set_ylim(0, scale["top"])
    ax.yaxis.set_major_locator(MaxNLocator(nbins=4, integer=True))
    ax.set_ylabel("tokens / step", fontsize=st.small)
    ax.set_xlabel("iteration (engine step)", fontsize=st.small)
    ax.tick_params(labelsize=st.small)
    ax.set_title(title, fontsize=st.font, loc="left")
    if legend:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=st.small, frameon=False)
    return {**tok, "ax": ax, "shown": int(keep.sum()), "top": scale["top"], "clipped": over.tolist(),
            "legend": handles}


def legend_columns(fig, handles, size: float) -> int:
    """How many legend columns fit across ``fig`` at font ``size``."""
    from minibatch.viz.common import text_width_pt
    widest = max((text_width_pt(h.get_label(), size) for h in handles), default=1.0) + 3.5 * size
    return max(1, min(len(handles), int(fig.get_figwidth() * 72 * 0.95 // widest)))


def merge_handles(*groups) -> list:
    """One legend from several views' handles: the first handle of each label, in order."""
    out = {}
    for group in groups:
        for h in group:
            out.setdefault(h.get_label(), h)
    return list(out.values())


@styled
def draw_comparison(traces_a, traces_b, labels=("static", "continuous"), fig=None) -> dict:
    """Two runs of one workload in two columns: timeline, KV occupancy, tokens per step.
    Both columns share the x range (the longer run's), the y scales and the sequence colours.
    Returns {"fig", labels[0]: {...}, labels[1]: {...}, "summary": {label: summarize(...)}}."""
    from minibatch.viz.timeline import draw_timeline
    from minibatch.viz.palette import seq_order
    runs = [as_traces(traces_a), as_traces(traces_b)]
    if len(labels) != 2:
        raise ValueError(f"labels must name the two runs, got {labels!r}")
    st = style()
    if fig is None:
        import matplotlib.pyplot as plt
        fig = plt.figure(figsize=figsize_for((14, 8.5)))
    fig.set_layout_engine("constrained")
    grid = fig.add_gridspec(3, 2, height_ratios=[2.2, 1, 1])
    order = seq_order(runs[0] + runs[1])                 # one colour per request across both runs
    first, last = min(r[0].step for r in runs), max(r[-1].step for r in runs)
    both = runs[0] + runs[1]
    kv, tok = kv_usage(both), tokens_per_step(both)
    kv_top = fit_scale(float((kv["used"] + kv["cached_free"]).max()), kv["num_blocks"])["top"]
    tok_top = throughput_scale(tok["total"], float(tok["budget"].max()))["top"]
    from matplotlib.ticker import MaxNLocator
    out, handles = {"fig": fig, "summary": {}}, []
    for col, (run, label) in enumerate(zip(runs, labels)):
        s = summarize(run)
        axes = [fig.add_subplot(grid[row, col]) for row in range(3)]
        res = {"timeline": draw_timeline(run, ax=axes[0], legend=False, order=order),
               "kv": draw_kv_usage(run, ax=axes[1], xlim=(first, last), legend=False, top=kv_top),
               "throughput": draw_throughput(run, ax=axes[2], xlim=(first, last), legend=False, top=tok_top)}
        axes[0].set_xlim(first - 0.6, last + 0.6)
        axes[0].xaxis.set_major_locator(MaxNLocator(nbins=10, integer=True))   # both tick the same steps
        handles += res["timeline"]["legend"] + res["kv"]["legend"] + [   # bars wear the phase colours already listed
            h for h in res["throughput"]["legend"] if not h.get_label().endswith(" tokens")]
        axes[0].set_title(f"{label}: {s['steps']} steps, {s['tokens_per_step']:.1f} tokens/step, "
                          f"KV {100 * s['kv_used_fraction']:.0f}% used", fontsize=st.font, loc="left")
        out[label], out["summary"][label] = res, s
    handles = merge_handles(handles)
    fig.legend(handles=handles, loc="outside lower center", ncols=legend_columns(fig, handles, st.small),
               fontsize=st.small, frameon=False)
    return out
