"""The KV cache as a memory hierarchy (engine/memory_hierarchy.py, kv/host_pool.py): swapping and the host tier.

What must hold: greedy output is the same token for token with no memory pressure, under preemption by recompute,
under swapping and with the prefix cache's host tier (both write policies), on every backend, with chunked prefill,
prefix hits, n > 1, speculation, tensor parallelism and the disaggregated pair; seeded sampling too. Each run that
claims swaps or host hits is checked to have them. The allocator's state machine (test_block_allocator.py) runs
again with a host pool whose "KV" is modelled, so a swap or a load-back that returns the wrong content shows.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from minibatch import LLM, SamplingParams
from minibatch.engine.config import EngineConfig
from minibatch.kv.block_pool import hash_block_tokens
from minibatch.kv.host_pool import HostBlockPool, HostPoolFullError
from minibatch.trace import StepTrace, TraceRecorder
from test_block_allocator import BS, AllocatorMachine

PROMPTS = ["def fib(n):\n    ", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n        self.",
           "import os\nimport sys\ndef main():\n", "for i in range(10):\n", "x = [i * i for i in range(",
           "import os\nimport sys\nimport re\n", "def fib(n):\n    if n < 2:\n"]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0)
TIGHT = dict(block_size=8, num_gpu_blocks=22, max_num_seqs=6, max_num_batched_tokens=32)   # preempts, chunks
MODES = {"recompute": {}, "swap": dict(preemption_mode="swap"),
         "offload": dict(kv_offload_space=0.002),
         "swap+write_back": dict(preemption_mode="swap", kv_offload_space=0.002,
                                 kv_offload_write_policy="write_back")}


def _run(model, params=GREEDY, prompts=PROMPTS, **kw):
    llm = LLM(model, **kw)
    rec = TraceRecorder()
    llm.llm_engine.add_hook(rec)
    outs = llm.generate(prompts, params)
    e = llm.llm_engine
    if not hasattr(e, "allocator"):                        # the disaggregated pair: its instances say what they hold
        assert all(p["num_free_blocks"] == p["num_blocks"] for p in e.pool_stats().values()), e.pool_stats()
        return [[c.token_ids for c in o.outputs] for o in outs], rec
    e.allocator.check_invariants([])                       # idle: nothing held on the device ...
    if e.host_pool is not None:
        e.host_pool.check_invariants()
        e.host_pool.check_idle()                           # ... nor swapped in host memory
    return [[c.token_ids for c in o.outputs] for o in outs], rec


def _counts(rec):
    t = rec.traces
    return dict(swapped=sum(len(x.swapped_out) for x in t), back=sum(len(x.swapped_in) for x in t),
                preempted=sum(len(x.preempted) for x in t), hits=t[-1].offload_hits,
                to_host=sum(x.bytes_to_host for x in t), to_device=sum(x.bytes_to_device for x in t))


@pytest.fixture(scope="module")
def free_run(target_model):
    return _run(target_model, block_size=8, max_num_seqs=6, max_num_batched_tokens=32)[0]


@pytest.mark.parametrize("backend", ["loop", "batched", "cpu"])
def test_greedy_equal_in_every_mode_on_every_backend(target_model, free_run, backend):
    seen = {}
    for mode, kw in MODES.items():
        toks, rec = _run(target_model, attention_backend=backend, **TIGHT, **kw)
        assert toks == free_run, f"{mode} on {backend} changed the output"
        seen[mode] = _counts(rec)
    assert seen["recompute"]["preempted"] > 0 and seen["swap"]["swapped"] > 0, seen        # the pool is tight
    assert seen["swap"]["swapped"] == seen["swap"]["back"] and seen["swap"]["preempted"] == 0
    assert seen["swap"]["to_host"] == seen["swap"]["to_device"] > 0                   # every block came back
    assert seen["offload"]["hits"] > 0, seen                    # prefixes the device lost came from the host
    assert seen["swap+write_back"]["swapped"] > 0 and seen["swap+write_back"]["hits"] > 0, seen


@pytest.mark.triton
def test_greedy_equal_under_swap_on_triton(target_model):
    """Smaller: Triton runs through its interpreter on a CPU, a few seconds a step."""
    params, prompts = SamplingParams(max_tokens=10, temperature=0.0), [PROMPTS[i] for i in (0, 1, 4, 5)]
    small = dict(block_size=8, num_gpu_blocks=9, max_num_seqs=4, max_num_batched_tokens=32)
    ref, _ = _run(target_model, params, prompts, block_size=8, max_num_seqs=4)
    toks, rec = _run(target_model, params, prompts, attention_backend="triton", **small, **MODES["swap+write_back"])
    assert toks == ref and _counts(rec)["swapped"] > 0


def test_seeded_sampling_and_n_gt_1_equal_in_every_mode(target_model):
    """n = 2 seeded samples share their prompt's blocks: swapped out together, the shared blocks once."""
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=7, n=2)
    prompts = PROMPTS[:5]
    ref, _ = _run(target_model, params, prompts, block_size=8, max_num_seqs=6)
    for mode, kw in MODES.items():
        toks, rec = _run(target_model, params, prompts, **TIGHT, **kw)
        assert toks == ref, mode
    swapped = [t for t in rec.traces if t.swapped_out]
    assert swapped, "n = 2 under pressure swapped nothing"
    for t in swapped:                       # a request leaves whole: both its samples, or (alone) recomputed
        reqs = {s.split(".")[0] for s in t.swapped_out}
        assert all(sum(s.startswith(r + ".") for s in t.swapped_out) in (1, 2) for r in reqs)


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "draft", "num_speculative_tokens": 3},
                                  {"method": "eagle", "tree": "dynamic", "num_draft_tokens": 8, "depth": 3,
                                   "topk": 2}], ids=["ngram", "draft", "eagle-tree"])
