"""What every view shares: the trace as input, the colours, the fonts.

Every renderer in ``minibatch.viz`` reads only ``StepTrace`` data (the list a
``TraceRecorder`` keeps, or one loaded from JSON), so a run recorded once
replays anywhere without a model.

Colours carry meaning and must survive colour blindness and a projector:

* **phases** (what a sequence did in an iteration) use the Okabe–Ito palette
  (Okabe & Ito 2008, "Color Universal Design"), plus greys for "not running";
* **sequence identity** (who owns a block) uses Paul Tol's *muted* qualitative
  scheme, indexed by the order in which a sequence first appears in the
  trace, never by ``hash()`` (which changes between Python processes), so a
  request has the same colour in the block view, the block tables and the
  timeline of every frame.
"""
from __future__ import annotations

import pathlib
from typing import Union

from minibatch.trace import StepTrace, TraceRecorder

# -- phases: what a sequence was doing in one iteration ---------------------------
# Every cell of the timeline is one of these; the first three are SeqStep.phase.
PHASE_COLORS = {
    "prefill": "#0072B2",     # Okabe–Ito blue: a chunk of the prompt goes through the model
    "decode": "#009E73",      # bluish green: one new token (1 + k when speculating)
    "resumed": "#CC79A7",     # reddish purple: recomputing the KV of a preempted sequence
    "preempted": "#D55E00",   # vermillion: lost its blocks this step, back to waiting
    "forked": "#56B4E9",      # sky blue: a parallel-sampling child, born sharing its parent's blocks
    "stalled": "#F0E442",     # yellow: running (holds blocks) but not scheduled, budget spent
    "padding": "#E69F00",     # orange: static batching, finished but still holding a batch slot
    "waiting": "#BDBDBD",     # grey: arrived, not admitted yet (queueing delay)
    "finished": "#F0F0F0",    # almost background: done, its blocks are back in the pool
}
PHASE_LABELS = {
    "prefill": "prefill chunk", "decode": "decode", "resumed": "resumed (recompute)",
    "preempted": "preempted", "forked": "forked (n > 1)", "stalled": "running, not scheduled",
    "padding": "padding slot (static)", "waiting": "waiting", "finished": "finished",
}
SPEC_REJECTED_COLOR = "#FFFFFF"    # a rejected draft token: an empty sliver in a decode cell

# -- block pool states --------------------------------------------------------------
FREE_COLOR = "#FFFFFF"
CACHED_FREE_COLOR = "#DDDDDD"      # ref count 0 but still holding a prefix-cache entry: reusable
EDGE_COLOR = "#777777"
UNKNOWN_OWNER_COLOR = "#444444"    # ref count > 0 but in no live block table (should not happen)

# Paul Tol's "muted" scheme: 9 colours distinguishable under the common colour-vision deficiencies.
SEQ_PALETTE = ["#CC6677", "#332288", "#DDCC77", "#117733", "#88CCEE",
               "#882255", "#44AA99", "#999933", "#AA4499"]

FONT_SIZE = 11          # legible on a slide at figsize ~ (13, 7)
SMALL_FONT = 10         # the smallest text any view draws
DASHBOARD_SIZE = (13, 7.5)


class TraceError(ValueError):
    """The input is not a usable trace (empty, wrong type, or the step is not in it)."""


TraceLike = Union[StepTrace, list, tuple, TraceRecorder, str, pathlib.Path]


def as_traces(traces: TraceLike) -> list:
    """A list of StepTrace from a list, a TraceRecorder, one StepTrace, or a saved JSON path."""
    if isinstance(traces, (str, pathlib.Path)):
        traces = TraceRecorder.load(traces)
    if isinstance(traces, TraceRecorder):
        traces = traces.traces
    if isinstance(traces, StepTrace):
        traces = [traces]
    if not isinstance(traces, (list, tuple)):
        raise TypeError(f"expected StepTrace(s), a TraceRecorder or a trace file, got {type(traces).__name__}")
    bad = [type(t).__name__ for t in traces if not isinstance(t, StepTrace)]
    if bad:
        raise TypeError(f"expected a list of StepTrace, found {bad[0]} in it")
    if not traces:
        raise TraceError("the trace is empty: record at least one engine step")
    return list(traces)


def find_step(traces: list, step: int) -> StepTrace:
    """The trace whose ``.step`` is ``step`` (step numbers, not list positions: a
    recorder attached mid-run starts at a later step)."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    for t in traces:
        if t.step == step:
            return t
    raise TraceError(f"step {step} is not in the trace (it has steps {traces[0].step}..{traces[-1].step})")


def evicted_blocks(traces: TraceLike, step: int) -> set:
    """Blocks whose prefix-cache entry ended in ``step``: cached after the step before, not after this one.
    An entry ends only when its block is taken for other tokens (eviction, vLLM §4.3), so the trace
    shows it without a field of its own. The first step has no step before: nothing was cached yet."""
    traces = as_traces(traces)
    i = traces.index(find_step(traces, step))
    return set(traces[i - 1].cached_blocks) - set(traces[i].cached_blocks) if i else set()


def seq_order(traces: TraceLike) -> dict:
    """seq id -> 0, 1, 2, ... in order of first appearance (batch order, then
    running, then waiting within a step). The stable index behind seq_color."""
    order: dict = {}
    for t in as_traces(traces):
        for sid in ([s.seq_id for s in t.scheduled] + list(t.preempted) + list(t.running)
                    + list(t.block_tables) + list(t.waiting) + list(t.finished)):
            order.setdefault(sid, len(order))
    return order


def seq_color(seq_id: str, order) -> tuple:
    """The RGBA colour of a sequence in every view. ``order`` is seq_order(...)
    or the traces themselves; ids beyond the palette cycle through it."""
    from matplotlib.colors import to_rgba               # here, so text-only users never load matplotlib
    if not isinstance(order, dict):
        order = seq_order(order)
    if seq_id not in order:
        raise KeyError(f"sequence {seq_id!r} never appears in the trace")
    return to_rgba(SEQ_PALETTE[order[seq_id] % len(SEQ_PALETTE)])


def short_label(seq_id: str, width: int = 10) -> str:
    """A sequence id fit for a row label: long ids keep head and tail: "longname_request_0" -> "longn…st_0"."""
    seq_id = str(seq_id)
    if len(seq_id) <= width:
        return seq_id
    tail = max(3, width // 2 - 1)
    return f"{seq_id[:width - tail - 1]}\u2026{seq_id[-tail:]}"


def text_color_on(rgba) -> str:
    """Black or white, whichever reads better on a fill (relative luminance, WCAG 2)."""
    r, g, b = rgba[:3]
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.45 else "white"


def new_axes(ax, figsize):
    """``ax`` itself, or a fresh pyplot Axes (so it shows in a notebook) when None."""
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt
    return plt.subplots(figsize=figsize)[1]
