"""The CPU and model lanes (viz/lanes.py) draw the traces' spans: one rectangle per span, at its place on the wall
clock; a synchronous run's lanes take turns, an asynchronous run's overlap."""
import dataclasses

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minibatch import LLM, SamplingParams, viz  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402
from minibatch.trace import TraceRecorder  # noqa: E402
from minibatch.viz.lanes import KIND_COLORS, KIND_LABELS  # noqa: E402

PROMPTS = ["def fib(n):\n    ", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n        self."]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def runs(target_model):
    out = {}
    for mode in (False, True):
        llm = LLM(target_model, async_scheduling=mode, block_size=8, max_num_seqs=3)
        rec = TraceRecorder()
        llm.llm_engine.add_hook(rec)
        llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
        out["async" if mode else "sync"] = rec.traces
    return out


def _overlapping_pairs(result) -> int:
    """Pairs (CPU rectangle, model rectangle) whose x ranges intersect (not merely touch)."""
    def x(r):
        return r.get_x(), r.get_x() + r.get_width()
    return sum(min(x(c)[1], x(m)[1]) - max(x(c)[0], x(m)[0]) > 1e-9
               for c, _ in result["rects"]["cpu"] for m, _ in result["rects"]["model"])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_each_rectangle_is_a_span_of_the_trace(runs, mode):
    traces = runs[mode]
    res = viz.draw_lanes(traces)
    origin = min(t.schedule_span[0] for t in traces)
    cpu = sorted([(tuple(t.schedule_span), t.step, "schedule") for t in traces] +
                 [(tuple(t.update_span), t.step, "update") for t in traces])
    assert [(tuple(s[:2]), s[2], s[3]) for _, s in res["rects"]["cpu"]] == cpu
    assert [(tuple(s[:2]), s[2]) for _, s in res["rects"]["model"]] == \
        sorted((tuple(t.forward_span), t.step) for t in traces)
    for lane, y in (("cpu", 0), ("model", 1)):
        for rect, (start, end, step, kind) in res["rects"][lane]:
            assert rect.get_x() == pytest.approx((start - origin) * 1e3)
            assert rect.get_width() == pytest.approx((end - start) * 1e3)
            assert rect.get_y() == pytest.approx(y - 0.35)
            assert rect.get_facecolor() == to_rgba(KIND_COLORS[kind])
    # only the steps through `upto` are drawn
    upto = traces[len(traces) // 2].step
    part = viz.draw_lanes(traces, upto=upto)
    assert {s[2] for lane in part["rects"].values() for _, s in lane} == {t.step for t in traces if t.step <= upto}


def test_sync_lanes_take_turns_async_lanes_overlap(runs):
    sync, asyn = viz.draw_lanes(runs["sync"]), viz.draw_lanes(runs["async"])
    assert _overlapping_pairs(sync) == 0 and sync["overlap_s"] == 0.0
    assert _overlapping_pairs(asyn) > 0 and asyn["overlap_s"] > 0.0
    assert 0.0 < sync["model_busy"] < 1.0 and 0.0 < asyn["model_busy"] <= 1.0


def test_traces_without_spans_are_refused(runs):
    bare = [dataclasses.replace(t, forward_span=[]) for t in runs["sync"]]
    with pytest.raises(viz.TraceError, match="forward_span"):
        viz.draw_lanes(bare)
    with pytest.raises(ValueError, match="lane must be one of"):
        viz.busy_share(runs["sync"], "gpu")


@pytest.mark.parametrize("preset", [None, "slide"])
def test_the_dashboard_draws_the_lanes_of_an_async_run_only(runs, preset):
    from test_viz_layout import SLIDE_MIN_PX, text_problems
    asyn, sync = runs["async"], runs["sync"]
    step = asyn[len(asyn) // 2].step
    res = viz.draw_step(asyn, step, preset=preset)
    drawn = {s[2] for lane in res["lanes"]["rects"].values() for _, s in lane}
    assert drawn == {t.step for t in asyn if t.step <= step}               # through this step, none after
    labels = {h.get_label() for h in res["legend"]}
    assert set(KIND_LABELS.values()) <= labels
    problems = text_problems(res["fig"], SLIDE_MIN_PX if preset == "slide" else None)
    assert not problems, problems
    assert viz.draw_step(sync, sync[1].step, preset=preset)["lanes"] is None  # sync: the dashboard as it was
    alone = viz.draw_lanes(asyn, preset=preset)
    assert not text_problems(alone["ax"].figure, SLIDE_MIN_PX if preset == "slide" else None)