def test_speculation_under_swap_is_lossless(target_model, free_run, spec):
    toks, rec = _run(target_model, speculative_config=spec, **TIGHT, **MODES["swap"])
    assert toks == free_run and _counts(rec)["swapped"] > 0


def test_tensor_parallel_and_disaggregated_under_swap(target_model, free_run, monkeypatch):
    monkeypatch.setenv("MINIBATCH_DIST_TIMEOUT", "30")
    toks, rec = _run(target_model, tensor_parallel_size=2, **TIGHT, **MODES["swap"])
    assert toks == free_run and _counts(rec)["swapped"] > 0
    toks, rec = _run(target_model, disaggregated=True, **dict(TIGHT, num_gpu_blocks=16), **MODES["swap"])
    assert toks == free_run and _counts(rec)["swapped"] > 0


def test_a_full_swap_space_recomputes_instead_and_says_so(target_model, free_run):
    toks, rec = _run(target_model, swap_space=1e-6, **TIGHT, preemption_mode="swap")   # holds a block or two
    assert toks == free_run
    instead = [s for t in rec.traces for s in t.recomputed_instead]
    assert instead and all(s in t.preempted for t in rec.traces for s in t.recomputed_instead)


def test_an_aborted_swapped_request_frees_its_host_blocks(target_model):
    llm = LLM(target_model, **TIGHT, preemption_mode="swap")
    e = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        e.add_request(str(i), p, SamplingParams(max_tokens=32))
    while not e.scheduler.hierarchy.swapped:
        e.step()
    req = e.scheduler.hierarchy.swapped[0]
    held = e.host_pool.num_free_blocks
    e.abort_request(req.request_id)
    assert not e.host_pool.swapped or req.seqs[0].seq_id not in e.host_pool.swapped
    assert e.host_pool.num_free_blocks > held
    while e.has_unfinished_requests():
        e.step()
    e.host_pool.check_invariants()
    e.host_pool.check_idle()


