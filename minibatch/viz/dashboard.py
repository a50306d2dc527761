"""The dashboard: everything about one engine step on one slide.

    +-------------------------------------+------------------------+
    | batch membership timeline           | KV block pool          |
    | (cells through this step, framed)   | (owner colours, xN)    |
    +-------------------------------------+------------------------+
    | KV occupancy over steps             | block tables           |
    | tokens per step vs token budget     | (logical -> physical)  |
    +-------------------------------------+------------------------+
                       phase legend (one row)

The title line reads the step like a log line: who ran, who waited, who was
preempted or finished, and how full the token budget and the pool were.
The animation and the widgets redraw exactly this, one step per frame.
"""
from __future__ import annotations

from minibatch.viz.blocks import draw_block_tables, draw_blocks, pool_legend_handles, pool_title
from minibatch.viz.common import DASHBOARD_SIZE, FONT_SIZE, SMALL_FONT, as_traces, find_step, seq_order
from minibatch.viz.timeline import draw_timeline
from minibatch.viz.usage import draw_kv_usage, draw_throughput, usage_legend_handles


def step_title(t) -> str:
    """One line about a step, e.g. 'step 4 · continuous · 3 in batch, 2 waiting · 7/12 tokens · ...'."""
    parts = [f"step {t.step}", f"{t.scheduling} batching",
             f"{len(t.scheduled)} in batch, {len(t.waiting)} waiting",
             f"{t.num_batched_tokens}/{t.token_budget} tokens",
             f"{t.num_blocks - t.num_free_blocks}/{t.num_blocks} blocks used"]
    if t.preempted:
        parts.append("preempted: " + ", ".join(t.preempted))
    if t.finished:
        parts.append("finished: " + ", ".join(t.finished))
    if t.num_padding_slots:
        parts.append(f"{t.num_padding_slots} padding slots")
    return "  ·  ".join(parts)


def draw_step(traces, step: int, fig=None) -> dict:
    """Draw the dashboard of ``step`` onto ``fig`` (cleared first; a new pyplot
    figure when None). Returns {"fig", "step", "timeline", "blocks", "tables",
    "kv", "throughput"}: each view's own inspectable result."""
    traces = as_traces(traces)
    t = find_step(traces, step)
    if fig is None:
        import matplotlib.pyplot as plt
        fig = plt.figure(figsize=DASHBOARD_SIZE)
    fig.clear()
    order = seq_order(traces)
    grid = fig.add_gridspec(4, 2, width_ratios=[1.45, 1], height_ratios=[1, 1, 0.8, 0.8],
                            left=0.06, right=0.98, top=0.9, bottom=0.2, hspace=0.8, wspace=0.12)
    timeline = draw_timeline(traces, ax=fig.add_subplot(grid[0:2, 0]), upto=step, highlight=step,
                             legend=False, order=order)
    timeline["ax"].set_title("batch membership (framed: this step)", fontsize=FONT_SIZE, loc="left")
    kv = draw_kv_usage(traces, ax=fig.add_subplot(grid[2, 0]), upto=step, highlight=step)
    throughput = draw_throughput(traces, ax=fig.add_subplot(grid[3, 0]), upto=step, highlight=step)
    for res in (kv, throughput):
        res["ax"].get_legend().remove()                    # the shared legend below says it all
    kv["ax"].tick_params(labelbottom=False)
    throughput["ax"].set_xlabel("")
    blocks = draw_blocks(traces, step, ax=fig.add_subplot(grid[0:2, 1]), order=order)
    blocks["ax"].get_legend().remove()
    blocks["ax"].set_title(pool_title(blocks["counts"]), fontsize=FONT_SIZE, loc="left")
    tables = draw_block_tables(traces, step, ax=fig.add_subplot(grid[2:4, 1]), order=order)
    fig.suptitle(step_title(t), fontsize=FONT_SIZE + 1, x=0.01, ha="left", fontweight="bold")
    handles = {}                                           # one legend for every view, by label
    for h in timeline["legend"] + usage_legend_handles() + pool_legend_handles():   # timeline's: whole run
        handles.setdefault(h.get_label(), h)
    fig.legend(handles=list(handles.values()), loc="lower center", ncols=6, fontsize=SMALL_FONT, frameon=False)
    return {"fig": fig, "step": step, "timeline": timeline, "blocks": blocks, "tables": tables,
            "kv": kv, "throughput": throughput}

