"""The benchmark scripts run end to end on tiny sizes (their numbers are not checked: speed is
measured in benchmarks, never asserted in unit tests), and what they print is well formed."""
import re

from minibatch import bench


def test_bench_batching_prints_both_runs_and_identical_outputs(capsys):
    bench.main(["batching", "--num-requests", "6", "--max-num-seqs", "3"])
    out = capsys.readouterr().out
    assert "static" in out and "continuous" in out
    assert re.search(r"continuous / static throughput: \d+\.\d\dx", out)
    assert "greedy outputs identical: True" in out


def test_bench_speculative_prints_one_row_per_method_and_k(capsys):
    bench.main(["speculative", "--ks", "1,2", "--batch-sizes", "1", "--max-tokens", "8", "--repeats", "1"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("low", "high"))]
    # per entropy: draft and ngram for k = 1, 2, each timed against plain decoding
    assert [(r[0], r[2], r[3]) for r in rows] == [(e, m, k) for e in ("low", "high")
                                                  for m in ("draft", "ngram") for k in ("1", "2")]
    for r in rows:
        k = int(r[3])
        tps, base, speedup, alpha, tok_fwd, formula, predicted = map(float, r[4:11])
        rounding = 0.005 + 0.05 / base * (1 + tps / base)     # tok/s are printed to 0.1, the ratio to 0.01
        assert abs(speedup - tps / base) <= rounding and 0.0 <= alpha <= 1.0
        assert 1.0 <= tok_fwd <= k + 1 and 1.0 <= formula <= k + 1 and 0.0 < predicted <= formula
