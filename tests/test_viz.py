"""The visualisation draws what the trace says.

Inputs: hand-scripted synthetic traces (tests/fixtures/synthetic_traces.py:
every event at a known step) and small recorded engine runs
(tests/fixtures/engine_*.json). Each check derives the expected picture from
the trace fields themselves and compares it with what the renderer drew
(returned data and the artists' colours), never with hard-coded pictures.
"""
import dataclasses
import io
import json
import pathlib
import random
import re
import sys

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402
from PIL import Image  # noqa: E402

from minibatch import viz  # noqa: E402
from minibatch.trace import TraceRecorder  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
from synthetic_traces import continuous_traces, static_traces  # noqa: E402

ENGINE_RUNS = ["engine_continuous.json", "engine_static.json", "engine_ngram.json"]
DPI = 30                                       # tiny frames: the tests check structure, not looks


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def cont():
    return continuous_traces()


@pytest.fixture(scope="module")
def static():
    return static_traces()


def all_runs():
    return [("synthetic-continuous", continuous_traces()), ("synthetic-static", static_traces())] + [
        (name, TraceRecorder.load(FIXTURES / name).traces) for name in ENGINE_RUNS]


RUNS = all_runs()
RUN_IDS = [name for name, _ in RUNS]


def rounded(color):
    return tuple(round(c, 6) for c in to_rgba(color))


def same_color(a, b):
    return to_rgba(a) == pytest.approx(to_rgba(b))


# -- the fixtures themselves obey the trace invariants --------------------------------
@pytest.mark.parametrize("traces", [r for _, r in RUNS], ids=RUN_IDS)
def test_fixture_traces_are_consistent(traces):
    for t in traces:
        occurrences = [0] * t.num_blocks
        for table in t.block_tables.values():
            for b in table:
                occurrences[b] += 1
        assert t.ref_counts == occurrences, f"step {t.step}"
        assert t.num_free_blocks == t.ref_counts.count(0)
        assert t.num_batched_tokens == sum(s.num_tokens for s in t.scheduled) <= t.token_budget
        assert not set(t.waiting) & set(t.block_tables)


def test_synthetic_json_fixtures_match_the_builder(cont, static):
    for name, traces in (("synthetic_continuous.json", cont), ("synthetic_static.json", static)):
        loaded = TraceRecorder.load(FIXTURES / name).traces
        assert [t.to_dict() for t in loaded] == [t.to_dict() for t in traces], f"regenerate {name}"


# -- colours ----------------------------------------------------------------------------
def test_seq_order_is_first_appearance_and_colors_are_stable(cont):
    order = viz.seq_order(cont)
    assert list(order) == ["A", "B", "C", "D.0", "D.1", "E"]
    for alive in viz.alive_sets(cont):                           # concurrent sequences never share a colour
        assert len({viz.seq_color(s, order) for s in alive}) == len(alive)
    assert viz.seq_color("E", order) == viz.seq_color("A", order)   # E takes the colour A left behind
    assert viz.seq_color("C", cont) == viz.seq_color("C", order)  # from traces or from the order
    # by the trace given, not by hash: step 6 alone starts with D.0
    assert viz.seq_color("D.0", [cont[6]]) == to_rgba(viz.SEQ_PALETTE[0])
    with pytest.raises(KeyError, match="Z"):
        viz.seq_color("Z", order)


# -- the block pool -----------------------------------------------------------------------
def owners_from_tables(t, b):
    return [sid for sid, table in t.block_tables.items() if b in table]


