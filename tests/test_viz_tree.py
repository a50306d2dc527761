"""Token trees drawn (minibatch/viz/tree.py): the tree of one verify step with its accepted path, and its mask.

What must hold, for a real EAGLE-2 run (tests/fixtures/engine_eagle_tree.json) and for random trees:
the accepted path the renderer names and colours is the one the trace recorded; the mask heat map is
``tree.ancestor_mask`` cell for cell (hypothesis draws the parent lists); every node is drawn once, in
its own place, siblings top to bottom in the drafter's order, boxes apart; a step without a tree is a
clear TraceError; a saved trace replays to the same pixels; the text view prints the same tree.
"""
import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from minibatch import viz  # noqa: E402
from minibatch.kv import tree  # noqa: E402
from minibatch.trace import TraceRecorder  # noqa: E402
from minibatch.viz.common import PHASE_COLORS, SPEC_TARGET_COLOR, TraceError  # noqa: E402
from minibatch.viz.tree_data import tree_rows  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
from random_traces import random_run  # noqa: E402

EAGLE = TraceRecorder.load(FIXTURES / "engine_eagle_tree.json")
TREE_STEPS = [(t.step, s) for t in EAGLE.traces for s in t.scheduled if s.draft_parents]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@st.composite
def trees(draw, max_nodes=24):
    """(parents, draft tokens, accepted path, next token): parents first, any shape, a random path."""
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    drafts = [draw(st.integers(0, 255)) for _ in range(n - 1)]
    kids = tree.children(parents)
    path = [0]
    while kids[path[-1]] and draw(st.booleans()):
        path.append(draw(st.sampled_from(kids[path[-1]])))
    return parents, drafts, path, draw(st.integers(0, 255))


def test_the_fixture_has_trees_worth_drawing():
    assert len(TREE_STEPS) >= 8
    # paths through a later sibling: what a chain of first guesses would have lost
    assert any(viz.step_tree(EAGLE, step, s.seq_id)["first_branch_accepted"] < s.accepted for step, s in TREE_STEPS)


@pytest.mark.parametrize("step,s", TREE_STEPS[:6], ids=lambda x: getattr(x, "seq_id", str(x)))
def test_the_accepted_path_is_named_and_coloured_as_accepted(step, s):
    r = viz.draw_tree(EAGLE, step, s.seq_id)
    assert r["accepted"] == s.accepted_path and r["view"]["seq_id"] == s.seq_id
    green, white = to_rgba(PHASE_COLORS["decode"]), to_rgba("#FFFFFF")
    by_state = {state: [n["node"] for n in r["nodes"] if n["state"] == state] for state in ("root", "accepted",
                                                                                            "rejected")}
    assert by_state["root"] == [0]
    assert by_state["accepted"] == sorted(s.accepted_path[1:])
    assert sorted(by_state["accepted"] + by_state["rejected"]) == list(range(1, s.proposed + 1))
    for n in r["nodes"]:                   # the colour said and the colour drawn
        drawn = to_rgba(n["text"].get_bbox_patch().get_facecolor())
        assert drawn == n["color"]
        if n["state"] == "accepted":
            assert drawn == green and n["text"].get_fontweight() == "bold"
        elif n["state"] == "rejected":
            assert drawn == white and to_rgba(n["text"].get_color()) != to_rgba("black")
        else:
            assert drawn == viz.seq_color(s.seq_id, EAGLE.traces)
        assert n["label"] == viz.token_label(([s.root_token_id] + s.draft_token_ids)[n["node"]])
    # the path's edges are the thick green ones, every other edge thin grey
    path_edges = set(zip(s.accepted_path, s.accepted_path[1:]))
    for (p, c), line in r["edges"].items():
        assert s.draft_parents[c] == p
        assert (to_rgba(line.get_color()) == green) == ((p, c) in path_edges)
        assert (line.get_linewidth() > 2) == ((p, c) in path_edges)
    # the target's own token follows the path's last node: a bonus at a leaf, else a correction
    t = r["target"]
    assert t["token"] == s.new_token_ids[s.accepted] and t["after"] == s.accepted_path[-1]
    assert t["kind"] == ("bonus" if s.bonus else "correction") and t["color"] == to_rgba(SPEC_TARGET_COLOR)
    assert t["xy"][0] == r["nodes"][s.accepted_path[-1]]["xy"][0] + 1
    assert t["kind"] in r["ax"].get_title(loc="left")


