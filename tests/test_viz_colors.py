"""Sequence colours: two sequences alive at the same time never share one (property-tested).

``demo continuous`` once coloured r1 and r10 alike while both ran, because the
palette cycled every 9 sequences. The rule now: colours are assigned over
lifetimes, so concurrent sequences differ in every view. Hypothesis draws
random runs of a toy engine (tests/fixtures/random_traces.py: arrivals,
chunked prefill, preemption and recompute, speculation, evictions) and checks
the rule, the palette's size, and that the views draw the assigned colours.
"""
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from minibatch import viz  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent / "fixtures"))
from random_traces import random_run  # noqa: E402

# the run's parameters, not the traces, are what a failing example prints
run_params = st.fixed_dictionaries(dict(
    seed=st.integers(0, 10_000), num_seqs=st.integers(1, 40), num_blocks=st.integers(12, 80),
    block_size=st.sampled_from([4, 8, 16]), max_num_seqs=st.integers(1, 14), budget=st.sampled_from([16, 32, 64, 256]),
    k=st.sampled_from([0, 0, 3]), arrive_within=st.integers(0, 60)))


def hex_rgba(colors):
    return {to_rgba(c) for c in colors}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run_params)
def test_concurrent_sequences_never_share_a_colour(params):
    traces = random_run(**params)
    order = viz.seq_order(traces)
    alive = viz.alive_sets(traces)
    most = max((len(a) for a in alive), default=0)
    for t, live in zip(traces, alive):
        colors = [viz.seq_color(s, order) for s in live]
        assert len(set(colors)) == len(colors), f"step {t.step}: {sorted(live)} share colours"
        # everything that holds blocks or runs is alive: the pool can never show two owners alike
        assert set(t.block_tables) | set(t.running) | {s.seq_id for s in t.scheduled} <= live
    used = {viz.seq_color(s, order) for s in order}
    # as few colours as the busiest step needs (interval colouring), from a colour-blind-safe palette
    assert len(used) == max(most, 1) or not alive
    palette = viz.SEQ_PALETTE if most <= len(viz.SEQ_PALETTE) else viz.SEQ_PALETTE_LARGE
    assert used <= hex_rgba(palette)


def test_two_runs_side_by_side_colour_each_run_separately():
    """draw_comparison colours the concatenation of two runs: each run's steps restart at 0, and a request
    alive in one run must not make it 'concurrent' with everything in the other."""
    a = random_run(1, num_seqs=12, max_num_seqs=4, arrive_within=0)
    b = random_run(1, num_seqs=12, max_num_seqs=4, arrive_within=0)
    order = viz.seq_order(a + b)
    assert len({viz.seq_color(s, order) for s in order}) <= len(viz.SEQ_PALETTE)
    for live in viz.alive_sets(a + b):
        assert len({viz.seq_color(s, order) for s in live}) == len(live)


def test_more_than_nine_at_once_switch_to_the_larger_palette():
    traces = random_run(4, num_seqs=14, num_blocks=200, max_num_seqs=14, arrive_within=0, output=(30, 40))
    order = viz.seq_order(traces)
    assert max(len(a) for a in viz.alive_sets(traces)) > 9
    used = {viz.seq_color(s, order) for s in order}
    assert used <= hex_rgba(viz.SEQ_PALETTE_LARGE) and len(used) > 9


@pytest.mark.parametrize("seed", [0, 1])
def test_views_draw_the_assigned_colours(seed):
    """The block pool, the block tables and the timeline labels all wear seq_color(...): the rule holds on screen."""
    traces = random_run(seed, num_seqs=20, num_blocks=64, max_num_seqs=6, arrive_within=10)
    order = viz.seq_order(traces)
    t = max(traces, key=lambda t: len(t.block_tables))
    res = viz.draw_blocks(traces, t.step)
    for cell in res["cells"]:
        if cell["state"] == "used":
            assert [p.get_facecolor() for p in cell["patches"]] == \
                [pytest.approx(viz.seq_color(s, order)) for s in cell["owners"]]
    drawn = [res["tables"]["patches"][s][0].get_facecolor() for s in t.block_tables if t.block_tables[s]]
    assert len(set(map(tuple, drawn))) == len(drawn)             # live tables: all different colours
    timeline = viz.draw_timeline(traces)
    for label in timeline["ax"].get_yticklabels():
        sid = label.get_text()                                    # ids as short as "r12" are shown whole
        assert label.get_bbox_patch().get_facecolor() == pytest.approx(viz.seq_color(sid, order))
    plt.close("all")
