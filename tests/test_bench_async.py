"""``python -m minibatch.bench async --small``: both modes run, the same tokens, the spans' shares printed."""
import re

from minibatch.bench import asynchronous
from minibatch.bench.run import OTHERS


def test_async_bench_small(capsys):
    assert OTHERS["async"] == "minibatch.bench.asynchronous"          # `python -m minibatch.bench async`
    result = asynchronous.main(["--small"])
    out = capsys.readouterr().out
    rows = result["rows"]
    assert set(rows) == {"sync", "async"} and rows["sync"]["num_steps"] == rows["async"]["num_steps"]
    assert "greedy tokens identical in every round" in out
    assert result["overlap_s"]["sync"] == 0.0 and result["overlap_s"]["async"] > 0.0   # sync's lanes take turns
    assert len(result["ratios"]) == 2 and all(0.0 <= v < 1.0 for v in result["idle"].values())
    line = re.search(r"not overlapped: ([\d.]+)% of the async run \(sync: ([\d.]+)%", out)
    assert line and float(line.group(1)) == round(100 * result["idle"]["async"], 1)
    assert float(line.group(2)) == round(100 * result["idle"]["sync"], 1)