def test_nodes_sit_by_depth_siblings_in_the_drafters_order_and_boxes_never_touch():
    for step, s in TREE_STEPS:
        r = viz.draw_tree(EAGLE, step, s.seq_id)
        fig = r["ax"].figure
        fig.canvas.draw()
        depth = tree.depths(s.draft_parents)
        xy = {n["node"]: n["xy"] for n in r["nodes"]}
        assert all(xy[i][0] == depth[i] for i in xy)
        for kids in tree.children(s.draft_parents):
            rows = [xy[c][1] for c in kids]
            assert rows == sorted(rows) and len(set(rows)) == len(rows)      # ranked top to bottom
        assert xy[0][1] == 0 and all(xy[i][1] == xy[tree.children(s.draft_parents)[i][0]][1]
                                     for i in xy if tree.children(s.draft_parents)[i])
        boxes = [n["text"].get_bbox_patch().get_window_extent() for n in r["nodes"]] + \
                [r["target"]["text"].get_bbox_patch().get_window_extent()]
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), f"step {step} {s.seq_id}: two node boxes touch"
        plt.close(fig)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees())
def test_the_mask_heat_map_is_the_ancestor_mask(case):
    parents, drafts, path, nxt = case
    trace = viz.tree_trace(parents, drafts, path, nxt, root_token=ord("x"), context_len=7)
    r = viz.draw_tree_mask(trace, 0)
    drawn = np.asarray(r["image"].get_array())
    want = tree.ancestor_mask(parents).numpy()
    assert drawn.shape == want.shape and ((drawn > 0) == want).all()
    on = np.zeros(len(parents), bool)
    on[path] = True
    assert ((drawn == 2) == (want & on[:, None] & on[None, :])).all(), "the accepted path's cells are marked"
    # and rows: a node sees its parent's row plus itself (what ancestor_mask promises, seen in the picture)
    for i in range(1, len(parents)):
        assert ((drawn[i] > 0) == ((drawn[parents[i]] > 0) | (np.arange(len(parents)) == i))).all()
    plt.close("all")


@settings(max_examples=60, deadline=None)
@given(trees(max_nodes=64))
def test_layout_rows_are_a_tidy_tree(case):
    parents, _, path, _ = case
    rows = tree_rows(parents, path[-1])                   # + the target's token, a last child of the path's end
    kids = [list(k) for k in tree.children(parents)] + [[]]
    kids[path[-1]].append(len(parents))
    leaves = [i for i, k in enumerate(kids) if not k]
    assert sorted(rows[i] for i in leaves) == list(range(len(leaves))), "each leaf its own row, no gaps"
    for i, k in enumerate(kids):
        if k:
            assert rows[i] == rows[k[0]], "a parent sits on its first child's row"
            assert [rows[c] for c in k] == sorted({rows[c] for c in k}), "siblings top to bottom in rank order"
    cols = tree.depths(parents) + [tree.depths(parents)[path[-1]] + 1]
    assert len(set(zip(cols, rows))) == len(rows), "two nodes in one place"


def test_a_step_without_a_tree_is_a_clear_error():
    prefill = EAGLE.traces[0].step
    for fn in (viz.draw_tree, viz.draw_tree_mask, viz.step_tree, viz.tree_outline):
        with pytest.raises(TraceError, match=f"step {prefill} verified no drafts.*steps with a token tree: 1"):
            fn(EAGLE, prefill)
    step, s = TREE_STEPS[0]
    with pytest.raises(TraceError, match="'nobody' was not scheduled"):
        viz.draw_tree(EAGLE, step, "nobody")
    plain = TraceRecorder.load(FIXTURES / "engine_continuous.json")
    with pytest.raises(TraceError, match="this run verified no token tree"):
        viz.draw_tree(plain, 3)
    with pytest.raises(TraceError, match="step 999 is not in the trace"):
        viz.draw_tree(EAGLE, 999)


def test_a_chain_step_draws_as_the_chain_tree():
    ngram = TraceRecorder.load(FIXTURES / "engine_ngram.json")
    step, s = next((t.step, s) for t in ngram.traces for s in t.scheduled if s.proposed)
    r = viz.draw_tree(ngram, step, s.seq_id)
    assert r["view"]["chain"] and r["view"]["parents"] == tree.chain_parents(s.proposed)
    assert r["accepted"] == list(range(s.accepted + 1))
    assert r["view"]["kind"].startswith("a chain")


