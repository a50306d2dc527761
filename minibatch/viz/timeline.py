"""The batch membership timeline: who was in the batch at every iteration.

Iteration-level scheduling (Orca, Yu et al., OSDI'22, §3.1) is easiest to see
as a grid: engine steps on x, sequences on y, one cell per (sequence, step)
coloured by what the sequence did in that step:

    waiting -> prefill chunk(s) -> decode, decode, ... -> finished
                    |-> preempted -> waiting -> resumed (recompute) -> decode ...

Static batching shows its waste as **padding** cells: a finished member keeps
its batch slot until the whole batch is done, and nobody is admitted
meanwhile. A speculative decode cell is split into k+1 slivers: the accepted
draft tokens, the rejected ones (empty), and the token the target model adds
(the bonus token when all k were accepted, else the correction).

Every cell is derived from the trace lists alone (``scheduled``, ``preempted``,
``waiting``, ``running``, ``finished``, ``admitted``), see ``timeline_cells``.

Cells are added with ``add_artist``, not ``add_patch``: the limits are set
explicitly, and skipping matplotlib's per-patch data-limit update halves the
time of a frame (what a widget redraw costs).

On a long run the whole run in one panel makes every step a few pixels wide:
``window=n`` shows n steps around the highlighted one instead (three quarters
behind it, a quarter ahead), so an animation scrolls with the current step.
Row labels and step ticks are thinned to what fits at the preset's text size,
and the "accepted/proposed" numbers over speculative cells appear only where
they fit their cell.
"""
from __future__ import annotations

import math

from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from minibatch.viz.common import (PHASE_COLORS, PHASE_LABELS, SPEC_REJECTED_COLOR, SPEC_TARGET_COLOR, as_traces,
                                  axes_size_pt, new_axes, short_label, style, styled, text_color_on, text_width_pt)
from minibatch.viz.palette import seq_color, seq_order


def timeline_cells(traces) -> dict:
    """{(seq id, step): phase} for every sequence from its first appearance on.

    Precedence in one step: scheduled phase > preempted > waiting > running but
    not scheduled ("forked" the step a parallel-sampling child appears, else
    "stalled") > gone after finishing ("padding" while a static batch still
    holds its slot, else "finished").
    """
    traces = as_traces(traces)
    cells, known, done = {}, [], {}            # done: seq id -> step it finished (or vanished)
    batch_formed_after = {}                    # static: seq id -> a batch was formed after it finished
    for t in traces:
        sched = {s.seq_id: s.phase for s in t.scheduled}
        new = []
        for sid in list(sched) + list(t.preempted) + list(t.running) + list(t.waiting):
            if sid not in known:
                known.append(sid)
                new.append(sid)
        if t.admitted:                         # static: a new batch frees every padding slot
            for sid in done:
                batch_formed_after[sid] = True
        preempted, waiting, running = set(t.preempted), set(t.waiting), set(t.running)
        admitted = set(t.admitted)             # admitted but given no tokens this step: "stalled", not a fork
        for sid in known:
            if sid in sched:                       # (may also be preempted: see preempted_cells)
                phase = sched[sid]
            elif sid in preempted:
                phase = "preempted"
            elif sid in waiting:
                phase = "waiting"
            elif sid in running:                   # born running, not admitted: a fork sharing its parent's
                phase = "forked" if sid in new and sid not in admitted else "stalled"   # blocks
            elif sid in done:
                static_slot = t.scheduling == "static" and not batch_formed_after.get(sid)
                phase = "padding" if static_slot else "finished"
            else:                              # left without a "finished" entry (aborted): gone too
                done[sid] = t.step
                phase = "finished"
            cells[(sid, t.step)] = phase
        for sid in t.finished:
            done.setdefault(sid, t.step)
    return cells


def preempted_cells(traces) -> set:
    """{(seq id, step)} of every preemption. A sequence can be preempted and
    readmitted in one step (its freed blocks still in the prefix cache): its
    cell then shows the phase it ran with a preempted sliver in front."""
    return {(sid, t.step) for t in as_traces(traces) for sid in t.preempted}


