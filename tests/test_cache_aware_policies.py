"""SGLang's cache-aware policies, "lpm" and "dfs-weight" (minibatch/engine/request_queue.py): their orders, the FCFS
fall-back on a long queue, the bound on passing a request over (a stream of hot-prefix requests), the config's
checks, and the engine's tokens under them on both prefix caches."""
import pytest

from minibatch import LLM, SamplingParams
from minibatch.engine.config import EngineConfig
from minibatch.engine.model_runner import ModelRunnerOutput
from minibatch.engine.request_queue import MAX_PASSED_OVER, RequestQueue
from minibatch.engine.scheduler import Scheduler
from minibatch.engine.sequence import Request, Sequence
from minibatch.kv.block_allocator import BlockAllocator
from minibatch.kv.radix_allocator import RadixBlockAllocator


def make(rid, prompt, order, max_tokens=1):
    req = Request(rid, "", list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens),
                  arrival_time=float(order), arrival_order=order)
    seq = Sequence(rid, req, 0, list(prompt))
    req.seqs.append(seq)
    return seq


class Cached:
    """A stand-in allocator: each prompt's cached prefix blocks, by its first token."""

    enable_prefix_caching = True

    def __init__(self, paths):
        self.paths = paths

    def cached_prefix_blocks(self, token_ids):
        return list(self.paths[token_ids[0]])

    def num_cached_prefix_tokens(self, token_ids):
        return 4 * len(self.paths[token_ids[0]])


def queue(policy, paths, **kw):
    q = RequestQueue(policy, **kw)
    for i, first in enumerate(paths):
        q.add(make("abcdefgh"[i], [first, 0], i))
    q.reorder(Cached(paths))
    return [s.seq_id for s in q]


PATHS = {1: (7, 8), 2: (7,), 3: (9,), 4: (7, 8), 5: (), 6: (7, 8, 6)}       # a..f, FCFS


def test_lpm_orders_by_the_longest_cached_prefix_fcfs_among_equals():
    assert queue("lpm", PATHS) == ["f", "a", "d", "b", "c", "e"]


def test_dfs_weight_walks_the_heaviest_subtree_first():
    # (7,) holds 4 requests (a, b, d, f), (9,) one (c); under (7,): (7, 8) holds 3; f is deeper than a and d
    assert queue("dfs-weight", PATHS) == ["f", "a", "d", "b", "c", "e"]
    # a arrived first, alone under (9,); LPM takes it before b and d (one page each), DFS-weight after them
    paths = {1: (9,), 2: (7,), 3: (7, 8), 4: (7,)}
    assert queue("dfs-weight", paths) == ["c", "b", "d", "a"] and queue("lpm", paths) == ["c", "a", "b", "d"]


def test_a_long_queue_falls_back_to_fcfs():
    assert queue("lpm", PATHS, cache_aware_max_waiting=5) == ["a", "b", "c", "d", "e", "f"]
    assert queue("dfs-weight", PATHS, cache_aware_max_waiting=6) == ["f", "a", "d", "b", "c", "e"]


HOT = list(range(1, 13))                                  # 3 full blocks of 4, cached by a first request


@pytest.mark.parametrize("policy, max_num_seqs, cache", [("lpm", 1, "hash"), ("lpm", 3, "radix"),
                                                         ("dfs-weight", 2, "hash"), ("fcfs", 1, "hash")])
def test_a_stream_of_hot_requests_passes_a_cold_one_over_a_bounded_number_of_times(policy, max_num_seqs, cache):
    alloc = (RadixBlockAllocator if cache == "radix" else BlockAllocator)(256, 4)
    sched = Scheduler(alloc, max_num_seqs, 64, policy)
    n = 0

    def step():
        out = sched.schedule()
        sampled = [[200] if s.samples else [] for s in out.scheduled]
        sched.update_from_output(out, ModelRunnerOutput(sampled, [0] * len(sampled), [[] for _ in sampled]))
        alloc.check_invariants(sched.live_seq_ids())
        return [s.seq_id for s in out.admitted]

    sched.add(make("warm", HOT + [0], 0))
    step()                                                # HOT's blocks are cached now
    sched.add(make("cold", [99] * 13, 1))
    admitted, n = [], 2
    while "cold" not in admitted:
        for _ in range(max_num_seqs):                     # the stream: more hot requests than seats, every step
            sched.add(make(f"hot{n}", HOT + [n], n))
            n += 1
        admitted += step()
        assert n < 200, "the cold request was never admitted"
    passed = admitted.index("cold")                       # hot requests, all arrived after it, admitted before it
    assert passed == (0 if policy == "fcfs" else MAX_PASSED_OVER)


def test_the_config_checks_the_policy_and_takes_vllms_name():
    assert EngineConfig(scheduling_policy="lpm").policy == "lpm"
    assert EngineConfig(policy="dfs-weight", scheduling_policy="dfs-weight").policy == "dfs-weight"
    with pytest.raises(ValueError, match="disagree"):
        EngineConfig(policy="priority", scheduling_policy="lpm")
    with pytest.raises(ValueError, match=r"'lifo'; choose one of \['fcfs', 'priority', 'lpm', 'dfs-weight'\]"):
        EngineConfig(scheduling_policy="lifo")
    for policy in ("lpm", "dfs-weight"):
        with pytest.raises(ValueError, match=f"policy '{policy}' orders the queue by the prefix cache, but "
                                             f"enable_prefix_caching is False"):
            EngineConfig(policy=policy, enable_prefix_caching=False)
        with pytest.raises(ValueError, match="enable_prefix_caching is False"):
            Scheduler(BlockAllocator(8, 4, enable_prefix_caching=False), 2, 16, policy)
    with pytest.raises(ValueError, match="cache_aware_max_waiting"):
        EngineConfig(cache_aware_max_waiting=-1)


PREAMBLE = list(b"import os\nimport sys\n\n# shared header for prefix caching\n")
PROMPTS = [list(b"def f(x):\n    return"), PREAMBLE + list(b"def main():"), list(b"class A:\n"),
           PREAMBLE + list(b"x = 1\n"), PREAMBLE + list(b"import re\n")]


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_cache_aware_orders_keep_the_greedy_tokens(target_model, cache):
    params = SamplingParams(temperature=0, max_tokens=8)
    outs = {}
    for policy in ("fcfs", "lpm", "dfs-weight"):
        llm = LLM(target_model, block_size=8, max_num_seqs=2, policy=policy, prefix_cache=cache)
        outs[policy] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert llm.llm_engine.allocator.num_free_blocks == llm.llm_engine.allocator.num_blocks
    assert outs["lpm"] == outs["fcfs"] and outs["dfs-weight"] == outs["fcfs"]
