"""The benchmark scripts run end to end on tiny sizes (their numbers are not checked: speed is
measured in benchmarks, never asserted in unit tests), and what they print is well formed."""
import re

import pytest

from minibatch import bench


def test_bench_batching_prints_both_runs_and_identical_outputs(capsys):
    bench.main(["batching", "--num-requests", "6", "--max-num-seqs", "3", "--repeats", "2"])
    out = capsys.readouterr().out
    assert "static" in out and "continuous" in out
    assert re.search(r"continuous / static throughput: \d+\.\d\dx \(best round of each side of 2; per-round "
                     r"(\d+\.\d\d)-(\d+\.\d\d)\)", out)
    for name in ("static", "continuous"):          # steps = steps with prompt tokens + decode-only steps
        steps, with_prompt, decode_only = map(int, re.search(
            rf"^  {name} +(\d+) +(\d+) in +\d+\.\d\d s +(\d+) in +\d+\.\d\d s +\d+\.\d\d$", out, re.M).groups())
        assert steps == with_prompt + decode_only and with_prompt >= 1 and decode_only >= 1
    assert re.search(r"steps with prompt tokens are \d+% of static's wall time and \d+% of continuous's; the same "
                     r"prompt work \(\d+\.\d\d s, static's\) taken out of both: \d+\.\d\dx", out)
    assert "greedy outputs identical: True" in out
    assert re.search(r"in steps, as the slot model counts: static / continuous = \d+\.\d\dx = \d+\.\d\d of the bound", out)
    assert re.search(r"slot-model bound \d+\.\d\dx \(measured = \d+\.\d\d of it; \d+\.\d\d without the prompt work\); "
                     r"with the longest request's "
                     r"critical path \d+\.\d\dx", out)


def test_bench_batching_compares_the_llama_with_the_gpt_target(capsys):
    bench.main(["batching", "--model", "target,llama", "--num-requests", "4", "--max-num-seqs", "2", "--repeats", "2"])
    out = capsys.readouterr().out
    rows = re.findall(r"^  (\w+) +(GPT|Llama) +[\d,]+ params, (\d) q / (\d) kv heads: +\d+ tok/s \(\d+-\d+\)  "
                      r"(\d+\.\d\d)x \((\d+\.\d\d)-(\d+\.\d\d)\)$", out, re.M)
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("target", "GPT", "4", "4"), ("llama", "Llama", "4", "2")]
    assert rows[0][4:] == ("1.00", "1.00", "1.00")                 # the base against itself


def test_bench_speculative_prints_one_row_per_method_and_k(capsys):
    bench.main(["speculative", "--methods", "draft,ngram,medusa", "--ks", "1,2", "--batch-sizes", "1",
                "--max-tokens", "8", "--repeats", "1"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("low", "high"))]
    # per entropy: each method for k = 1, 2, each timed against plain decoding
    assert [(r[0], r[2], r[3]) for r in rows] == [(e, m, k) for e in ("low", "high")
                                                  for m in ("draft", "ngram", "medusa") for k in ("1", "2")]
    for r in rows:
        k, passes = int(r[3]), int(r[5])
        assert passes == (0 if r[2] in ("ngram", "medusa") else k)       # Medusa: no sequential draft pass
        assert int(r[4].replace(",", "")) == {"draft": 297_600, "ngram": 0, "medusa": 525_312}[r[2]]
        tps, base, speedup = map(float, r[6:9])
        lo, hi = map(float, r[9].split("-"))
        alpha, tau, formula, out_fwd, cost, predicted = map(float, r[10:16])
        by_pos = r[16]
        rounding = 0.005 + 0.05 / base * (1 + tps / base)     # tok/s are printed to 0.1, the ratio to 0.01
        assert abs(speedup - tps / base) <= rounding and lo <= hi and 0.0 <= alpha <= 1.0
        assert by_pos == "-" or (len(by_pos.split("/")) <= k and all(0 <= float(a) <= 1 for a in by_pos.split("/")))
        assert 1.0 <= tau <= k + 1 and 1.0 <= formula <= k + 1 and 1.0 <= out_fwd <= k + 1
        assert cost >= 0 and 0.0 < predicted <= formula


