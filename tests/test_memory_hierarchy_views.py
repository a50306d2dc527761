"""The memory hierarchy's benches, demo and views (issue 43; the engine side is tests/test_memory_hierarchy.py).

The benches' --small runs complete and print their tables (each asserts inside that every run's greedy output is
the unpressured one's); the multi-turn workload is what it says; the block view draws the host pool from the trace
alone (swapped blocks in their owner's colour, host-tier blocks grey, arrivals framed); the text view prints swaps
and host-tier hits; the hierarchy demo renders as text and as a .png, and its trace shows both mechanisms.
"""
import dataclasses
import pathlib
import re
import sys

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from minibatch import viz  # noqa: E402
from minibatch.__main__ import main  # noqa: E402
from minibatch.bench.workload import multi_turn_chat  # noqa: E402
from minibatch.trace import TraceRecorder  # noqa: E402
from minibatch.viz.host_pool import ARRIVED_COLOR, HOST_TIER_COLOR, host_cells  # noqa: E402
from minibatch.viz.text import text_view  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent / "fixtures"))
from synthetic_traces import continuous_traces  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_multi_turn_chat_each_turn_extends_the_last():
    wl = multi_turn_chat(3, 3, seed=4)
    assert [r.request_id for r in wl[:4]] == ["c0t0", "c1t0", "c2t0", "c0t1"]      # interleaved, turn-major
    by_id = {r.request_id: r for r in wl}
    for r in wl:
        if r.after is not None:
            prev = by_id[r.after]
            assert (prev.conversation, prev.turn + 1) == (r.conversation, r.turn)
            assert r.prompt.startswith(prev.prompt) and len(r.prompt) > len(prev.prompt)
    assert len({r.prompt[:40] for r in wl if r.turn == 0}) == 3                      # conversations differ
    assert [r.prompt for r in multi_turn_chat(3, 3, seed=4)] == [r.prompt for r in wl]
    with pytest.raises(ValueError, match="max_len"):
        multi_turn_chat(2, 30)


def test_bench_preemption_and_offload_small_print_their_tables(capsys):
    from minibatch.bench.run import main as bench
    bench(["preemption", "--small"])
    out = capsys.readouterr().out
    for bs in (8, 64):
        assert re.search(rf"block +{bs} .* \d+ \(\d+\) / \d+$", out, re.M), out      # swapped (blocks) / preempted
        assert re.search(rf"block +{bs} .*x \| .*x \|", out), out                   # the simulated H100 row
        assert re.search(rf"^ +{bs} \| +[\d.]+ms", out, re.M), out                    # one request: swap vs prefill
    assert "equal the unpressured run's: True (asserted)" in out and "Fig. 19" in out
    bench(["offload", "--small"])
    out = capsys.readouterr().out
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^  (device only|write_through|write_back) +\S+ +(\S+)",
                                                          out, re.M)}
    assert len(re.findall(r"^  write_through", out, re.M)) == 2, out                 # a row on each clock
    assert rows["device only"] == "-" and rows["write_through"].endswith("%") and rows["write_back"] != "0%"
    assert "greedy outputs of every row equal: True (asserted)" in out


def _with_host(t, tables, tier, n=8):
    return dataclasses.replace(t, num_host_blocks=n, num_free_host_blocks=n - len({b for v in tables.values()
                                                                                      for b in v}) - len(tier),
                               host_block_tables=tables, offloaded_blocks=sorted(tier), offload_queries=4,
                               offload_hits=3)


def test_block_view_draws_the_host_pool_from_the_trace():
    cont = continuous_traces()
    seqs = sorted(cont[2].block_tables)
    traces = [_with_host(t, {}, set()) for t in cont[:2]] + \
             [_with_host(cont[2], {seqs[0]: [0, 1]}, {3, 5})] + \
             [_with_host(cont[3], {seqs[0]: [0, 1]}, {3, 5, 6})] + cont[4:]
    order = viz.seq_order(traces)
    res = viz.draw_blocks(traces, traces[3].step)
    cells = {c["block"]: c for c in res["host"]["cells"]}
    assert [cells[b]["state"] for b in range(8)] == ["swapped", "swapped", "free", "offloaded", "free",
                                                    "offloaded", "offloaded", "free"]
    assert [b for b, c in cells.items() if c["arrived"]] == [6]       # only block 6 reached host this step
    for b, c in cells.items():
        face, edge = c["patches"][0].get_facecolor(), c["patches"][0].get_edgecolor()
        want = {"swapped": viz.seq_color(seqs[0], order), "offloaded": HOST_TIER_COLOR, "free": "white"}[c["state"]]
        assert to_rgba(face) == pytest.approx(to_rgba(want)), b
        assert (to_rgba(edge) == pytest.approx(to_rgba(ARRIVED_COLOR))) == c["arrived"], b
    assert "host pool: 2 swapped" in res["host"]["ax"].get_title(loc="left")
    assert {h.get_label() for h in res["legend"]} >= {"host tier (prefix copy)", "swapped out (its sequence's colour)"}
    assert viz.draw_blocks(cont, 3)["host"] is None                   # no host pool: nothing drawn for it
    assert viz.draw_step(traces, traces[2].step)["blocks"]["host"] is not None
    assert host_cells(traces, traces[2].step)[0]["arrived"]           # swapped out in step 2
    bad = _with_host(cont[2], {seqs[0]: [9]}, set())
    with pytest.raises(ValueError, match="host block 9"):
        host_cells([bad], bad.step)


def test_hierarchy_demo_renders_as_text_and_png(tmp_path, capsys):
    assert main(["demo", "hierarchy", "--small", "--text"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"swapped out: \S+", text) and "host tier: " in text
    png = tmp_path / "h.png"
    assert main(["demo", "hierarchy", "--small", "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.stat().st_size > 0 and "memory hierarchy (" in out
    rec = TraceRecorder.load(tmp_path / "h.json")
    t = rec.traces
    assert sum(len(x.swapped_out) for x in t) == sum(len(x.swapped_in) for x in t) > 0
    assert t[-1].offload_hits > 0
    assert f"{t[-1].offload_hits} of {t[-1].offload_queries} blocks that missed the device pool" in out
    step = next(x for x in t if x.swapped_out)
    assert f"swapped out: {', '.join(step.swapped_out)}" in text_view(step)
