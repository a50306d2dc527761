"""Issue 44's prefix-heavy workloads, the offline optimal hit rate, and `bench prefix --small` (bench/prefix.py)."""
import pytest

from minibatch.bench.prefix import _pages, optimal_hit_rate, shared_blocks
from minibatch.bench.workload import WorkloadRequest, few_shot, tree_of_thought


def test_few_shot_is_seeded_interleaved_and_shares_each_template():
    wl = few_shot(3, 4, seed=1)
    assert [r.request_id for r in wl[:4]] == ["t0q0", "t1q0", "t2q0", "t0q1"]      # question-major: interleaved
    assert [r.prompt for r in wl] == [r.prompt for r in few_shot(3, 4, seed=1)]
    assert [r.prompt for r in wl] != [r.prompt for r in few_shot(3, 4, seed=2)]
    for k in range(3):
        group = [r.prompt for r in wl if r.request_id.startswith(f"t{k}q")]
        stem = group[0][:group[0].index("# question:\n")]
        assert len(stem.encode()) >= 224 and all(p.startswith(stem) for p in group) and len(set(group)) == 4
    with pytest.raises(ValueError, match="num_templates"):
        few_shot(0, 2)


def test_tree_of_thought_branches_extend_their_parent():
    wl = tree_of_thought(2, 3, seed=0)
    assert len(wl) == 2 * (1 + 3 + 9) and [r.request_id for r in wl[:3]] == ["x0", "x1", "x0.0"]
    by_id = {r.request_id: r.prompt for r in wl}
    for rid, prompt in by_id.items():
        if "." in rid:
            parent = by_id[rid.rsplit(".", 1)[0]]
            assert prompt.startswith(parent) and len(prompt) > len(parent)


def test_optimal_hit_rate_is_every_lookup_but_each_first_occurrence():
    bs = 4
    # two prompts of one 8-token stem (2 blocks) + their own tails; a third shares nothing
    wl = [WorkloadRequest(f"r{i}", p, 1, 0.0) for i, p in enumerate(["abcdefghXYZW1", "abcdefghQRST2", "zzzzzzzzz"])]
    looked = sum(len(_pages(r.prompt, bs)[0]) for r in wl)                # 3 + 3 + 2 blocks looked up
    assert looked == 8 and shared_blocks(wl, bs) == 2
    distinct = len({k for r in wl for k in _pages(r.prompt, bs)[0]})    # 2 shared + 1 + 1 own + 2 of the third
    expect = (looked - distinct) * bs / sum(r.num_prompt_tokens for r in wl)
    assert optimal_hit_rate(wl, bs) == optimal_hit_rate(wl, bs, pool_blocks=3) == expect == 8 / 35
    assert optimal_hit_rate(wl, bs, pool_blocks=1) < expect            # a pool below the longest request loses some
    fs = few_shot(4, 3)
    looked = sum(len(_pages(r.prompt, 16)[0]) for r in fs)
    distinct = len({k for r in fs for k in _pages(r.prompt, 16)[0]})
    assert optimal_hit_rate(fs, 16) == pytest.approx((looked - distinct) * 16 / sum(r.num_prompt_tokens for r in fs))


def test_bench_prefix_small_prints_every_row_and_the_targets(capsys):
    from minibatch.bench.run import main as bench
    bench(["prefix", "--small"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("full ", "half "))]
    assert len(rows) == 2 * 3 * 2, out                                  # pools x policies x caches
    assert out.count("target:") == 4 and "greedy outputs of every row equal: True" in out
