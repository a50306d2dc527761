"""Disaggregated prefill/decode (minibatch/disagg/instance.py): two real engine processes, K/V over gloo.

One pair of instances serves every case here (each start costs two fresh interpreters on 2 cores)."""
from __future__ import annotations

import pytest

from minibatch import LLM, SamplingParams
from minibatch.disagg.instance import InstanceDied
from minibatch.distributed.kv_transfer import transfer_bytes
from minibatch.trace import TraceRecorder

PROMPTS = ["def fib(n):\n    ", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n        self.",
           "import os\nimport sys\n", "x", "# a long prompt, chunked on the prefill side\n" + "y = 1\n" * 40]


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch):
    monkeypatch.setenv("MINIBATCH_DIST_TIMEOUT", "20")


def _toks(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_disaggregated_equals_colocated_and_leaks_nothing(target_model, tmp_path):
    kw = dict(max_num_seqs=4, block_size=8, max_num_batched_tokens=64)   # 64: the long prompt takes 5 chunks
    greedy = SamplingParams(temperature=0, max_tokens=24)
    seeded = [SamplingParams(temperature=0.9, seed=i, max_tokens=24) for i in range(len(PROMPTS))]
    one = LLM(target_model, **kw)
    want = _toks(one.generate(PROMPTS, greedy)), _toks(one.generate(PROMPTS, seeded))
    two = LLM(target_model, disaggregated=True, **kw)
    rec = TraceRecorder()
    two.llm_engine.add_hook(rec)
    try:
        got = _toks(two.generate(PROMPTS, greedy)), _toks(two.generate(PROMPTS, seeded))
        assert got == want                           # greedy token for token; seeded too (the generator moves)
        # one short request finishes on the prefill side alone: no transfer
        assert len(_toks(two.generate(["def"], SamplingParams(temperature=0, max_tokens=1)))[0]) == 1
        eng = two.llm_engine
        assert len(eng.transfers) == 2 * len(PROMPTS)
        for tr in eng.transfers:
            assert tr.nbytes == transfer_bytes(4, tr.num_tokens, 4, 64, 4) and tr.dst_blocks
        # the repeated prompt hit the decode side's prefix cache the second time: its blocks were not rewritten,
        # yet the outputs above are still the colocated ones
        repeats = [tr for tr in eng.transfers if tr.num_tokens == len(PROMPTS[1])]
        assert len(repeats) == 4 and len({tuple(tr.dst_blocks[:2]) for tr in repeats}) == 1
        kinds = {t.instance for t in rec.traces}
        assert kinds == {"prefill", "decode"}
        assert all(s.phase != "decode" for t in rec.traces if t.instance == "prefill" for s in t.scheduled)
        assert all(s.phase == "decode" for t in rec.traces if t.instance == "decode" for s in t.scheduled)
        stats = eng.pool_stats()                     # the invariant checker ran on both pools
        assert {n: (s["num_free_blocks"], s["live"]) for n, s in stats.items()} == \
            {n: (s["num_blocks"], 0) for n, s in stats.items()}
        assert stats["decode"]["prefix_cache_hits"] >= 3 * 2       # 3 repeats of 2 full blocks
        _drawn(rec, eng.transfers, tmp_path)
    finally:
        two.llm_engine.shutdown()


def test_bad_input_and_a_decode_instance_killed_in_flight(target_model):
    with pytest.raises(ValueError, match="does not speculate"):
        LLM(target_model, disaggregated=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    llm = LLM(target_model, disaggregated=True, max_num_seqs=4)
    eng = llm.llm_engine
    try:
        with pytest.raises(ValueError, match="n = 1"):
            eng.add_request("r", "x", SamplingParams(n=2))
        for i in range(3):
            eng.add_request(f"r{i}", "def f():\n", SamplingParams(temperature=0, max_tokens=200))
        while not any(where == "decode" for where in eng.requests.values()):
            eng.step()
        eng._procs["decode"].kill()
        with pytest.raises(InstanceDied, match=r"the decode instance \(exit code -9\) died; requests reported failed: "
                                               r"\['r0', 'r1', 'r2'\]"):
            while eng.has_unfinished_requests():
                eng.step()
        assert not eng.has_unfinished_requests()
        stats = eng.pool_stats()                     # the prefill instance lives on, its pool whole
        assert stats["prefill"]["num_free_blocks"] == stats["prefill"]["num_blocks"]
    finally:
        eng.shutdown()


def _drawn(rec, transfers, tmp_path):
    """The renderer and the demo's files, on this run's traces: both pools, an arrow per block moved."""
    import dataclasses

    from minibatch.bench.demo import run_demo
    from minibatch.bench.demo_disagg import write
    from minibatch.viz.disagg import draw_frame, frames
    chosen = frames(rec.traces, transfers, max_frames=1000)
    moved = [f for f in chosen if f[3] and f[1] is not None and f[2] is not None]   # both pools drawn
    assert sum(len(f[3]) for f in chosen) == len(transfers) and moved
    drawn = draw_frame(rec.traces, transfers, moved[0])
    assert len(drawn["arrows"]) == sum(min(len(t.src_blocks), len(t.dst_blocks)) for t in moved[0][3]) > 0
    rec.meta["scenario"], rec.meta["transfers"] = "disaggregated", [dataclasses.asdict(t) for t in transfers]
    gif, json_path = write(rec, tmp_path / "d.gif", small=True)
    assert gif.stat().st_size > 0 and json_path.is_file()
    assert run_demo(str(json_path), out=str(tmp_path / "replay.png")) == 0      # no model: the saved run
    assert (tmp_path / "replay.png").stat().st_size > 0


def test_the_simulated_pair_decodes_what_one_engine_does_and_pays_the_transfer(target_model):
    """disagg/sim.py: two in-process engines on one simulated clock; same tokens as a colocated engine,
    and no first decode step before its transfer could have crossed the interconnect."""
    from minibatch.bench.workload import make_workload
    from minibatch.disagg.sim import run_disaggregated_simulated
    from minibatch.perf.cost import CostModel
    wl = make_workload("longtail", num_requests=6, seed=1, arrival="poisson", rate=50.0, prompt_len=(40, 120))
    traces, arrivals = run_disaggregated_simulated(target_model, wl, "h100:llama-3-8b", max_num_seqs=4)
    toks = {}
    for t in traces:
        for s in t.scheduled:
            toks.setdefault(s.request_id, []).extend(s.new_token_ids)
    one = LLM(target_model, max_num_seqs=4)
    want = {r.request_id: o.outputs[0].token_ids
            for r, o in zip(wl, one.generate([r.prompt for r in wl], [r.sampling_params() for r in wl]))}
    assert toks == want
    cost = CostModel.from_spec("h100:llama-3-8b")
    first_prefill = {s.request_id: t.simulated_time + t.simulated_duration
                     for t in traces if t.instance == "prefill" for s in t.scheduled if s.new_token_ids}
    first_decode = {}
    for t in traces:
        if t.instance == "decode":
            for s in t.scheduled:
                first_decode.setdefault(s.request_id, t.simulated_time)
    for r in wl:
        if r.request_id in first_decode:
            crossing = cost.model.kv_bytes_per_token * len(r.prompt.encode()) / cost.hw.interconnect_bandwidth
            assert first_decode[r.request_id] >= first_prefill[r.request_id] + crossing - 1e-12
    assert set(first_decode) and {t.instance for t in traces} == {"prefill", "decode"}