def speculation(traces) -> dict:
    """{(seq id, step): (accepted, proposed, bonus)} for every speculative decode."""
    return {(s.seq_id, t.step): (s.accepted, s.proposed, s.bonus)
            for t in as_traces(traces) for s in t.scheduled if s.proposed > 0}


def _spec_slivers(ax, left, bottom, width, height, accepted, proposed):
    """k+1 vertical slivers: accepted drafts, rejected drafts, then the target's token."""
    w = width / (proposed + 1)
    colors = [PHASE_COLORS["decode"]] * accepted + [SPEC_REJECTED_COLOR] * (proposed - accepted) + [SPEC_TARGET_COLOR]
    return [ax.add_artist(Rectangle((left + i * w, bottom), w, height, facecolor=c,
                                   edgecolor=PHASE_COLORS["decode"], linewidth=0.6))
            for i, c in enumerate(colors)]


def legend_handles(cells: dict, spec: dict, preempted=()) -> list:
    """Legend entries for the phases that occur (in PHASE_COLORS order), plus speculation. ``preempted``
    (preempted_cells): a preemption drawn only as a sliver (readmitted in the same step) still gets its entry."""
    phases = set(cells.values()) | ({"preempted"} if set(preempted) & set(cells) else set())
    present = [p for p in PHASE_COLORS if p in phases]
    handles = [Patch(facecolor=PHASE_COLORS[p], edgecolor="#CCCCCC" if p == "finished" else "none",
                     hatch="//" if p == "padding" else None, label=PHASE_LABELS[p]) for p in present]
    if spec:
        handles += [Patch(facecolor=SPEC_REJECTED_COLOR, edgecolor=PHASE_COLORS["decode"], label="rejected draft"),
                    Patch(facecolor=SPEC_TARGET_COLOR, label="target's token")]
    return handles


