"""What every view shares: the trace as input, the phase colours, the size presets.

Every renderer in ``minibatch.viz`` reads only ``StepTrace`` data (the list a
``TraceRecorder`` keeps, or one loaded from JSON), so a run recorded once
replays anywhere without a model.

Colours carry meaning and must survive colour blindness and a projector:
**phases** (what a sequence did in an iteration) use the Okabe–Ito palette
(Okabe & Ito 2008, "Color Universal Design"), plus greys for "not running".
Sequence identity colours live in ``palette`` (they depend on who runs together).

Sizes come in **presets**, because one figure serves two audiences: a notebook
cell read from 50 cm (``"default"``: each renderer's own size, 10–12 pt text)
and a projected slide read from the back of a room (``"slide"``: 1920×1080 px
with no text under 18 px). Every renderer takes ``preset=`` and reads its font
sizes from ``style()`` while it draws, so nested renderers inherit the preset.
"""
from __future__ import annotations

import pathlib
from contextlib import contextmanager
from dataclasses import dataclass
from functools import wraps
from typing import Optional, Union

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
SPEC_TARGET_COLOR = "#00573F"      # the target model's own token in a speculative step (darker decode green)

# -- block pool states --------------------------------------------------------------
FREE_COLOR = "#FFFFFF"
CACHED_FREE_COLOR = "#DDDDDD"      # ref count 0 but still holding a prefix-cache entry: reusable
EDGE_COLOR = "#777777"
UNKNOWN_OWNER_COLOR = "#444444"    # ref count > 0 but in no live block table (should not happen)

# -- size presets ---------------------------------------------------------------------
@dataclass(frozen=True)
class Preset:
    """Sizes of one audience. ``figsize`` None: each renderer's own default size."""
    name: str
    figsize: Optional[tuple]     # inches
    dpi: int                     # pixels per inch when saving or showing a frame
    font: float                  # titles and axis labels, points
    small: float                 # tick labels, legends, text in cells: the smallest text drawn
    headline: float              # the dashboard's one-line title

    def px(self, points: float) -> float:
        return points * self.dpi / 72


PRESETS = {
    "default": Preset("default", None, 100, 11, 10, 12),
    # 1920 x 1080 px; 13.5 pt at 100 dpi is 18.75 px, the smallest text a projected slide may carry
    "slide": Preset("slide", (19.2, 10.8), 100, 16, 13.5, 18),
}
DASHBOARD_SIZE = (13, 7.5)       # the dashboard at the default preset
DASHBOARD_TREE_SIZE = (16, 7.5)  # ... of a run with token trees or a radix tree: a third column, the tree
_current = [PRESETS["default"]]


def style() -> Preset:
    """The preset renderers draw with right now."""
    return _current[-1]


def get_preset(preset) -> Preset:
    if isinstance(preset, Preset):
        return preset
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {list(PRESETS)}")
    return PRESETS[preset]


@contextmanager
def using(preset):
    """``with using("slide"): ...`` draws everything inside at that preset."""
    _current.append(get_preset(preset))
    try:
        yield _current[-1]
    finally:
        _current.pop()


def styled(fn):
    """Give a renderer a ``preset=`` keyword (None: the one in force, e.g. the caller's)."""
    @wraps(fn)
    def wrapper(*args, preset=None, **kwargs):
        if preset is None:
            return fn(*args, **kwargs)
        with using(preset):
            return fn(*args, **kwargs)
    return wrapper


def has_trees(traces) -> bool:
    """Did any sequence verify a token tree in ``traces``? (Then the dashboard has a tree column.)"""
    return any(s.draft_parents for t in as_traces(traces) for s in t.scheduled)


def has_radix_tree(traces) -> bool:
    """Was ``traces`` recorded with ``prefix_cache="radix"``? (Then the dashboard has a radix tree column.)"""
    return any(t.radix_nodes for t in as_traces(traces))


def dashboard_size(traces=None) -> tuple:
    """The dashboard's size at the default preset: wider for a run with token trees or a radix tree."""
    wide = traces is not None and (has_trees(traces) or has_radix_tree(traces))
    return DASHBOARD_TREE_SIZE if wide else DASHBOARD_SIZE


def figsize_for(own: tuple) -> tuple:
    """A renderer's figure size: the preset's, or the renderer's ``own`` default."""
    return style().figsize or own


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
    """``ax`` itself, or a fresh pyplot Axes (so it shows in a notebook) when None, sized by the preset
    and laid out by matplotlib's constrained layout (titles and labels never overlap)."""
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt
    return plt.subplots(figsize=figsize_for(figsize), layout="constrained")[1]


def axes_size_pt(ax) -> tuple:
    """(width, height) of ``ax`` in points, from its current position in the figure."""
    pos, (w, h) = ax.get_position(), ax.figure.get_size_inches()
    return pos.width * w * 72, pos.height * h * 72


def text_width_pt(text: str, size: float, weight: str = "normal", family=None) -> float:
    """The width of ``text`` in points at font ``size``, as matplotlib's default font (or ``family``, e.g.
    "monospace") sets it (bold: wider)."""
    from matplotlib.font_manager import FontProperties     # here: this module loads without matplotlib
    from matplotlib.textpath import text_to_path
    prop = FontProperties(size=size, weight=weight, family=family)
    return max(text_to_path.get_text_width_height_descent(line, prop, ismath=False)[0]
               for line in str(text).split("\n"))


def wrap_title(title: str, width_pt: float, size: float, sep: str = "  ·  ", weight: str = "bold") -> str:
    """Break a ' · '-joined title into lines no wider than ``width_pt``."""
    lines, line = [], ""
    for part in title.split(sep):
        candidate = line + sep + part if line else part
        if line and text_width_pt(candidate, size, weight) > width_pt:
            lines.append(line)
            candidate = part
        line = candidate
    return "\n".join(lines + [line])
