"""The dashboard: everything about one engine step on one slide.

    step 4 · continuous batching · 3 in batch, 2 waiting · 7/12 tokens · ...
    +-------------------------------------+------------------------+
    | batch membership timeline           | KV block pool          |
    | (cells through this step, framed)   | (owner colours, xN)    |
    +-------------------------------------+------------------------+
    | KV occupancy over steps             | block tables           |
    | tokens per step vs token budget     | (logical -> physical)  |
    +-------------------------------------+------------------------+
              one legend: only what occurs in this run

An asynchronously scheduled run gets a fifth row under the left column: its CPU and model lanes on the wall
clock through the step (``draw_lanes``), where the overlap shows. A run that verified token trees gets a third column, the **token tree** of
one sequence (``draw_tree``: the accepted path coloured, the target's token
after it), in every frame, so an animation does not jump: a step without a
tree (the prefill) says so in it. A run recorded with ``prefix_cache="radix"`` gets the **radix tree** in that
column (``draw_radix_tree``: a node per token run, its blocks and lock_ref, evictable leaves hatched), beside the
block tables whose block ids its boxes name; a run with both stacks the token tree over the radix tree.

The title line reads the step like a log line: who ran, who waited, who was
preempted or finished, how full the token budget and the pool were, and, for
a speculative run, that it speculates, with which proposer and k.
The animation and the widgets redraw exactly this, one step per frame.

Matplotlib's constrained layout places titles, labels and the legend around
each other at any size; on runs longer than ``window`` steps the three
left panels follow a window around the current step, so a step stays a cell
you can see rather than a few pixels.
"""
from __future__ import annotations

from minibatch.trace import TraceRecorder
from minibatch.viz.blocks import draw_block_tables, draw_blocks, pool_title
from minibatch.viz.host_pool import has_host_pool
from minibatch.viz.common import (as_traces, dashboard_size, figsize_for, find_step, has_radix_tree, has_trees,
                                  style, styled, wrap_title)
from minibatch.viz.palette import seq_order
from minibatch.viz.lanes import draw_lanes, has_lanes
from minibatch.viz.timeline import draw_timeline, run_title
from minibatch.viz.usage import draw_kv_usage, draw_throughput, legend_columns, merge_handles

WINDOW = 40          # steps the timeline shows at once on a long run