def step_window(steps: list, center, window) -> tuple:
    """(first, last) step shown: all of ``steps`` while they are at most 1.5 ``window``, else ``window`` of
    them around ``center`` (three quarters behind it, a quarter ahead), clamped to the run."""
    lo, hi = steps[0], steps[-1]
    if not window or hi - lo + 1 <= 1.5 * window or center is None:
        return lo, hi
    first = min(max(lo, center - (3 * window) // 4), hi - window + 1)
    return first, first + window - 1


def run_title(traces, meta=None) -> str:
    """'continuous batching', or '... + speculative decoding (draft model, k = 3)' when drafts were verified,
    or '... + tree speculation (EAGLE-2 dynamic tree, up to 16 drafts)' when they were token trees. The method and k come from the trace (``StepTrace.speculative_method``), else from ``meta``
    (TraceRecorder.meta, for traces recorded before the trace carried them), else k is the longest proposal."""
    traces = as_traces(traces)
    title = f"{traces[0].scheduling} batching"
    k = max((s.proposed for t in traces for s in t.scheduled), default=0)
    if k:
        spec = dict((meta or {}).get("speculative") or {})
        last = traces[-1]
        method = getattr(last, "speculative_method", None) or spec.get("method")
        method = {"draft": "draft model", "ngram": "n-gram lookup"}.get(method, method)
        if any(s.draft_parents for t in traces for s in t.scheduled):      # a token tree: N drafts, not a chain
            from minibatch.viz.tree_data import tree_label
            return title + f" + tree speculation ({tree_label(method)}, up to {k} drafts)"
        k = getattr(last, "num_speculative_tokens", 0) or spec.get("num_speculative_tokens", k)
        title += f" + speculative decoding ({method + ', ' if method else ''}k = {k})"
    return title


@styled
def draw_timeline(traces, ax=None, upto=None, highlight=None, legend=True, order=None, window=None) -> dict:
    """Draw the membership timeline; cells only through step ``upto`` (an animation
    does not show the future), the x range covers the whole run, or ``window``
    steps around ``highlight`` (``upto``) on longer runs; the column of step
    ``highlight`` is framed. ``order`` (a seq_order dict) fixes rows and colours,
    e.g. to share them between two runs.

    Returns {"ax", "rows": [seq ids, top to bottom], "cells": {(seq, step): phase},
             "patches": {(seq, step): [Rectangle]}, "spec": {...}, "highlight": step or None,
             "xlim": (first, last) step shown}.
    """
    traces = as_traces(traces)
    st = style()
    ax = new_axes(ax, (13, 5))
    steps = [t.step for t in traces]
    for name, value in (("upto", upto), ("highlight", highlight)):
        if value is not None and value not in steps:
            raise ValueError(f"{name}={value} is not a step of the trace (steps {steps[0]}..{steps[-1]})")
    first, last = step_window(steps, highlight if highlight is not None else upto, window)
    order = order or seq_order(traces)
    all_cells = timeline_cells(traces)
    rows = sorted({sid for sid, _ in all_cells}, key=order.get)
    y_of = {sid: i for i, sid in enumerate(rows)}
    spec = speculation(traces)
    w_pt, h_pt = axes_size_pt(ax)
    cell_pt = w_pt / (last - first + 1.2)
    widest = max([f"{a}/{p}" for a, p, _ in spec.values()] or [""], key=len)
    # "2/3" goes above a speculative cell, in room made by shorter cells; only where it fits
    annotate = bool(spec) and cell_pt >= text_width_pt(widest, st.small) + 2 \
        and h_pt / max(len(rows), 1) >= 2.4 * st.small
    top, height = (-0.22, 0.62) if annotate else (-0.4, 0.8)
    preempted = preempted_cells(traces)
    cells, patches = {}, {}
    for (sid, step), phase in all_cells.items():
        if upto is not None and step > upto:
            continue
        cells[(sid, step)] = phase
        if not first <= step <= last:                     # outside the window: known, not drawn
            continue
        x, y = step, y_of[sid]
        left, width, drawn = x - 0.45, 0.9, []
        if (sid, step) in preempted and phase != "preempted":       # preempted, then ran again
            drawn.append(ax.add_artist(Rectangle((left, y + top), 0.3, height,
                                                facecolor=PHASE_COLORS["preempted"], edgecolor="none")))
            left, width = left + 0.3, width - 0.3
        if (sid, step) in spec and phase == "decode":
            accepted, proposed, _ = spec[(sid, step)]
            drawn += _spec_slivers(ax, left, y + top, width, height, accepted, proposed)
            if annotate:
                ax.text(x, y + top - 0.02, f"{accepted}/{proposed}", ha="center", va="bottom",
                        fontsize=st.small)
        else:
            drawn.append(ax.add_artist(Rectangle(
                (left, y + top), width, height, facecolor=PHASE_COLORS[phase],
                edgecolor="#CCCCCC" if phase == "finished" else "none",
                hatch="//" if phase == "padding" else None)))
        patches[(sid, step)] = drawn
    frame = None
    if highlight is not None:
        frame = ax.add_artist(Rectangle((highlight - 0.5, -0.9), 1.0, len(rows) + 0.45, fill=False,
                                       edgecolor="black", linewidth=2.5, zorder=5))
    ax.set_xlim(first - 0.6, last + 0.6)
    ax.set_ylim(len(rows) - 0.4, -0.95)
    # y labels carry the sequence's identity colour, the one the block views use
    label_every = max(1, math.ceil(st.small * 1.6 / max(h_pt / max(len(rows), 1), 1e-6)))
    ax.set_yticks(range(0, len(rows), label_every), [short_label(r) for r in rows[::label_every]],
                  fontsize=st.small)
    for label, sid in zip(ax.get_yticklabels(), rows[::label_every]):
        color = seq_color(sid, order)
        label.set_bbox(dict(facecolor=color, edgecolor="none", pad=1.5))
        label.set_color(text_color_on(color))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=max(2, int(w_pt / text_width_pt(f"{last}  ", st.small))),
                                           integer=True))
    ax.tick_params(labelsize=st.small, length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("iteration (engine step)", fontsize=st.font)
    ax.set_title(f"batch membership ({run_title(traces)})", fontsize=st.font, loc="left")
    handles = legend_handles(all_cells, spec, preempted)
    if legend:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=st.small,
                  frameon=False, borderaxespad=0.3)
    return {"ax": ax, "rows": rows, "cells": cells, "patches": patches, "spec": spec,
            "highlight": highlight, "highlight_artist": frame, "legend": handles, "xlim": (first, last)}
