"""The simulated clock wired through the engine: the KV budget, simulated_duration in traces and stats,
the calibration file's round trip, the ideal FCFS slot schedule."""
import json

import pytest

from minibatch.bench.metrics import fcfs_bound, fcfs_schedule_steps, format_table, static_steps, summarize
from minibatch.engine.config import EngineConfig
from minibatch.llm import LLM
from minibatch.sampling.sampler import SamplingParams
from minibatch.perf.cost import CostModel
from minibatch.perf.hardware import PROFILES, HardwareProfile, load_profile, save_profile
from minibatch.perf.models import get_model
from minibatch.stats import request_stats, run_stats
from minibatch.trace import TraceRecorder

SPEC = "h100:llama-3-8b"


def test_simulated_kv_budget():
    m = get_model("llama-3-8b")
    for util in (0.9, 0.2011):
        want = int((80e9 * util - m.weight_bytes) // (16 * m.kv_bytes_per_token))      # vLLM's formula
        assert CostModel.from_spec(SPEC).num_gpu_blocks(16, util) == want
    # 80 GB x 0.2011 = 16.088 GB, less 16.060 GB of weights = 28.0 MB, / (16 tokens x 128 KiB) = 13 blocks
    assert CostModel.from_spec(SPEC).num_gpu_blocks(16, 0.2011) == 13
    cfg = EngineConfig(simulate=SPEC, gpu_memory_utilization=0.2011, max_num_seqs=4)
    assert cfg.num_blocks_for(512) == 13                                 # binding: the simulated budget
    assert EngineConfig(simulate=SPEC, max_num_seqs=4).num_blocks_for(512) == 4 * 32   # capped at 4 full contexts
    llm = LLM("target", simulate=SPEC, gpu_memory_utilization=0.2011, max_num_seqs=4)
    assert llm.llm_engine.allocator.num_blocks == 13
    with pytest.raises(ValueError, match="blocks"):                       # 13 blocks = 208 tokens: never fits
        llm.generate(["x" * 200], SamplingParams(max_tokens=100))


def test_bad_simulate_input():
    with pytest.raises(ValueError, match="unknown hardware profile 'h1000'.*'h100'"):
        EngineConfig(simulate="h1000:llama-3-8b")
    with pytest.raises(ValueError, match="malformed"):
        EngineConfig(simulate="h100")
    with pytest.raises(ValueError, match="do not fit"):
        EngineConfig(simulate="h100:llama-3-70b").num_blocks_for(512)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_simulated_duration_in_traces_and_stats():
    llm = LLM("target", simulate=SPEC, max_num_seqs=4)
    rec = TraceRecorder()
    llm.llm_engine.add_hook(rec)
    llm.generate(["def f(x):\n", "import os\n", "class A:\n"], SamplingParams(temperature=0, max_tokens=6))
    tr, cm = rec.traces, llm.llm_engine.cost_model
    assert all(t.simulated_duration == cm.step_time(t) > 0 for t in tr)
    assert [t.simulated_time for t in tr] == pytest.approx([sum(x.simulated_duration for x in tr[:i])
                                                           for i in range(len(tr))])
    assert all(t.cpu_duration is not None for t in tr)
    sim, wall = run_stats(tr, clock="simulated"), run_stats(tr)
    assert sim["clock"] == "simulated" and wall["clock"] == "wall"
    assert sim["step_time"] == pytest.approx(sum(t.simulated_duration for t in tr))
    assert sim["prefill_step_time"] + sim["decode_only_time"] == pytest.approx(sim["step_time"])
    r = request_stats(tr, "simulated", slo={"ttft": 1.0, "tpot": 1e-9})
    end = tr[-1].simulated_time + tr[-1].simulated_duration
    assert r["num_finished"] == 3 and r["output_tokens"] == 18
    assert r["output_tokens_per_s"] == pytest.approx(18 / end)
    assert r["slo_attainment"] == 0.0 and r["goodput"] == 0.0             # nobody meets a 1 ns TPOT
    assert request_stats(tr, "simulated", slo={"ttft": 1.0, "tpot": 1.0})["goodput"] == pytest.approx(3 / end)
    # the round trip through JSON keeps the clock
    again = TraceRecorder.load(_save(rec)).traces
    assert run_stats(again, clock="simulated")["step_time"] == sim["step_time"]
    with pytest.raises(ValueError, match="simulated_duration"):
        run_stats([_without_sim(tr[0])], clock="simulated")
    with pytest.raises(ValueError, match="unknown clock"):
        run_stats(tr, clock="gpu")


def _save(rec, _n=[0]):
    import tempfile, os
    path = os.path.join(tempfile.mkdtemp(), "t.json")
    rec.save(path)
    return path


def _without_sim(t):
    from dataclasses import replace
    return replace(t, simulated_duration=None)


def test_summarize_on_the_simulated_clock_says_so():
    from minibatch.bench.run import run_workload
    from minibatch.bench.workload import make_workload
    from minibatch.model.weights import load_model
    wl = make_workload("longtail", num_requests=4, seed=1, arrival="poisson", rate=50.0)
    s, tr, _ = run_workload(load_model("target"), wl, simulate=SPEC, max_num_seqs=4)
    assert s["clock"] == "simulated" and s["num_finished"] == 4
    assert s["wall_time"] >= max(t.simulated_time + t.simulated_duration for t in tr) - 1e-12
    assert s["ttft_p50"] > 0 and s["tpot_p50"] > 0
    assert format_table({"continuous": s}).startswith("clock: simulated")


def test_calibration_file_round_trip(tmp_path):
    prof = HardwareProfile("mine", {"fp32": 5e10}, 2e10, 8e9, 2e-6, step_overhead=1e-3, row_overhead=1e-4,
                           token_overhead=1e-5, sources={"peak_flops": "measured"})
    path = tmp_path / "p.json"
    save_profile(prof, path)
    assert load_profile(path) == prof
    cm = CostModel.from_spec(f"{path}:target")
    assert cm.hw == prof and cm.model.name == "target"
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a calibration file"):
        load_profile(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "minibatch-trace/1"}))
    with pytest.raises(ValueError, match="not a minibatch hardware profile"):
        load_profile(tmp_path / "other.json")
    data = json.loads(path.read_text())
    del data["profile"]["mem_bandwidth"]
    (tmp_path / "short.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="missing.*mem_bandwidth"):
        load_profile(tmp_path / "short.json")
    with pytest.raises(ValueError, match="no calibration file"):
        load_profile(tmp_path / "absent.json")
    assert set(PROFILES) >= {"h100", "h200", "a100", "l4", "rtx4090", "m1-max"}


def test_calibrate_measures_this_machine():
    from minibatch.bench.calibrate import calibrate
    prof = calibrate(fit=False)
    assert prof.peak_flops["fp32"] > 1e8 and prof.mem_bandwidth > 1e8 and 0 < prof.launch_overhead < 1e-3


def test_the_clocks_command_lines_bench_measures_perf_lists(capsys, tmp_path):
    """Calibration and validation drive engines, so they are bench commands (issue 47, item 8: perf's command
    line reached up to bench); ``python -m minibatch.perf`` lists the profiles and names the move."""
    from minibatch.bench.run import main as bench
    from minibatch.perf.__main__ import main as perf
    for cmd in ("calibrate", "validate"):
        with pytest.raises(SystemExit) as e:
            bench([cmd, "--help"])
        assert e.value.code == 0 and f"python -m minibatch.bench {cmd}" in capsys.readouterr().out
        assert perf([cmd]) == 2 and f"`python -m minibatch.bench {cmd}`" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:                  # a file that is not a profile: its reason, exit 2
        bench(["validate", "--profile", str(tmp_path / "absent.json")])
    assert e.value.code == 2 and "no calibration file" in capsys.readouterr().err
    assert perf(["profiles"]) == 0
    out = capsys.readouterr().out
    assert "h100" in out and "llama-3-8b" in out and "sources of the hardware numbers" in out
    with pytest.raises(SystemExit):
        perf(["nonsense"])


def test_ideal_fcfs_slot_schedule_by_hand():
    # slots 2: [5] in slot A; 1, 1, 1 one after the other in slot B -> the run drains at step 5
    assert fcfs_schedule_steps([5, 1, 1, 1], 2) == 5 and static_steps([5, 1, 1, 1], 2) == 6
    # [3, 3, 3] in 2 slots: the third starts at 3 and ends at 6 (the drain the slot bound ignores: 9 / 2 = 4.5)
    assert fcfs_schedule_steps([3, 3, 3], 2) == 6
    assert fcfs_bound([4, 1, 4, 1], 2) == pytest.approx(8 / 5)           # static 4 + 4; FCFS: 4 | 1, 4 -> 5
    with pytest.raises(ValueError):
        fcfs_schedule_steps([], 2)


def test_retime_and_compare_clocks_read_only_the_traces():
    from minibatch.perf import compare_clocks, retime
    llm = LLM("target", max_num_seqs=2)                   # no simulate: a plain run, re-timed afterwards
    rec = TraceRecorder()
    llm.llm_engine.add_hook(rec)
    llm.generate(["def f(x):\n", "import os\n"], SamplingParams(temperature=0, max_tokens=5))
    cm = CostModel.from_spec(SPEC)
    tr = retime(rec.traces, SPEC)
    assert [t.simulated_duration for t in tr] == [cm.step_time(t) for t in tr]
    text = compare_clocks({"a": rec.traces[:3], "b": rec.traces}, SPEC)
    assert "simulated" in text and text.splitlines()[1].split()[:3] == ["a", str(sum(
        len(x.new_token_ids) for t in rec.traces[:3] for x in t.scheduled)), "3"]
    with pytest.raises(ValueError):
        compare_clocks({}, SPEC)


def test_slo_option():
    import argparse
    from minibatch.bench.online import parse_slo
    assert parse_slo("ttft=0.5,tpot=0.05") == {"ttft": 0.5, "tpot": 0.05}
    for bad in ("ttft=0", "latency=1", "ttft"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_slo(bad)
