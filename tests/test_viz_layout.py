"""Every figure reads on a notebook screen and on a projector: no text overlaps other text or leaves the figure.

The check draws each renderer on the Agg canvas and records every text artist
that is actually drawn (titles, tick labels, legend entries, the ref-count
chips in the block pool, the ids in the block tables, the "2/3" over
speculative cells), with its bounding box in pixels. Two boxes may not
intersect, and each must lie inside the figure. At the slide preset every
drawn text must also be at least 18 px tall (its font size at the figure's dpi).

A text of one panel may not run into another panel's area either (the
other's background would hide it, as it cut a legend entry to "cache entry
evicted thi"). Inputs cover the cases that broke layouts before: notebook 02's prefix-sharing
run (long titles over a narrow pool), a 128-block pool with a 512-token budget
over 86+ steps, many live rows, a pool wide enough for 32 columns,
speculative runs, and token trees (a real EAGLE-2 run, and random trees of 16 and 32 drafts: the
tree, its mask heat map, and the dashboard's tree panel), and a radix prefix cache's run (the dashboard's radix tree
column), shallow and deep; each at the default size and at the slide size.
"""
import dataclasses
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from minibatch import viz  # noqa: E402
from minibatch.trace import TraceRecorder  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
from random_traces import random_run  # noqa: E402
from synthetic_traces import continuous_traces, static_traces  # noqa: E402

SLIDE_MIN_PX = 18


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def drawn_texts(fig) -> list:
    """[(Text, Bbox in pixels)] of every non-empty text the canvas draws."""
    seen, original = [], Text.draw

    def draw(self, renderer):
        original(self, renderer)
        if self.get_visible() and self.get_text().strip():
            seen.append((self, self.get_window_extent(renderer)))
    Text.draw = draw
    try:
        fig.canvas.draw()
    finally:
        Text.draw = original
    return seen


def text_problems(fig, min_px=None) -> list:
    """What is wrong with the text of ``fig``: overlaps, text outside the figure or under another panel
    (whose background would hide it), text too small."""
    texts = drawn_texts(fig)
    width, height = fig.canvas.get_width_height()
    panels = [ax for ax in fig.axes if ax.patch.get_visible()]
    problems = []
    for i, (a, box) in enumerate(texts):
        for ax in panels:
            if a.axes is not ax:
                dx = min(box.x1, ax.bbox.x1) - max(box.x0, ax.bbox.x0)
                dy = min(box.y1, ax.bbox.y1) - max(box.y0, ax.bbox.y0)
                if dx > 1 and dy > 1:
                    problems.append(f"{a.get_text()!r} runs under the panel titled {ax.get_title(loc='left') or ax.get_title()!r}")
        if box.x0 < -1 or box.y0 < -1 or box.x1 > width + 1 or box.y1 > height + 1:
            problems.append(f"{a.get_text()!r} leaves the {width}x{height} figure: {box.bounds}")
        if min_px and a.get_fontsize() * fig.dpi / 72 < min_px - 1e-6:
            problems.append(f"{a.get_text()!r} is {a.get_fontsize() * fig.dpi / 72:.1f} px, under {min_px}")
        for b, other in texts[i + 1:]:
            dx = min(box.x1, other.x1) - max(box.x0, other.x0)
            dy = min(box.y1, other.y1) - max(box.y0, other.y0)
            if dx > 1 and dy > 1:
                problems.append(f"{a.get_text()!r} overlaps {b.get_text()!r}")
    return problems


def nb02_run():
    """Notebook 02's section 6, recorded once: a shares a 33-byte header with b (prefix cache), c forks."""
    return TraceRecorder.load(FIXTURES / "engine_prefix_sharing.json").traces


def radix_chain():
    """A radix step whose tree is deep, as a long decode grows it (a one-page node per block): the boxes get too
    small for their labels (so they show their lock counts alone)."""
    def deeper(t):
        chain = [[100 + i, t.radix_nodes[-2][0] if i == 0 else 99 + i, 8, [32] * 8, [i], 1, False] for i in range(20)]
        return dataclasses.replace(t, radix_nodes=t.radix_nodes + chain)
    return [deeper(t) for t in TraceRecorder.load(FIXTURES / "engine_radix.json").traces]


RUNS = {
    "synthetic": continuous_traces(),
    "static": static_traces(),
    "prefix-sharing": nb02_run(),
    "engine-ngram": TraceRecorder.load(FIXTURES / "engine_ngram.json").traces,
    "128-blocks-long": random_run(3, num_seqs=16, num_blocks=128, block_size=16, budget=512, output=(20, 60),
                                  arrive_within=50),
    "many-rows": random_run(5, num_seqs=40, num_blocks=96, max_num_seqs=14, budget=256, arrive_within=20),
    "wide-pool": random_run(7, num_seqs=10, num_blocks=300, block_size=4, budget=128),
    "speculative": random_run(9, num_seqs=6, num_blocks=40, k=4, output=(10, 30)),
    "eagle-tree": TraceRecorder.load(FIXTURES / "engine_eagle_tree.json").traces,
    "random-tree": random_run(13, num_seqs=6, num_blocks=60, k=16, output=(10, 30), tree=True),
    "radix": TraceRecorder.load(FIXTURES / "engine_radix.json").traces,
    "radix-chain": radix_chain(),
}
TREE_RUNS = {"eagle-tree": RUNS["eagle-tree"], "random-tree": RUNS["random-tree"],
             "random-tree-32": random_run(17, num_seqs=3, num_blocks=60, k=32, budget=128, output=(20, 40),
                                          tree=True)}


