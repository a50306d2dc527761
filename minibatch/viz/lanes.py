"""Two lanes on the wall clock: what the CPU did and what the model did, step by step.

    CPU    |sched 0|        |upd 0|sched 1|        |upd 1|sched 2| ...     synchronous: the lanes take turns
    model          |fwd 0 |                |fwd 1 |
    CPU    |sched 0|sched 1|upd 0 sched 2|upd 1 sched 3| ...              asynchronous (vLLM V1's batch queue):
    model          |fwd 0  |fwd 1        |fwd 2        |                  step N+1 is scheduled, and N-1 updated,
                                                                           while N's forward runs

Each ``StepTrace`` carries ``schedule_span``, ``forward_span`` and ``update_span``: [start, end] seconds since
the engine was created (``minibatch/trace.py``). The CPU lane draws the schedule and update spans, the model
lane the forward spans, at their true place on the wall clock, so what overlaps is drawn over the same x.
Everything comes from the traces (``lane_spans``); the engine is never read. A run whose traces carry no spans
(recorded before they did) is refused with the field's name.

``overlap`` and ``busy_share`` are the numbers the picture shows: the seconds during which both lanes were
busy, and the share of the run (first span's start to last span's end) a lane was busy.
"""
from __future__ import annotations

from minibatch.viz.common import TraceError, as_traces, new_axes, style, styled

LANES = ("cpu", "model")
KIND_COLORS = {"schedule": "#0072B2", "update": "#E69F00", "forward": "#009E73"}   # Okabe–Ito
KIND_LABELS = {"schedule": "schedule (+ inputs)", "update": "update from output", "forward": "forward (model)"}
_LANE_OF = {"schedule": "cpu", "update": "cpu", "forward": "model"}


def lane_spans(traces) -> dict:
    """{"cpu": [(start, end, step, "schedule" | "update")], "model": [(start, end, step, "forward")]},
    each lane in time order, seconds since the engine's creation (the traces' own spans)."""
    traces = as_traces(traces)
    lanes = {lane: [] for lane in LANES}
    for t in traces:
        for kind in KIND_COLORS:
            span = getattr(t, f"{kind}_span", None)
            if not span:
                raise TraceError(f"step {t.step} has no {kind}_span: the lanes need traces recorded with spans "
                                 f"(StepTrace.schedule_span, forward_span, update_span)")
            lanes[_LANE_OF[kind]].append((float(span[0]), float(span[1]), t.step, kind))
    for spans in lanes.values():
        spans.sort()
    return lanes


def has_lanes(traces) -> bool:
    """Whether the dashboard draws the lanes: an asynchronously scheduled run whose every step carries its spans."""
    traces = as_traces(traces)
    return any(getattr(t, "async_scheduling", False) for t in traces) and \
        all(t.schedule_span and t.forward_span and t.update_span for t in traces)


def _union(spans) -> list:
    """Disjoint [start, end] intervals covering the spans."""
    out = []
    for start, end, *_ in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def overlap(traces) -> float:
    """Seconds during which the CPU lane and the model lane were both busy (0 for a synchronous run)."""
    lanes = lane_spans(traces)
    cpu, model = _union(lanes["cpu"]), _union(lanes["model"])
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in cpu for b0, b1 in model)


def busy_share(traces, lane: str = "model") -> float:
    """The share of the run's wall time (first span's start to last span's end) that ``lane`` was busy."""
    if lane not in LANES:
        raise ValueError(f"lane must be one of {list(LANES)}, got {lane!r}")
    lanes = lane_spans(traces)
    every = lanes["cpu"] + lanes["model"]
    total = max(e for _, e, _, _ in every) - min(s for s, _, _, _ in every)
    return sum(e - s for s, e in _union(lanes[lane])) / total if total > 0 else 0.0


@styled
def draw_lanes(traces, ax=None, upto=None, legend=True, title=None, origin=None) -> dict:
    """Draw the CPU lane (top) and the model lane (bottom) on the wall clock, in milliseconds from ``origin``
    (seconds since the engine's creation; default: the first span's start), the spans of steps through
    ``upto`` only (an animation does not show the future). Returns {"ax", "rects": {"cpu": [(Rectangle,
    (start, end, step, kind))], "model": [...]}, "spans": lane_spans, "overlap_s", "model_busy"}."""
    from matplotlib.patches import Patch, Rectangle     # here: the numbers above need no matplotlib (--text)
    traces = as_traces(traces)
    st = style()
    ax = new_axes(ax, (13, 2.6))
    lanes = lane_spans(traces)
    first = min(s for spans in lanes.values() for s, *_ in spans)
    last = max(e for spans in lanes.values() for _, e, *_ in spans)
    origin = first if origin is None else origin
    rects = {lane: [] for lane in LANES}
    for y, lane in enumerate(LANES):
        for span in lanes[lane]:
            start, end, step, kind = span
            if upto is not None and step > upto:
                continue
            r = ax.add_artist(Rectangle(((start - origin) * 1e3, y - 0.35), (end - start) * 1e3, 0.7,
                                        facecolor=KIND_COLORS[kind], linewidth=0.4,
                                        # white edges part consecutive forwards; the CPU's thin spans keep
                                        # their colour (its two kinds alternate)
                                        edgecolor="white" if lane == "model" else "none"))
            rects[lane].append((r, span))
    ax.set_xlim((first - origin) * 1e3, max((last - origin) * 1e3, (first - origin) * 1e3 + 1e-3))
    ax.set_ylim(len(LANES) - 0.4, -0.6)
    ax.set_yticks(range(len(LANES)), ["CPU", "model"], fontsize=st.small)
    ax.tick_params(labelsize=st.small, length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("wall clock (ms)", fontsize=st.font)
    both, busy = overlap(traces), busy_share(traces, "model")
    ax.set_title(title or f"CPU and model lanes: model busy {busy:.0%} of the run, both busy {both * 1e3:.1f} ms",
                 fontsize=st.font, loc="left")
    handles = [Patch(facecolor=KIND_COLORS[k], label=KIND_LABELS[k]) for k in KIND_COLORS]
    if legend:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=st.small,
                  frameon=False, borderaxespad=0.3)
    return {"ax": ax, "rects": rects, "spans": lanes, "overlap_s": both, "model_busy": busy, "legend": handles}