def test_trace_fields_and_replay(target_model, tmp_path):
    _, rec = _run(target_model, **TIGHT, **MODES["swap+write_back"])
    t = next(t for t in rec.traces if t.swapped_out)
    assert t.num_host_blocks > 0 and 0 <= t.num_free_host_blocks <= t.num_host_blocks
    assert t.bytes_to_host == t.blocks_to_host * rec.traces[0].bytes_to_host // max(rec.traces[0].blocks_to_host, 1) \
        or rec.traces[0].blocks_to_host == 0
    assert any(t.host_block_tables for t in rec.traces)
    rec.save(tmp_path / "h.json")
    back = TraceRecorder.load(tmp_path / "h.json")
    assert [x.swapped_out for x in back.traces] == [x.swapped_out for x in rec.traces]
    assert StepTrace.from_dict(rec.traces[0].to_dict()) == rec.traces[0]


@pytest.mark.parametrize("kw, msg", [
    (dict(preemption_mode="swapp"), r"preemption_mode 'swapp'; choose one of \['recompute', 'swap'\]"),
    (dict(swap_space=-1), "swap_space must be a number of GiB >= 0"),
    (dict(swap_space="4"), "swap_space must be a number of GiB >= 0"),
    (dict(kv_offload_space=float("nan")), "kv_offload_space must be a number of GiB >= 0"),
    (dict(kv_offload_write_policy="lazy"), "kv_offload_write_policy 'lazy'"),
    (dict(kv_offload_space=1, enable_prefix_caching=False), "needs enable_prefix_caching=True"),
    (dict(preemption_mode="swap", scheduling="static"), "needs scheduling='continuous'"),
])
def test_bad_configuration_is_a_value_error(kw, msg):
    with pytest.raises(ValueError, match=msg):
        EngineConfig(**kw)


def test_a_host_pool_larger_than_free_memory_is_refused(target_model):
    with pytest.raises(ValueError, match="GiB of host memory; this machine has"):
        LLM(target_model, kv_offload_space=1e6)


def test_host_pool_accounts_its_two_uses_apart():
    host = HostBlockPool(num_swap_blocks=2, num_offload_blocks=2, block_size=4)
    with pytest.raises(HostPoolFullError):                      # 3 distinct blocks > 2 of swap space
        host.swap_out({"a": [5, 6], "a.1": [5, 7]}, {"a": 8, "a.1": 8})
    host.check_invariants()
    pairs = host.swap_out({"a": [5, 6], "a.1": [5, 6]}, {"a": 8, "a.1": 7})    # shared: copied once
    assert [d for d, _ in pairs] == [5, 6] and host.num_swap_used == 2
    assert host.store(1, (0,) * 4) is not None and host.store(2, (1,) * 4) is not None
    assert host.store(3, (2,) * 4) is None          # the tier is full and its LRU entry's block frees next step
    host.begin_step()
    assert host.store(3, (2,) * 4) is not None and not host.contains(1) and host.contains(2)
    assert host.lookup(2, (9,) * 4) is None          # tokens verified: a hash that lies is a miss
    host.check_invariants()
    host.swap_in(["a", "a.1"])
    host.begin_step()
    host.check_invariants()
    host.check_idle()