def test_bench_speculative_times_early_exit_with_and_without_kv_reuse(capsys):
    bench.main(["speculative", "--methods", "early_exit", "--ks", "2", "--batch-sizes", "1", "--max-tokens", "8",
                "--repeats", "1", "--kv-reuse", "both"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("low", "high"))]
    assert [(r[0], r[2], r[3], r[5]) for r in rows] == [(e, m, "2", "2") for e in ("low", "high")
                                                        for m in ("early_exit", "ee-recomp")]
    assert rows[0][10:12] == rows[1][10:12], "greedy: reuse and recompute accept the same drafts"


def test_bench_trees_prints_a_chain_then_its_trees_per_method(capsys):
    bench.main(["trees", "--batch-sizes", "1", "--temperatures", "0", "--max-tokens", "8", "--repeats", "1",
                "--prompts", "1", "--depth", "3"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("  0.0")]
    shapes = [(r[2], " ".join(r[3:5])) for r in rows]
    assert shapes == [("medusa", "chain k=3"), ("medusa", "static 8"), ("medusa", "static 16"), ("medusa", "static 32"),
                      ("eagle", "chain k=3"), ("eagle", "dynamic 8/3/2"), ("eagle", "dynamic 16/3/4"),
                      ("eagle", "dynamic 32/3/4")]
    for r in rows:
        passes, nodes, tau, over_chain = int(r[5]), float(r[6]), float(r[7]), float(r[8])
        assert passes == (0 if r[2] == "medusa" else 3)
        assert 1.0 <= tau <= 5 and nodes >= 2 and over_chain > 0
        if r[3] == "chain":
            assert over_chain == 1.0 and nodes <= 4


def test_bench_profile_splits_a_decode_step_into_its_rows(capsys):
    """`bench profile`: one column per backend, every row printed, the shares of a column summing to the step; the
    "batched" column's time includes a gather, the "cpu" column's the C++ operator (when it builds) and no SDPA."""
    from minibatch.bench import step_profile
    from minibatch.kv.backends import cpu_kernel
    cols = "batched,cpu" if cpu_kernel.load() is not None else "batched"
    assert step_profile.main(["--attention-backend", cols, "--max-num-seqs", "3", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    rows = {line[:54].strip(): [float(x.rstrip("%")) for x in line[54:].split()]
            for line in out.splitlines()[2:] if line[:54].strip()}
    assert {name for name, _ in step_profile.ROWS} <= set(rows) and step_profile.PYTHON in rows
    parts = [v for k, v in rows.items() if not k.startswith(("step", "("))]
    for c in range(len(cols.split(","))):
        total = sum(v[2 * c] for v in parts)
        assert abs(total - rows["step, profiled (wall)"][c]) <= 0.02 + 0.01 * total    # the rows add up to the step
    assert rows["K/V gather (index_select of the context)"][0] > 0 and rows["SDPA"][0] > 0
    if "," in cols:
        assert rows["attention: C++ operator, blocks read in place"][2] > 0 and rows["SDPA"][2] == 0


def test_bench_speculative_on_the_llama_prints_the_gpts_rows_after_its_own(capsys):
    from minibatch.model.weights import WEIGHTS_DIR
    if not (WEIGHTS_DIR / "llama_eagle3.safetensors").exists():
        pytest.skip("no shipped llama_eagle3")
    bench.main(["speculative", "--model", "llama", "--methods", "medusa,eagle3", "--ks", "2", "--batch-sizes", "1",
                "--max-tokens", "8", "--repeats", "1"])
    out = capsys.readouterr().out
    sections = re.split(r"^model: ", out, flags=re.M)[1:]
    assert [s.split(";")[0] for s in sections] == ["llama", "target"]
    rows = [[line.split()[2] for line in s.splitlines() if line.startswith(("low", "high"))] for s in sections]
    assert rows == [["medusa", "eagle3"] * 2, ["medusa"] * 2], "the GPT has no EAGLE-3 head: no row for it"