def test_a_saved_trace_replays_to_the_same_pixels(tmp_path):
    path = tmp_path / "tree.json"
    EAGLE.save(path)
    step, s = max(TREE_STEPS, key=lambda x: x[0])
    for draw in (viz.draw_tree, viz.draw_tree_mask):
        pictures = []
        for source in (EAGLE.traces, str(path)):
            fig = plt.figure(figsize=(8, 5), dpi=60)
            r = draw(source, step, s.seq_id, ax=fig.add_subplot())
            fig.canvas.draw()
            pictures.append((np.asarray(fig.canvas.buffer_rgba()).copy(), r["accepted"]))
            plt.close(fig)
        (a, path_a), (b, path_b) = pictures
        assert path_a == path_b == s.accepted_path
        assert (a == b).all(), f"{draw.__name__}: the replay draws other pixels"


def test_a_trace_without_the_root_token_finds_it_in_the_steps_before(tmp_path):
    data = json.loads((FIXTURES / "engine_eagle_tree.json").read_text())
    for t in data["traces"]:
        for s in t["scheduled"]:
            s.pop("root_token_id")                         # as recorded before SeqStep had the field
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    for step, s in TREE_STEPS:
        assert viz.step_tree(old, step, s.seq_id)["tokens"][0] == s.root_token_id
    assert viz.step_tree(viz.as_traces(old)[2], 2, TREE_STEPS[0][1].seq_id)["labels"][0] == "?"   # no history


def test_the_text_outline_is_the_same_tree():
    for step, s in TREE_STEPS[:6]:
        text = viz.tree_outline(EAGLE, step, s.seq_id)
        lines = text.splitlines()
        assert len(lines) == s.proposed + 2                # root, every draft, the target's token
        marked = [int(ln.split("\u25cf ")[1].split()[0]) for ln in lines if "\u25cf " in ln]
        assert marked == s.accepted_path                   # depth first, so the path comes in order
        assert sum("\u25cb " in ln for ln in lines) == s.proposed - s.accepted
        kind = "bonus" if s.bonus else "correction"
        assert f"\u25b6 {viz.token_label(s.new_token_ids[s.accepted])}  {kind}" in lines[-1] or \
            any(f"\u25b6 {viz.token_label(s.new_token_ids[s.accepted])}  {kind}" in ln for ln in lines)
    view = viz.text_view(next(t for t in EAGLE.traces if t.step == TREE_STEPS[0][0]))
    assert "tree " in view and "root, position" in view


def test_the_dashboard_shows_the_tree_panel_in_every_frame_of_a_tree_run():
    step, s = TREE_STEPS[0]
    r = viz.draw_step(EAGLE, step)
    assert r["tree"] is not None and r["tree"]["view"]["seq_id"] == s.seq_id
    assert r["tree"]["accepted"] == s.accepted_path
    labels = {h.get_label() for h in r["legend"]}
    assert {"accepted draft", "rejected draft", "target's token"} <= labels
    other = TREE_STEPS[1][1].seq_id
    assert viz.draw_step(EAGLE, step, tree_seq=other)["tree"]["view"]["seq_id"] == other
    prefill = viz.draw_step(EAGLE, EAGLE.traces[0].step)
    assert prefill["tree"] is None and len(prefill["fig"].axes) == len(r["fig"].axes)
    assert any("no token tree" in t.get_text() for ax in prefill["fig"].axes for t in ax.texts)
    # a run without trees keeps its two columns
    assert viz.draw_step(TraceRecorder.load(FIXTURES / "engine_ngram.json"), 3)["tree"] is None
    assert "tree speculation (EAGLE-2 dynamic tree, up to 16 drafts)" in viz.run_title(EAGLE)


def test_token_labels_are_readable():
    assert [viz.token_label(t) for t in (97, 32, 10, 39, 0xE2, None)] == \
        ["'a'", "' '", "'\\n'", '"\'"', "'\\xe2'", "?"]


def test_random_tree_runs_draw():
    traces = random_run(4, num_seqs=5, num_blocks=40, k=12, output=(8, 20), tree=True)
    steps = viz.tree_steps(traces)
    assert steps
    for step in steps[:5]:
        view = viz.step_tree(traces, step)
        r = viz.draw_tree(traces, step)
        assert r["accepted"] == view["accepted"]
        plt.close("all")
