"""The lecture demo CLI, end to end with small sizes: every scenario runs, writes what it says,
and its recorded trace replays without a model."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from PIL import Image

from minibatch.__main__ import main
from minibatch.trace import TraceRecorder


def _run(capsys, *argv):
    code = main(["demo", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_continuous_vs_static_writes_gif_trace_and_comparison(tmp_path, capsys):
    gif = tmp_path / "cb.gif"
    code, out, _ = _run(capsys, "continuous", "--small", "--out", str(gif))
    assert code == 0
    assert "slot-steps held by finished sequences" in out
    assert "continuous needs" in out
    with Image.open(gif) as im:
        assert im.format == "GIF" and im.n_frames >= 2
    assert (tmp_path / "cb-comparison.png").stat().st_size > 0
    rec = TraceRecorder.load(tmp_path / "cb.json")
    assert rec.meta["scenario"] == "continuous" and rec.traces[0].scheduling == "continuous"
    # the printed step count is the trace's
    assert f"continuous: 6 sequences in {len(rec.traces)} steps" in out


def test_paged_shows_sharing_preemption_and_replays(tmp_path, capsys):
    html = tmp_path / "paged.html"
    code, out, _ = _run(capsys, "paged", "--small", "--out", str(html))
    assert code == 0
    assert "preemption" in out and "prefix cache:" in out and "shared (ref count > 1)" in out
    page = html.read_text()
    assert page.startswith("<!DOCTYPE html>") and "data:image/png;base64" in page
    assert "https://" not in page.split("<body>")[1], "the page must open offline"
    rec = TraceRecorder.load(tmp_path / "paged.json")
    assert any(t.preempted for t in rec.traces)
    assert any(max(t.ref_counts) > 1 for t in rec.traces)
    assert rec.traces[-1].prefix_cache_hits > 0
    # eviction: an entry cached after one step and gone after the next, drawn with its own frame
    from minibatch import viz
    evictions = {t.step: viz.evicted_blocks(rec, t.step) for t in rec.traces}
    assert sum(map(len, evictions.values())) > 0 and "cache entries evicted" in out
    step, gone = next((s, e) for s, e in evictions.items() if e)
    cells = viz.draw_blocks(rec, step)["cells"]
    assert {c["block"] for c in cells if c["evicted"]} == gone
    before = next(t for t in rec.traces if t.step == step - 1)
    assert gone <= set(before.cached_blocks) and not gone & set(next(t for t in rec.traces
                                                                     if t.step == step).cached_blocks)
    # replay: the same summary from the file alone, no model
    code, replay, _ = _run(capsys, str(tmp_path / "paged.json"), "--text")
    assert code == 0 and "step 0 · continuous" in replay
    assert [ln for ln in out.splitlines() if ln.startswith("paged:")] == \
           [ln for ln in replay.splitlines() if ln.startswith("paged:")]


def test_speculative_reports_acceptance_and_writes_slides_to_the_ignored_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)                                   # no --out: the default folder, out/demo/
    code, out, _ = _run(capsys, "speculative", "--small")
    assert code == 0
    gif, trace = tmp_path / "out/demo/speculative.gif", tmp_path / "out/demo/speculative.json"
    with Image.open(gif) as im:                                   # the slide preset's 16:9 frame (small dpi in CI)
        assert im.format == "GIF" and im.size == (768, 432)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing lands beside the code
    rec = TraceRecorder.load(trace)
    assert rec.meta["speculative"] == {"method": "draft", "num_speculative_tokens": 3}
    verify = [s for t in rec.traces for s in t.scheduled if s.proposed]
    # each verify step emits its accepted drafts + 1 (the bonus token, or the correction after a rejection)
    per_forward = sum(s.accepted + 1 for s in verify) / len(verify)
    batched = sum(t.num_batched_tokens for t in rec.traces) / len(rec.traces)
    assert "speculative decoding (draft model, k = 3):" in out and "draft tokens accepted (alpha =" in out
    assert f"tokens per target forward (emitted per sequence: accepted + 1): {per_forward:.2f}" in out
    assert f"tokens per step, batched (all sequences, drafts included):   {batched:.1f}" in out
    emitted = sum(len(s.new_token_ids) for s in verify)
    assert per_forward == pytest.approx(emitted / len(verify))    # what the sequences really got per forward
    from minibatch import viz
    assert "speculative decoding (draft model, k = 3)" in viz.run_title(rec.traces, rec.meta)


def test_tree_draws_each_tree_and_the_step_still(tmp_path, capsys):
    gif = tmp_path / "tree.gif"
    code, out, _ = _run(capsys, "tree", "--small", "--out", str(gif))
    assert code == 0
    with Image.open(gif) as im:                                   # the slide preset's 16:9 frame (small dpi in CI)
        assert im.format == "GIF" and im.size == (768, 432) and im.n_frames >= 2
    with Image.open(tmp_path / "tree-step.png") as im:
        assert im.size == (768, 432)
    rec = TraceRecorder.load(tmp_path / "tree.json")
    assert rec.meta["speculative"]["tree"] == "dynamic" and rec.traces[-1].speculative_method == "eagle"
    trees = [s for t in rec.traces for s in t.scheduled if s.draft_parents]
    assert trees and all(len(s.draft_parents) == s.proposed + 1 and s.root_token_id is not None for s in trees)
    path = sum(s.accepted for s in trees) / len(trees)
    assert "tree speculation (EAGLE-2 dynamic tree" in out and f"{len(trees)} trees verified" in out
    assert f"accepted path: {path:.2f} drafts on average" in out
    assert f"tokens per target forward (emitted per sequence: accepted + 1): {path + 1:.2f}" in out
    emitted = sum(len(s.new_token_ids) for s in trees) / len(trees)
    assert emitted == pytest.approx(path + 1)                    # what the sequences really got per forward
    # every frame carries the tree column, the prefill's too: draw_step on the replayed file
    from minibatch import viz
    first, later = viz.draw_step(rec, rec.traces[0].step), viz.draw_step(rec, rec.traces[1].step)
    assert len(first["fig"].axes) == len(later["fig"].axes) == 6 and later["tree"]["accepted"][0] == 0


def test_text_only_prints_every_step_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = _run(capsys, "static", "--small", "--text")
    assert code == 0
    steps = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert steps and steps[0].startswith("step 0 · static")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv,needle", [
    (["warp-speed"], "unknown demo scenario 'warp-speed'"),
    (["continuous", "--small", "--out", "x.webm"], "cannot save 'x.webm'"),
    (["missing.json"], "missing.json"),
    pytest.param(["continuous", "--small", "--out", "x.mp4"], "needs ffmpeg",
                 marks=pytest.mark.skipif(shutil.which("ffmpeg") is not None,
                                          reason="ffmpeg is installed: .mp4 works here")),
])
def test_bad_demo_input_is_a_clear_error(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(capsys, *argv)
    assert code == 2 and needle in err


@pytest.mark.parametrize("scenario", ["static", "tree"])
def test_text_view_needs_no_matplotlib(tmp_path, scenario):
    """--text is the fallback for machines without graphics: it must run with matplotlib absent (and print
    a token tree as an outline)."""
    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'matplotlib':\n"
        "            raise ImportError('matplotlib is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from minibatch.__main__ import main\n"
        f"sys.exit(main(['demo', {scenario!r}, '--small', '--text']))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # this checkout's minibatch, not an install's
    path = os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "step 0 · continuous" in res.stdout if scenario == "tree" else "step 0 · static" in res.stdout
    assert f"{scenario}: " in res.stdout
    if scenario == "tree":                # the outline: the root, the accepted path marked, the target's token
        assert "\u25cf 0 " in res.stdout and "root, position" in res.stdout and "(the target's token)" in res.stdout
        assert "\u251c\u2500\u25cb" in res.stdout or "\u2514\u2500\u25cb" in res.stdout


def test_async_runs_sync_then_async_and_draws_both_lanes(tmp_path, capsys):
    code, out, _ = _run(capsys, "async", "--small", "--out", str(tmp_path / "a.gif"))
    assert code == 0
    from minibatch.viz.lanes import busy_share
    for mode in ("sync", "async"):
        rec = TraceRecorder.load(tmp_path / f"a-{mode}.json")
        assert rec.meta == {"scenario": "async", "async_scheduling": mode == "async"}
        tokens = sum(len(s.new_token_ids) for t in rec.traces for s in t.scheduled)
        # the printed figures are the trace's
        assert f"{mode:>5}: {len(rec.traces)} steps, {tokens} tokens in " in out
        assert f"model lane busy {busy_share(rec.traces):.0%} of the run" in out
    assert "async / sync wall time:" in out
    with Image.open(tmp_path / "a.png") as im:                    # one still, both runs' lanes
        assert im.size == (768, 432)