def middle(traces):
    return traces[len(traces) // 2].step


def busiest(traces):
    return max(traces, key=lambda t: len(t.block_tables)).step


def figure_of(result):
    if "fig" in result:
        return result["fig"]
    return result["ax"].figure


RENDERERS = {
    "draw_step": lambda tr, s, p: viz.draw_step(tr, s, preset=p),
    "draw_blocks": lambda tr, s, p: viz.draw_blocks(tr, s, preset=p),
    "draw_block_tables": lambda tr, s, p: viz.draw_block_tables(tr, s, preset=p),
    "draw_timeline": lambda tr, s, p: viz.draw_timeline(tr, upto=s, highlight=s, preset=p),
    "draw_kv_usage": lambda tr, s, p: viz.draw_kv_usage(tr, upto=s, highlight=s, preset=p),
    "draw_throughput": lambda tr, s, p: viz.draw_throughput(tr, upto=s, highlight=s, preset=p),
}
TREE_RENDERERS = {
    "draw_tree": lambda tr, s, p: viz.draw_tree(tr, s, preset=p),
    "draw_tree_mask": lambda tr, s, p: viz.draw_tree_mask(tr, s, preset=p),
    "draw_step": lambda tr, s, p: viz.draw_step(tr, s, preset=p),
}
CASES = ([(name, run) for name in RENDERERS for run in ("synthetic", "prefix-sharing", "128-blocks-long")]
         + [("draw_step", run) for run in RUNS if run not in ("synthetic", "prefix-sharing", "128-blocks-long")]
         + [("draw_blocks", "wide-pool"), ("draw_block_tables", "many-rows"), ("draw_timeline", "many-rows"),
            ("draw_timeline", "speculative")])


@pytest.mark.parametrize("preset", ["default", "slide"])
@pytest.mark.parametrize("renderer,run", CASES)
def test_no_text_overlaps_or_leaves_the_figure(renderer, run, preset):
    traces = RUNS[run]
    steps = {middle(traces), busiest(traces)}
    if renderer in ("draw_blocks", "draw_block_tables"):
        steps.add(traces[-1].step)                         # every table freed: an empty panel
    for step in sorted(steps):
        fig = figure_of(RENDERERS[renderer](traces, step, preset))
        problems = text_problems(fig, SLIDE_MIN_PX if preset == "slide" else None)
        assert not problems, f"{renderer} on {run}, step {step}, {preset}:\n  " + "\n  ".join(problems[:12])
        if preset == "slide":
            assert fig.canvas.get_width_height() == (1920, 1080)
        plt.close("all")


def tree_cases(traces) -> list:
    """The tree steps to draw: the biggest tree (most rows), the deepest path, and one in the middle."""
    views = [viz.step_tree(traces, t.step) for t in traces if viz.tree_steps([t])]
    rows = lambda v: sum(1 for k in v["children"] if not k) + 1                  # noqa: E731
    return sorted({max(views, key=rows)["step"], max(views, key=lambda v: len(v["accepted"]))["step"],
                   views[len(views) // 2]["step"]})


@pytest.mark.parametrize("preset", ["default", "slide"])
@pytest.mark.parametrize("run", list(TREE_RUNS))
@pytest.mark.parametrize("renderer", list(TREE_RENDERERS))
def test_tree_text_fits(renderer, run, preset):
    traces = TREE_RUNS[run]
    for step in tree_cases(traces):
        fig = figure_of(TREE_RENDERERS[renderer](traces, step, preset))
        problems = text_problems(fig, SLIDE_MIN_PX if preset == "slide" else None)
        assert not problems, f"{renderer} on {run}, step {step}, {preset}:\n  " + "\n  ".join(problems[:12])
        if preset == "slide":
            assert fig.canvas.get_width_height() == (1920, 1080)
        plt.close("all")


@pytest.mark.parametrize("preset", ["default", "slide"])
def test_comparison_text_fits(preset):
    a = random_run(11, num_seqs=12, num_blocks=128, block_size=16, budget=256, max_num_seqs=4, arrive_within=0)
    b = random_run(12, num_seqs=12, num_blocks=128, block_size=16, budget=256, max_num_seqs=4, arrive_within=0)
    fig = viz.draw_comparison(a, b, preset=preset)["fig"]
    assert not text_problems(fig, SLIDE_MIN_PX if preset == "slide" else None)


def test_the_checker_sees_overlaps_and_escapes():
    fig = plt.figure(figsize=(4, 3))
    fig.text(0.1, 0.5, "overlapping text")
    fig.text(0.12, 0.5, "overlapping text")
    fig.text(0.95, 0.1, "runs off the right edge")
    ax = fig.add_axes((0.5, 0.6, 0.4, 0.3))
    ax.set_title("a panel")
    fig.text(0.45, 0.7, "runs into the panel")
    problems = text_problems(fig, min_px=18)
    assert any("overlaps" in p for p in problems) and any("leaves" in p for p in problems)
    assert any("runs under the panel titled 'a panel'" in p for p in problems)
    assert any("under 18" in p for p in problems)
