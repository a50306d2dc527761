"""The radix tree in the trace and its view (issue 44's views): ``StepTrace.radix_nodes`` is the allocator's tree
after each step, and ``viz/radix_tree.py`` draws it from the trace alone: a box per node with its tokens, blocks and
lock_ref, locked nodes framed, evictable leaves grey and hatched; the dashboard, so the step-through widget, shows
it in a column of its own."""
import pathlib

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

from minibatch.llm import LLM  # noqa: E402
from minibatch.sampling.sampler import SamplingParams  # noqa: E402
from minibatch.trace import TraceRecorder  # noqa: E402
from minibatch.viz.common import CACHED_FREE_COLOR  # noqa: E402
from minibatch.viz.dashboard import draw_step  # noqa: E402
from minibatch.viz.radix_tree import draw_radix_blocks, draw_radix_tree, radix_boxes, radix_title  # noqa: E402
from minibatch.viz.widget import step_through  # noqa: E402

STEM = "import os\nimport sys\n# a shared header\n"          # 38 bytes: 4 full blocks of 8
PROMPTS = [STEM + "def f(x):\n    return x\n", STEM + "class A:\n    pass\n", "print('no shared prefix here')\n"]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _record(model, tmp_path, **cfg):
    llm = LLM(model, block_size=8, max_num_seqs=2, **cfg)
    eng, rec, truth = llm.llm_engine, TraceRecorder(), []

    def hook(t):
        rec(t)
        tree = getattr(eng.allocator, "tree", None)     # ground truth: the allocator's own tree, read live
        truth.append(None if tree is None else [(n.id, list(n.value), n.lock_ref) for n in tree.nodes()])
    eng.add_hook(hook)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    rec.save(tmp_path / "run.json")
    return TraceRecorder.load(tmp_path / "run.json").traces, truth     # drawn from the saved trace, no engine


def test_the_trace_records_the_tree_and_the_view_draws_it(target_model, tmp_path):
    traces, truth = _record(target_model, tmp_path, prefix_cache="radix", num_gpu_blocks=14)
    for t, nodes in zip(traces, truth):
        assert [(r[0], r[4], r[5]) for r in t.radix_nodes[1:]] == [(i, b, lk) for i, b, lk in nodes]
        assert t.radix_nodes[0][1] == -1                                # the root first
    # a step where the stem is shared by two branches and something is locked
    step = next(t.step for t in traces if any(r[5] for r in t.radix_nodes[1:]) and len(t.radix_nodes) >= 3)
    t = next(x for x in traces if x.step == step)
    res = draw_radix_tree(traces, step)
    boxes = {b["id"]: b for b in res["boxes"]}
    assert set(boxes) == {r[0] for r in t.radix_nodes}
    for node_id, parent, n, first, blocks, lock_ref, evictable in t.radix_nodes[1:]:
        b = boxes[node_id]
        assert (b["parent"], b["num_tokens"], b["blocks"], b["lock_ref"], b["evictable"]) == \
            (parent, n, blocks, lock_ref, evictable)
        assert f"{n} tok" in b["label"] and f"lock_ref {lock_ref}" in b["label"] and str(blocks[0]) in b["label"]
        assert b["depth"] == boxes[parent]["depth"] + 1
        grey = to_rgba(b["patch"].get_facecolor()) == pytest.approx(to_rgba(CACHED_FREE_COLOR))
        assert grey == bool(b["patch"].get_hatch()) == evictable        # evictable leaves marked, only they
        assert (b["patch"].get_linewidth() > 2) == (lock_ref > 0)        # locked nodes framed thick
    assert boxes[t.radix_nodes[1][0]]["text"] == "import o"             # the stem's first tokens, as text
    # at the end nothing runs: every leaf is unlocked, so evictable
    last = radix_boxes(traces, traces[-1].step)
    leaves = {b["id"] for b in last} - {b["parent"] for b in last}
    assert {b["id"] for b in last if b["evictable"]} == leaves and not any(b["lock_ref"] for b in last[1:])
    both = draw_radix_blocks(traces, step)
    assert both["blocks"]["tables"] is not None and len(both["tree"]["boxes"]) == len(t.radix_nodes)


def test_the_hash_chain_records_no_tree(target_model, tmp_path):
    traces, _ = _record(target_model, tmp_path)
    assert all(t.radix_nodes == [] for t in traces)
    with pytest.raises(ValueError, match="prefix_cache='radix'"):
        draw_radix_tree(traces, traces[0].step)


FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "engine_radix.json"   # tests/fixtures/record_engine_traces.py


def _radix_panel(fig):
    """The dashboard's radix tree panel in ``fig``: (its Axes, its boxes), or None."""
    axes = [ax for ax in fig.axes if ax.get_title(loc="left").startswith("radix tree")]
    assert len(axes) <= 1
    if not axes:
        return None
    return axes[0], [p for p in axes[0].patches if isinstance(p, FancyBboxPatch)]


def test_the_widget_shows_the_radix_tree_beside_the_block_tables_at_each_step():
    traces = TraceRecorder.load(FIXTURE).traces
    w = step_through(traces, dpi=30, static_html=False)
    seen = set()
    for t in traces[::4]:                                              # steps 0, 4, 8 (a redraw each)
        w.step(t.step)
        assert w.current_step == t.step
        ax, patches = _radix_panel(w.figure)
        assert ax.get_title(loc="left") == radix_title(radix_boxes(traces, t.step))
        assert len(patches) == len(t.radix_nodes)                       # a box a node, the root's too
        rows = t.radix_nodes[1:]
        evictable = [p for p in patches if p.get_hatch()]
        locked = [p for p in patches if p.get_linewidth() > 2]
        assert len(evictable) == sum(r[6] for r in rows) and len(locked) == sum(r[5] > 0 for r in rows)
        seen |= {("locked", bool(locked)), ("evictable", bool(evictable))}
        texts = " ".join(x.get_text() for x in ax.texts)
        assert all(f"lock_ref {r[5]}" in texts and f"{r[2]} tok" in texts for r in rows)
    assert {("locked", True), ("evictable", True)} <= seen             # the fixture shows both marks
    plain = TraceRecorder.load(FIXTURE.with_name("engine_continuous.json")).traces    # the hash chain: no panel
    w = step_through(plain, dpi=30, static_html=False)
    assert _radix_panel(w.figure) is None and draw_step(plain, plain[1].step)["radix_tree"] is None