def step_title(t, run: str = None) -> str:
    """One line about a step, e.g. 'step 4 · continuous batching · 3 in batch, 2 waiting · 7/12 tokens · ...'.
    ``run`` (run_title) replaces '<scheduling> batching', e.g. to say the run speculates."""
    parts = [f"step {t.step}", run or f"{t.scheduling} batching",
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


def _tree_panel(traces, t, ax, order, tree_seq):
    """The token tree of ``tree_seq`` (None: the first sequence in the batch that verified one), or a note."""
    from minibatch.viz.tree import draw_tree
    st = style()
    trees = [s.seq_id for s in t.scheduled if s.draft_parents]
    if tree_seq in trees or (tree_seq is None and trees):
        result = draw_tree(traces, t.step, tree_seq or trees[0], ax=ax, legend=False, order=order)
        return result
    why = "prefill" if all(s.phase != "decode" for s in t.scheduled) else "no drafts verified"
    who = f" for {tree_seq}" if tree_seq is not None else ""
    ax.text(0.5, 0.5, f"no token tree{who} this step\n({why})", ha="center", va="center", fontsize=st.font,
            color="#767676", transform=ax.transAxes)
    ax.set_axis_off()
    return None


def _radix_panel(traces, t, ax):
    """The radix tree after the step (viz/radix_tree.py), or a note for a step that recorded none."""
    from minibatch.viz.radix_tree import draw_radix_tree
    if t.radix_nodes:
        return draw_radix_tree(traces, t.step, ax=ax)
    ax.text(0.5, 0.5, "no radix tree recorded this step", ha="center", va="center", fontsize=style().font,
            color="#767676", transform=ax.transAxes)
    ax.set_axis_off()
    return None


@styled
def draw_step(traces, step: int, fig=None, window: int = WINDOW, meta=None, tree_seq=None) -> dict:
    """Draw the dashboard of ``step`` onto ``fig`` (cleared first; a new pyplot
    figure when None). ``meta`` (or a TraceRecorder's own) names a speculative
    run's proposer in the title. A run with token trees adds the tree panel (of
    ``tree_seq``, None: the first sequence in the batch with a tree). Returns
    {"fig", "step", "timeline", "blocks", "tables", "kv", "throughput", "tree", "radix_tree", "lanes",
    "legend"}: each view's own inspectable result ("tree" None without one, "radix_tree" None unless the run was
    recorded with prefix_cache="radix", "lanes" None unless the run was scheduled asynchronously)."""
    meta = meta if meta is not None else getattr(traces, "meta", None) if isinstance(traces, TraceRecorder) else None
    traces = as_traces(traces)
    t = find_step(traces, step)
    st = style()
    if fig is None:
        import matplotlib.pyplot as plt
        fig = plt.figure(figsize=figsize_for(dashboard_size(traces)))
    fig.clear()
    fig.set_layout_engine("constrained")
    order = seq_order(traces)
    trees, radix = has_trees(traces), has_radix_tree(traces)
    lanes_row = has_lanes(traces)
    heights = [1, 1, 0.8, 0.8] + ([0.8] if lanes_row else [])
    ratios = [1.3, 0.8, 1.0] if trees or radix else [1.45, 1]
    if trees or radix:   # the trees in a gridspec of their own: titles and labels leave the other panels' rows alone
        outer = fig.add_gridspec(1, 2, width_ratios=[ratios[0] + ratios[1], ratios[2]])
        grid = outer[0].subgridspec(len(heights), 2, width_ratios=ratios[:2], height_ratios=heights)
        column = outer[0, 1].subgridspec(2, 1) if trees and radix else None
    else:
        grid = fig.add_gridspec(len(heights), 2, width_ratios=ratios, height_ratios=heights)
    timeline = draw_timeline(traces, ax=fig.add_subplot(grid[0:2, 0]), upto=step, highlight=step,
                             legend=False, order=order, window=window)
    first, last = timeline["xlim"]
    whole = (first, last) == (traces[0].step, traces[-1].step)
    timeline["ax"].set_title("batch membership (framed: this step" + ("" if whole else
                             f"; steps {first}-{last} of {traces[0].step}-{traces[-1].step}") + ")",
                             fontsize=st.font, loc="left")
    kv = draw_kv_usage(traces, ax=fig.add_subplot(grid[2, 0]), upto=step, highlight=step, xlim=(first, last),
                       legend=False)
    throughput = draw_throughput(traces, ax=fig.add_subplot(grid[3, 0]), upto=step, highlight=step,
                                 xlim=(first, last), legend=False)
    kv["ax"].tick_params(labelbottom=False)
    throughput["ax"].set_xlabel("")
    if has_host_pool(traces):            # the host pool beside the device pool (viz/host_pool.py)
        pools = grid[0:2, 1].subgridspec(1, 2)
        blocks = draw_blocks(traces, step, ax=fig.add_subplot(pools[0, 0]), order=order, legend=False,
                             host_ax=fig.add_subplot(pools[0, 1]))
    else:
        blocks = draw_blocks(traces, step, ax=fig.add_subplot(grid[0:2, 1]), order=order, legend=False)
    pool = [pool_title(blocks["counts"]), f"(block = row + column, {t.block_size} tokens each)"]
    if trees or radix or blocks["host"] is not None:   # a narrower column: break the lines before the next panel's
        width = fig.get_figwidth() * 72 * ratios[1] / sum(ratios) * 0.92 / (2 if blocks["host"] else 1)
        pool = [wrap_title(line, width, st.font, sep=", ", weight="normal") for line in pool]
    blocks["ax"].set_title("\n".join(pool), fontsize=st.font, loc="left")
    if trees or radix:
        blocks["ax"].set_anchor("N")     # equal aspect in a narrower column: keep its title where the layout put it
    tables = draw_block_tables(traces, step, ax=fig.add_subplot(grid[2:len(heights), 1]), order=order)
    lanes = None
    if lanes_row:                        # an asynchronous run: the CPU and model lanes through this step
        lanes = draw_lanes(traces, ax=fig.add_subplot(grid[4, 0]), upto=step, legend=False,
                           title="CPU and model lanes through this step (wall clock)")
    tree = _tree_panel(traces, t, fig.add_subplot(column[0] if radix else outer[0, 1]), order, tree_seq) \
        if trees else None
    radix_tree = _radix_panel(traces, t, fig.add_subplot(column[1] if trees else outer[0, 1])) if radix else None
    fig.suptitle(wrap_title(step_title(t, run_title(traces, meta)), fig.get_figwidth() * 72 * 0.97, st.headline),
                 fontsize=st.headline, x=0.01, ha="left", fontweight="bold")
    # one legend for every view, whole-run entries only (stable across frames); the tokens panel's bars
    # wear the phase colours, already in the timeline's entries
    extra = [h for h in throughput["legend"] if not h.get_label().endswith(" tokens")]
    if trees:
        from minibatch.viz.tree import legend_handles as tree_handles
        extra = extra + tree_handles()
    if radix:
        from minibatch.viz.radix_tree import legend_handles as radix_handles
        extra = extra + radix_handles()
    handles = merge_handles(timeline["legend"], kv["legend"], extra, blocks["legend"], lanes["legend"] if lanes else [])
    fig.legend(handles=handles, loc="outside lower center", ncols=legend_columns(fig, handles, st.small),
               fontsize=st.small, frameon=False)
    return {"fig": fig, "step": step, "timeline": timeline, "blocks": blocks, "tables": tables,
            "kv": kv, "throughput": throughput, "tree": tree, "radix_tree": radix_tree, "lanes": lanes,
            "legend": handles}
