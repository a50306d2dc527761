"""The online bench (latency against load) runs end to end on tiny sizes and writes its PNG.

Its numbers are not checked (speed is measured by the bench, never asserted in unit tests); the shape of
what it prints and writes is."""
import argparse
import re

import pytest

from minibatch.bench import online


def test_online_smoke_writes_a_png_and_a_row_per_scheduler_and_rate(tmp_path, capsys):
    out = tmp_path / "curve" / "online.png"                # a folder that does not exist yet
    assert online.main(["--rates", "200,100", "--num-requests", "3", "--max-num-seqs", "2", "--repeats", "1",
                        "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    text = capsys.readouterr().out
    rows = re.findall(r"^\s*(\d+)\s+(static|continuous)\s+\d+ \(\d+-\d+\)\s+\d+\.\d \(", text, re.M)
    assert rows == [("100", "static"), ("100", "continuous"), ("200", "static"), ("200", "continuous")]
    assert len(re.findall(r"req/s: throughput [\d.e-]+x, normalised latency [\d.e-]+x, TTFT p99 [\d.e-]+x", text)) == 2
    assert f"wrote {out}" in text


def test_normalised_latency_is_the_mean_of_e2e_over_output_tokens():
    class M:
        def __init__(self, e2e, n):
            self.e2e_latency, self.num_output_tokens = e2e, n

    class O:
        def __init__(self, e2e, n):
            self.metrics = M(e2e, n)

    assert online.normalised_latency({"a": O(2.0, 4), "b": O(1.0, 1)}) == pytest.approx((0.5 + 1.0) / 2)


@pytest.mark.parametrize("bad", ["", "fast", "4,-1", "0", "2,2", "inf"])
def test_bad_rates_are_refused_with_a_reason(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="rates must be"):
        online.parse_rates(bad)


def test_small_ratios_keep_their_digits():
    assert online._x(2.456) == "2.46x" and online._x(0.0031) == "0.0031x"


def test_rates_are_sorted_and_bad_options_exit():
    assert online.parse_rates("8, 2,4") == [2.0, 4.0, 8.0]
    with pytest.raises(SystemExit):
        online.main(["--rates", "2,x"])
    with pytest.raises(SystemExit):
        online.main(["--out", "curve.jpg"])