@pytest.mark.parametrize("traces", [r for _, r in RUNS], ids=RUN_IDS)
def test_block_grid_colours_follow_the_block_tables(traces):
    order = viz.seq_order(traces)
    for t in traces[:: max(1, len(traces) // 4)]:
        fig, (ax, tax) = plt.subplots(1, 2)
        res = viz.draw_blocks(traces, t.step, ax=ax, tables_ax=tax)
        assert len(res["cells"]) == t.num_blocks
        cached = set(t.cached_blocks)
        for cell in res["cells"]:
            b = cell["block"]
            owners = owners_from_tables(t, b)
            if t.ref_counts[b] > 0:
                expected = sorted(rounded(viz.seq_color(s, order)) for s in owners)   # one sliver each
                assert sorted(rounded(p.get_facecolor()) for p in cell["patches"]) == expected, \
                    f"step {t.step} block {b}"
                assert cell["state"] == "used"
            else:
                assert cell["state"] == ("cached-free" if b in cached else "free")
                assert len(cell["patches"]) == 1
                patch = cell["patches"][0]
                assert (patch.get_hatch() == "//") == (b in cached)
        texts = {tx.get_text() for tx in ax.texts}
        for b, rc in enumerate(t.ref_counts):                     # a shared block shows its ref count
            assert (res["labels"].get(b) == f"\u00d7{rc}") == (rc > 1)
            if rc > 1:
                assert f"\u00d7{rc}" in texts
        assert res["counts"]["used"] == t.num_blocks - t.num_free_blocks
        tables = res["tables"]                                    # one cell per logical block
        assert set(tables["rows"]) == set(t.block_tables)
        for sid, table in t.block_tables.items():
            assert tables["rows"][sid] == table
            assert len(tables["patches"][sid]) == len(table)
            assert all(same_color(p.get_facecolor(), viz.seq_color(sid, order)) for p in tables["patches"][sid])


def test_block_view_follows_a_shuffled_pool(cont):
    """Relabel the physical blocks by a random permutation: the picture must move with them."""
    rng = random.Random(7)
    t = cont[2]
    perm = list(range(t.num_blocks))
    rng.shuffle(perm)
    rc = [0] * t.num_blocks
    for b, p in enumerate(perm):
        rc[p] = t.ref_counts[b]
    shuffled = dataclasses.replace(t, block_tables={s: [perm[b] for b in tb] for s, tb in t.block_tables.items()},
                                   ref_counts=rc, cached_blocks=sorted(perm[b] for b in t.cached_blocks))
    before = viz.draw_blocks(cont, 2, ax=plt.subplots()[1])["cells"]
    after = viz.draw_blocks(cont[:2] + [shuffled] + cont[3:], 2, ax=plt.subplots()[1])["cells"]
    for b in range(t.num_blocks):
        assert after[perm[b]]["owners"] == before[b]["owners"]
        assert after[perm[b]]["state"] == before[b]["state"]
        assert [p.get_facecolor() for p in after[perm[b]]["patches"]] == \
            [p.get_facecolor() for p in before[b]["patches"]]


def test_synthetic_events_are_visible_in_the_block_view(cont):
    res = viz.draw_blocks(cont, 1)                                # C reuses A's block 0 from the prefix cache
    assert res["labels"] == {0: "\u00d72"} and res["cells"][0]["owners"] == ["A", "C"]
    res = viz.draw_blocks(cont, 4)                                # A finished: its full blocks stay cached
    assert res["counts"]["cached-free"] == 3
    res = viz.draw_blocks(cont, 2)                                # D.0 and D.1 share both blocks
    assert {b for b, c in enumerate(res["cells"]) if c["owners"] == ["D.0", "D.1"]} == {7, 8}


def test_block_table_outside_the_pool_is_a_clear_error(cont):
    bad = dataclasses.replace(cont[0], block_tables={"A": [0, 99]})
    with pytest.raises(ValueError, match="block 99"):
        viz.draw_blocks([bad], 0)


# -- the timeline ---------------------------------------------------------------------------
@pytest.mark.parametrize("traces", [r for _, r in RUNS], ids=RUN_IDS)
def test_timeline_cells_are_what_the_trace_lists_say(traces):
    res = viz.draw_timeline(traces)
    cells, patches = res["cells"], res["patches"]
    finished_at = {}
    for t in traces:
        for s in t.scheduled:
            assert cells[(s.seq_id, t.step)] == s.phase
            if s.proposed:                                        # k+1 slivers, a accepted
                fills = [p.get_facecolor() for p in patches[(s.seq_id, t.step)]][-(s.proposed + 1):]
                assert len(fills) == s.proposed + 1
                assert sum(same_color(f, viz.PHASE_COLORS["decode"]) for f in fills) == s.accepted
            else:
                assert same_color(patches[(s.seq_id, t.step)][-1].get_facecolor(), viz.PHASE_COLORS[s.phase])
        for sid in t.preempted:                                   # a preempted cell shows the preempted colour
            assert same_color(patches[(sid, t.step)][0].get_facecolor(), viz.PHASE_COLORS["preempted"])
        scheduled = {s.seq_id for s in t.scheduled}
        for sid in t.waiting:
            if sid not in t.preempted:
                assert cells[(sid, t.step)] == "waiting"
        for sid, f in finished_at.items():                        # after finishing: finished (or padding)
            assert cells[(sid, t.step)] in ("finished", "padding")
            assert sid not in scheduled
        for sid in t.finished:
            finished_at.setdefault(sid, t.step)
        padding = sum(cells.get((sid, t.step)) == "padding" for sid in res["rows"])
        assert padding == t.num_padding_slots, f"step {t.step}"    # the static batch's idle slots
        for sid in set(t.admitted) - scheduled:                   # admitted, no tokens yet: not a fork
            assert cells[(sid, t.step)] == "stalled"
    assert not any(cells[(sid, t.step)] == "forked" for t in traces for sid in t.admitted)
    labels = [h.get_label() for h in res["legend"]]
    assert ("preempted" in labels) == any(t.preempted for t in traces), "a preemption always gets its legend entry"
    assert finished_at, "every fixture finishes something"


def test_timeline_shows_the_scripted_story(cont, static):
    cells = viz.timeline_cells(cont)
    assert cells[("C", 3)] == "preempted" and cells[("C", 4)] == "waiting" and cells[("C", 5)] == "resumed"
    assert cells[("D.1", 2)] == "forked" and cells[("D.1", 4)] == "stalled"
    assert [cells[("A", s)] for s in range(4, 10)] == ["decode"] + ["finished"] * 5
    assert ("E", 1) not in cells and cells[("E", 2)] == "waiting"
    assert viz.speculation(cont) == {("A", 2): (2, 3, 0), ("A", 4): (3, 3, 1)}
    scells = viz.timeline_cells(static)
    assert [scells[("A", s)] for s in (2, 3, 4, 5)] == ["decode", "padding", "padding", "finished"]


def test_timeline_highlight_and_upto(cont):
    fig, ax = plt.subplots()
    res = viz.draw_timeline(cont, ax=ax, upto=4, highlight=4)
    frame = res["highlight_artist"]
    assert res["highlight"] == 4 and frame.get_x() + frame.get_width() / 2 == pytest.approx(4)
    assert max(step for _, step in res["cells"]) == 4               # no future cells
    assert ax.get_xlim()[1] > cont[-1].step                         # but the axis spans the run
    with pytest.raises(ValueError, match="highlight=42"):
        viz.draw_timeline(cont, highlight=42)


def test_same_colour_for_a_request_in_every_view(cont):
    fig, (a, b) = plt.subplots(1, 2)
    tl = viz.draw_timeline(cont, ax=a)
    tables = viz.draw_block_tables(cont, 2, ax=b)
    assert set(tables["patches"]) == {"A", "B", "C", "D.0", "D.1"}
    labels = dict(zip(tl["rows"], a.get_yticklabels()))
    for sid, cells in tables["patches"].items():
        assert same_color(labels[sid].get_bbox_patch().get_facecolor(), cells[0].get_facecolor())
        assert same_color(cells[0].get_facecolor(), viz.seq_color(sid, cont))


# -- usage, throughput, comparison, dashboard ---------------------------------------------
@pytest.mark.parametrize("traces", [r for _, r in RUNS], ids=RUN_IDS)
def test_kv_usage_and_throughput_add_up(traces):
    kv = viz.kv_usage(traces)
    for i, t in enumerate(traces):
        assert kv["used"][i] + kv["cached_free"][i] + kv["free"][i] == t.num_blocks
        assert kv["cached_free"][i] == sum(1 for b in t.cached_blocks if t.ref_counts[b] == 0)
    tok = viz.tokens_per_step(traces)
    assert list(tok["prefill"] + tok["decode"] + tok["resumed"]) == [t.num_batched_tokens for t in traces]
    mid = traces[len(traces) // 2].step
    assert viz.draw_kv_usage(traces, upto=mid)["shown"] == sum(t.step <= mid for t in traces)


def test_comparison_shares_axes_and_summarises(static, cont):
    res = viz.draw_comparison(static, cont)
    assert res["summary"]["static"]["steps"] == len(static)
    assert res["summary"]["continuous"]["padding_slot_steps"] == 0
    assert res["summary"]["static"]["padding_slot_steps"] == sum(t.num_padding_slots for t in static)
    xlims = {ax.get_xlim() for ax in res["fig"].axes}
    assert len(xlims) == 1                                          # one x range for both runs
    assert viz.seq_color("E", static + cont) == res["static"]["timeline"]["ax"].get_yticklabels()[
        res["static"]["timeline"]["rows"].index("E")].get_bbox_patch().get_facecolor()
    with pytest.raises(ValueError, match="labels"):
        viz.draw_comparison(static, cont, labels=("one",))


def test_dashboard_draws_every_view_at_the_step(cont):
    res = viz.draw_step(cont, 3)
    assert res["timeline"]["highlight"] == 3
    assert max(s for _, s in res["timeline"]["cells"]) == 3
    assert res["blocks"]["counts"]["used"] == cont[3].num_blocks - cont[3].num_free_blocks
    assert res["tables"]["rows"] == cont[3].block_tables
    title = res["fig"].get_suptitle()
    assert title.startswith("step 3") and "preempted: C" in title
    fig = res["fig"]
    assert viz.draw_step(cont, 5, fig=fig)["fig"] is fig            # redraws in place
    assert fig.get_suptitle().startswith("step 5")


# -- bad input gets one clear error ---------------------------------------------------------
def test_bad_input_errors(cont):
    with pytest.raises(viz.TraceError, match="empty"):
        viz.draw_timeline([])
    with pytest.raises(TypeError, match="StepTrace"):
        viz.draw_timeline([{"step": 0}])
    with pytest.raises(viz.TraceError, match=r"step 99 is not in the trace \(it has steps 0\.\.9\)"):
        viz.draw_blocks(cont, 99)
    with pytest.raises(TypeError, match="step must be an int"):
        viz.draw_step(cont, "3")
    with pytest.raises(TypeError, match="print_trace"):
        viz.text_view(cont)


# -- files: gif, html, mp4, png, json round trip --------------------------------------------
def test_save_gif_has_several_frames(cont, tmp_path):
    path = viz.save(cont, tmp_path / "run.gif", max_frames=3, dpi=DPI)
    assert path.read_bytes()[:6] == b"GIF89a"
    with Image.open(path) as im:
        assert im.n_frames == 3


def test_save_html_is_self_contained(cont, tmp_path):
    path = viz.save(cont, tmp_path / "run.html", steps=[1, 3], dpi=DPI)
    html = path.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html)    # nothing fetched
    assert "<link" not in html and 'class="fa' not in html
    assert html.count("data:image/png;base64") == 2                           # the frames are embedded


def test_save_mp4_works_or_says_why(cont, tmp_path):
    if matplotlib.animation.writers.is_available("ffmpeg"):
        assert viz.save(cont, tmp_path / "run.mp4", max_frames=2, dpi=DPI).stat().st_size > 0
    else:
        with pytest.raises(viz.WriterUnavailableError, match="ffmpeg"):
            viz.save(cont, tmp_path / "run.mp4")
        assert not (tmp_path / "run.mp4").exists()


def test_save_png_still_and_contact_sheet(cont, tmp_path):
    viz.save(cont, tmp_path / "still.png", dpi=DPI)
    viz.save(cont, tmp_path / "sheet.png", steps=[0, 2, 4], dpi=DPI)
    with Image.open(tmp_path / "still.png") as still, Image.open(tmp_path / "sheet.png") as sheet:
        assert sheet.size == (2 * still.size[0], 2 * still.size[1])   # 3 frames, 2 per row
    assert viz.busiest_step(cont) == max(cont, key=lambda t: t.num_blocks - t.num_free_blocks).step


def test_save_rejects_bad_paths(cont, tmp_path):
    with pytest.raises(ValueError, match=r"\.gif"):
        viz.save(cont, tmp_path / "run.avi")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        viz.save(cont, tmp_path / "no" / "run.gif")


def test_frame_steps_subsamples_long_runs(cont):
    assert viz.frame_steps(cont, max_frames=100) == list(range(10))
    few = viz.frame_steps(cont, max_frames=4)
    assert len(few) == 4 and few[0] == 0 and few[-1] == 9 and few == sorted(few)
    with pytest.raises(viz.TraceError, match="step 12"):
        viz.frame_steps(cont, steps=[1, 12])


def test_animation_frames_are_dashboards(cont):
    anim = viz.animate(cont, steps=[2, 5], dpi=DPI)
    html = anim.to_jshtml()
    assert html.count("data:image/png;base64") == 2


def test_json_round_trip_renders_the_same(cont, tmp_path):
    TraceRecorder(cont).save(tmp_path / "run.json")
    loaded = TraceRecorder.load(tmp_path / "run.json").traces
    assert viz.timeline_cells(loaded) == viz.timeline_cells(cont)
    assert viz.timeline_cells(tmp_path / "run.json") == viz.timeline_cells(cont)   # a path works too
    a = viz.draw_blocks(cont, 4, ax=plt.subplots()[1])
    b = viz.draw_blocks(loaded, 4, ax=plt.subplots()[1])
    strip = lambda cells: [{k: v for k, v in c.items() if k != "patches"} for c in cells]  # noqa: E731
    assert strip(a["cells"]) == strip(b["cells"]) and a["labels"] == b["labels"]
    assert [viz.text_view(t) for t in loaded] == [viz.text_view(t) for t in cont]
    json.loads((tmp_path / "run.json").read_text())                # plain JSON


# -- widgets -----------------------------------------------------------------------------------
def test_step_through_steps_and_redraws(cont):
    w = viz.step_through(cont, dpi=DPI)
    assert w.current_step == 0 and w.redraws == 1
    first = w.image.value
    assert first[:8] == b"\x89PNG\r\n\x1a\n"
    w.slider.value = 3
    assert w.current_step == 3 and w.redraws == 2 and w.image.value != first
    assert "step 3" in w.caption.value and "preempted: C" in w.caption.value
    w.next_button.click()
    assert w.current_step == 4 and w.slider.value == 4
    w.prev()
    assert w.current_step == 3 and w.redraws == 3                # step 3 again: the cached frame, no redraw
    w.prev()
    assert w.current_step == 2 and w.redraws == 4
    w.play.value = 7                                              # Play drives the slider
    assert w.current_step == 7
    with pytest.raises(ValueError, match="outside"):
        w.step(10)
    assert w.current_step == 7                                    # unchanged after the error


def test_step_through_also_carries_the_html_player_for_static_renders(cont, monkeypatch):
    """nbconvert / GitHub cannot show a widget: without a widget front end, the display data hold the HTML
    player beside it."""
    from IPython.core.formatters import DisplayFormatter
    from minibatch.viz import widget
    monkeypatch.setattr(widget, "widget_frontend", lambda: False)     # as in nbconvert's kernel
    data, _ = DisplayFormatter().format(viz.step_through(cont[:3], dpi=DPI, static_frames=3))
    assert "application/vnd.jupyter.widget-view+json" in data               # a live front end: the widget
    html = data["text/html"]                                                # a static one: the player
    assert html.count("data:image/png;base64") == 3 and "https://" not in html
    plain, _ = DisplayFormatter().format(viz.step_through(cont[:3], dpi=DPI, static_frames=0))
    assert "text/html" not in plain


def test_step_through_builds_no_html_when_a_widget_front_end_is_present(cont, monkeypatch):
    """JupyterLab shows the widget and never the HTML player: building it there cost 33 s of 34 (issue 15)."""
    from IPython.core.formatters import DisplayFormatter
    from minibatch.viz import widget

    def no_html(*args, **kwargs):
        raise AssertionError("the HTML player was built although a widget front end is attached")
    monkeypatch.setattr(widget, "_static_html", no_html)
    monkeypatch.setattr(widget, "widget_frontend", lambda: True)
    data, _ = DisplayFormatter().format(viz.step_through(cont[:3], dpi=DPI))
    assert "application/vnd.jupyter.widget-view+json" in data and "text/html" not in data
    monkeypatch.setattr(widget, "_static_html", lambda traces, frames: "<p>player</p>")
    data, _ = DisplayFormatter().format(viz.step_through(cont[:3], dpi=DPI, static_html=True))   # on request
    assert data["text/html"] == "<p>player</p>"


def test_widget_frontend_signs(monkeypatch):
    """A Jupyter server's session kernel (JupyterLab: JPY_SESSION_NAME) or an open widget control comm."""
    import ipywidgets
    from minibatch.viz.widget import widget_frontend
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.setattr(ipywidgets.Widget, "_control_comm", None)
    assert not widget_frontend()                                  # plain Python, nbconvert: neither sign
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/student/03_continuous_batching.ipynb")
    assert widget_frontend()
    monkeypatch.delenv("JPY_SESSION_NAME")
    monkeypatch.setattr(ipywidgets.Widget, "_control_comm", object())
    assert widget_frontend()


def test_coalescer_renders_only_the_newest_request():
    """Play ticks that pile up while a frame renders cost one render of the newest step, not one each."""
    from minibatch.viz.widget import Coalescer
    queue, rendered = [], []
    c = Coalescer(rendered.append, soon=lambda: queue.append)    # a fake event loop: callbacks wait in a list
    for value in range(1, 6):
        c.request(value)
    assert rendered == [] and len(queue) == 1 and c.skipped == 4
    queue.pop()()
    assert rendered == [5]
    c.request(6)
    queue.pop()()
    assert rendered == [5, 6]
    now = Coalescer(rendered.append, soon=lambda: None)           # no event loop: render at once
    now.request(7)
    assert rendered == [5, 6, 7]


def test_step_through_falls_back_to_html_without_ipywidgets(cont, monkeypatch):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)          # import ipywidgets -> ImportError
    shown = viz.step_through(cont[:2])
    from IPython.display import HTML
    assert isinstance(shown, HTML) and "data:image/png;base64" in shown.data
    monkeypatch.setitem(sys.modules, "IPython.display", None)
    with pytest.raises(ImportError, match="ipywidgets"):
        viz.step_through(cont[:2])


class FakeEngine:
    """Stands in for LLMEngine: each step() hands the next scripted trace to the hooks."""

    def __init__(self, traces, fail_at=None):
        self.pending, self.hooks, self.calls, self.fail_at = list(traces), [], 0, fail_at

    def add_hook(self, fn):
        self.hooks.append(fn)

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("the scheduler could schedule nothing")
        trace = self.pending.pop(0)
        for fn in self.hooks:
            fn(trace)
        return []


def test_live_steps_the_engine_once_per_click(cont):
    engine = FakeEngine(cont[:4])
    w = viz.live(engine, dpi=DPI)
    assert engine.hooks == [w.recorder] and w.redraws == 0
    w.step_button.click()
    w.step_button.click()
    assert engine.calls == 2 and len(w.recorder) == 2
    assert w.current_step == 1 and w.slider.max == 1 and "step 1" in w.status.value
    w.slider.value = 0                                            # scrub back through the history
    assert w.current_step == 0
    w.run_button.click()
    assert engine.calls == 4 and w.current_step == 3
    assert "finished" in w.status.value
    w.step_button.click()
    assert engine.calls == 4                                      # nothing left: no more steps
    engine.pending.append(cont[4])                                # a new request arrives: Step works again
    w.step_button.click()
    assert engine.calls == 5 and w.current_step == 4 and w.slider.max == 4


def test_live_reports_engine_errors_and_bad_engines(cont):
    engine = FakeEngine(cont[:3], fail_at=2)
    w = viz.live(engine, dpi=DPI)
    w.step_button.click()
    w.step_button.click()                                         # the engine raises: shown, not lost
    assert "RuntimeError" in w.status.value and len(w.recorder) == 1 and w.current_step == 0
    w2 = viz.live(FakeEngine(cont[:2], fail_at=1), dpi=DPI)
    with pytest.raises(RuntimeError, match="schedule nothing"):  # the programmatic call raises
        w2.step_once()
    with pytest.raises(TypeError, match="add_hook"):
        viz.live(object())


# -- text -------------------------------------------------------------------------------------
def test_text_view_lists_the_batch_and_counts(cont):
    for t in cont:
        text = viz.text_view(t)
        assert text.splitlines()[0].startswith(f"step {t.step} ")
        assert f"{t.num_batched_tokens}/{t.token_budget} tokens" in text
        used = t.num_blocks - t.num_free_blocks
        assert f"{used} used" in text
        for s in t.scheduled:
            assert re.search(rf"^\s+{re.escape(s.seq_id)}\s+{s.phase}\s+{s.num_tokens} tok", text, re.M)
        for sid in t.preempted + t.finished:
            assert sid in text.splitlines()[-2]
    assert "spec 2/3 accepted" in viz.text_view(cont[2])
    assert "padding slots: 1" in viz.text_view(static_traces()[3])
    out = io.StringIO()
    viz.print_trace(cont, file=out)
    assert out.getvalue().count("\nstep ") == len(cont) - 1


def test_text_view_needs_no_matplotlib():
    import subprocess
    code = ("import sys; from minibatch.viz.text import text_view, print_trace; "
            "assert not any(m.startswith('matplotlib') for m in sys.modules), 'matplotlib was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)



def test_admitted_but_not_yet_scheduled_is_stalled_not_forked():
    """A static batch admits three requests whose prompts overflow the token budget: two get no tokens in
    the step they join. They are batch members waiting for compute ("stalled"), not n > 1 forks."""
    import torch
    from minibatch import LLM, SamplingParams
    from minibatch.model.model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig("tiny", n_layer=1, n_head=2, n_embd=16, n_ctx=64)).eval()
    llm = LLM(model, block_size=8, max_num_batched_tokens=8, scheduling="static", max_num_seqs=3)
    rec = TraceRecorder()
    llm.llm_engine.add_hook(rec)
    llm.generate([[1] * 10, [2] * 10, [3] * 10], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    first = rec.traces[0]
    idle = set(first.admitted) - {s.seq_id for s in first.scheduled}
    assert len(idle) == 2
    cells = viz.timeline_cells(rec.traces)
    assert {cells[(sid, 0)] for sid in idle} == {"stalled"}
    labels = [h.get_label() for h in viz.draw_timeline(rec.traces)["legend"]]
    assert viz.PHASE_LABELS["forked"] not in labels


def test_a_preemption_drawn_only_as_a_sliver_is_in_the_legend():
    from minibatch.viz.timeline import legend_handles
    cells = {("A", 3): "resumed", ("A", 4): "decode"}            # preempted and readmitted at step 3
    labels = [h.get_label() for h in legend_handles(cells, {}, {("A", 3)})]
    assert viz.PHASE_LABELS["preempted"] in labels and viz.PHASE_LABELS["resumed"] in labels
    assert viz.PHASE_LABELS["preempted"] not in [h.get_label() for h in legend_handles(cells, {})]


def test_long_request_ids_are_shortened_in_row_labels():
    from minibatch.viz.common import short_label
    assert short_label("r3.1") == "r3.1"
    names = ["longname_request_0", "longname_request_1", "another_very_long_id_17"]
    shown = [short_label(n) for n in names]
    assert all(len(s) <= 10 for s in shown) and len(set(shown)) == 3     # short, and still told apart
    assert shown[0].startswith("longn") and shown[0].endswith("st_0")