# -- the allocator's state machine, with a host pool --------------------------------------------------------------
class HierarchyMachine(AllocatorMachine):
    """Adds swap out / swap in of a sequence and its forks, and host-tier store / load-back, with the host's "KV"
    modelled as the device's is: whatever comes back must be what went out."""
    caching = True

    def _host(self):
        if not hasattr(self, "host"):
            self.host = HostBlockPool(6, 4, BS)
            self.host_kv, self.away = [[None] * BS for _ in range(10)], {}     # seq id -> (tokens, computed)
        return self.host

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_out(self, data):
        host = self._host()
        sid = data.draw(st.sampled_from(self.seqs))
        group = [sid]          # (the scheduler passes a request's sequences together; one is the same move)
        try:
            pairs = self.a.swap_out(group, host)
        except HostPoolFullError:
            return
        for d, h in pairs:
            self.host_kv[h] = list(self.kv[d])
        for s in group:
            self.away[s] = (self.tokens.pop(s), self.computed.pop(s))

    @precondition(lambda self: getattr(self, "away", None))
    @rule(data=st.data())
    def swap_in(self, data):
        sid = data.draw(st.sampled_from(sorted(self.away)))
        try:
            pairs = self.a.swap_in([sid], self.host)
        except Exception as e:                             # NoFreeBlocksError: nothing changed
            assert "free" in str(e)
            return
        for h, d in pairs:
            self.kv[d] = list(self.host_kv[h])
        self.tokens[sid], self.computed[sid] = self.away.pop(sid)
        self.host.begin_step()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def offload_and_reload(self, data):
        """Copy a sequence's cached full blocks to the tier; a later lookup of the same chain finds them."""
        host = self._host()
        sid = data.draw(st.sampled_from(self.seqs))
        hashes, table, parent = [], self.a.block_table(sid), None
        for i in range(self.a.num_cached_blocks(sid)):              # the chain's key, from the tokens
            parent = hash_block_tokens(parent, tuple(self.tokens[sid][i * BS:(i + 1) * BS]))
            hashes.append(parent)
        for i, h in enumerate(hashes):
            hb = host.store(h, tuple(self.tokens[sid][i * BS:(i + 1) * BS]))
            if hb is not None:
                self.host_kv[hb] = list(self.kv[table[i]])
        parent = None
        for i, h in enumerate(hashes):
            chunk = tuple(self.tokens[sid][i * BS:(i + 1) * BS])
            assert hash_block_tokens(parent, chunk) == h
            hb = host.lookup(h, chunk)
            if hb is not None:
                assert self.host_kv[hb] == list(chunk), "the tier holds another block's KV under this hash"
            parent = h
        host.begin_step()

    @rule()
    def check_host(self):
        if hasattr(self, "host"):
            self.host.check_invariants()
            assert set(self.host.swapped) == set(self.away)
            for sid, (toks, computed) in self.away.items():
                table = self.host.swapped[sid].blocks
                held = [self.host_kv[table[p // BS]][p % BS] for p in range(computed)]
                assert held == toks[:computed], f"{sid}: host holds {held}"


TestHierarchyMachine = HierarchyMachine.TestCase
TestHierarchyMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


def test_the_radix_cache_under_swap_and_the_host_tier(target_model, free_run):
    """prefix_cache='radix' (kv/radix_allocator.py): swapping and a write-through host tier keyed by the pages'
    chained hashes, computed from the tokens, give the same tokens; write-back is refused with the reason."""
    toks, rec = _run(target_model, prefix_cache="radix", preemption_mode="swap", kv_offload_space=0.002, **TIGHT)
    assert toks == free_run
    c = _counts(rec)
    assert c["swapped"] > 0 and c["hits"] > 0, c
    with pytest.raises(ValueError, match="write_back' needs prefix_cache='hash'"):
        LLM(target_model, prefix_cache="radix", kv_offload_space=0.002, kv_offload_write_policy="write_back")


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "int8"])
def test_a_quantized_blocks_scales_travel_with_it_to_the_host_and_back(dtype):
    """Swap a quantized block out and into another device block: the bytes and the per-(token, head) scales that
    come back are the ones that left (kv_cache.py's swap_out / swap_in)."""
    import torch
    from minibatch.kv.kv_cache import KVCache
    c = KVCache(2, 6, 4, 2, 8, kv_cache_dtype=dtype, scale_granularity="per_token_head")
    torch.manual_seed(0)
    raw = c.kv.view(torch.uint8) if c.kv.element_size() == 1 else c.kv
    raw[:, :, 1] = torch.randint(0, 120, raw[:, :, 1].shape, dtype=raw.dtype)
    c.scales[:, :, 1] = torch.rand(c.scales[:, :, 1].shape) + 0.5
    c.allocate_host(3)
    c.swap_out([(1, 2)])
    c.swap_in([(2, 4)])
    assert torch.equal(raw[:, :, 4], raw[:, :, 1]) and torch.equal(c.scales[:, :, 4], c.scales[:, :, 1])
