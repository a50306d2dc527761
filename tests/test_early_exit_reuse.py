"""Early exit's KV reuse (LayerSkip, Elhoushi et al. 2024 §4.2): the verify starts at block E for the rows the
drafter already ran through blocks 0 .. E-1, and nothing changes but the work done.

* ``GPT.forward(start_layer=E, start_hidden=...)`` continues a forward exactly where ``exit_layer=E`` left it.
* Greedy output equals plain greedy decoding token for token with reuse on, across k and block sizes 4, 8,
  16, with prefix caching, preemption, chunked prefill (token budgets that cut proposals), static batching
  (padding rows beside the verify), n > 1 and requests that stop mid-draft, greedy and sampled rows, and on
  the loop and Triton backends; the allocator's invariants hold after every step and no block leaks.
* Reuse really happens: in every verify forward, blocks 0 .. E-1 see each sequence's rows after the ones the
  drafter fed with the same tokens: 1 row per sequence (0 when the budget cut its drafts), not 1 + k.
* The cache afterwards holds, at every layer, what a plain prefill of the same tokens writes; blocks that
  are shared (prefix cache, forks), free or cached are never written.
* A verify whose drafts are not what the drafter fed reuses only the rows up to the first that differs.
The sampled check (chi-square) runs with reuse on, by default, in tests/test_spec_methods.py.
"""
import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.model.model import DenseAttention
from minibatch.model.weights import WEIGHTS_DIR
from minibatch.trace import TraceRecorder
from test_engine import MAX_TOKENS, PROMPTS
from test_spec_methods import GREEDY, refs  # noqa: F401 (fixture)
from test_tree_spec import cached_kv

pytestmark = pytest.mark.skipif(not (WEIGHTS_DIR / "early_exit.safetensors").exists(),
                                reason="no shipped early-exit adapter")


def spec(k, kv_reuse=True):
    return {"method": "early_exit", "num_speculative_tokens": k, "kv_reuse": kv_reuse}


class Probe:
    """Watches an engine: the allocator's invariants after every step; and, in every model-runner forward, the
    rows blocks 0 and E see against the rows a reusing verify should send through blocks 0 .. E-1."""

    def __init__(self, llm):
        eng = self.eng = llm.llm_engine
        self.prop, model, self.E = eng.proposer, eng.model, eng.proposer.E
        self.fed = {}                    # seq id -> (m, tokens the drafter fed at m, m + 1, ...), last propose
        self.steps = []                  # per forward: (rows through block 0, through block E, expected at 0)
        self.cut = self.verified = 0     # verifies whose drafts the token budget cut; verifies
        self.padded = 0                  # verifying steps with static batching's padding rows beside them
        self.counting, self.rows = False, [0, 0]
        self.handles = [model.h[0].register_forward_hook(self._count(0)),
                        model.h[self.E].register_forward_hook(self._count(1))]
        real_propose, real_execute = self.prop.propose, eng.model_runner.execute

        def propose(seqs, *a):
            real_propose(seqs, *a)
            self.fed = {s.seq_id: (s.num_computed_tokens, [s.token_ids[s.num_computed_tokens]] + s.spec_token_ids[:-1])
                        for s in seqs if s.spec_token_ids}

        def execute(out):
            want = len(out.padding)          # static batching's padding rows: plain decodes, every block
            self.padded += bool(out.padding) and any(s.spec_token_ids for s in out.scheduled)
            for s in out.scheduled:
                if not s.spec_token_ids:
                    want += s.num_new_tokens
                    continue
                m, fed = self.fed[s.seq.seq_id]
                ids, r = s.input_token_ids, 0
                if self.prop.kv_reuse and m == s.num_computed_before:
                    while r < min(len(ids), len(fed)) and ids[r] == fed[r]:
                        r += 1
                want += len(ids) - r
                self.verified += 1
                self.cut += len(s.spec_token_ids) < len(fed)
            self.counting, self.rows = True, [0, 0]
            try:
                result = real_execute(out)
            finally:
                self.counting = False
            self.steps.append((*self.rows, want, out.num_batched_tokens + len(out.padding)))
            return result

        self.prop.propose, eng.model_runner.execute = propose, execute
        eng.add_hook(lambda trace: eng.allocator.check_invariants(eng.scheduler.live_seq_ids()))

    def _count(self, i):
        def hook(module, args, output):
            if self.counting:
                self.rows[i] += args[0].shape[0]
        return hook

    def close(self):
        for h in self.handles:
            h.remove()

    def check(self):
        """Every forward sent what it should through blocks 0 .. E-1, and every row through blocks E .. L-1."""
        for at0, atE, want, T in self.steps:
            assert atE == T and at0 == want, f"blocks 0..E-1 ran {at0} rows (expected {want}), block E {atE} of {T}"


def run(target, k, params=GREEDY, prompts=PROMPTS, kv_reuse=True, **cfg):
    llm = LLM(target, speculative_config=spec(k, kv_reuse), **cfg)
    probe, rec = Probe(llm), TraceRecorder()
    llm.llm_engine.add_hook(rec)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        probe.close()
    probe.check()
    a, prop = llm.llm_engine.allocator, llm.llm_engine.proposer
    a.check_invariants([])
    assert a.num_free_blocks == a.num_blocks, "blocks leaked"
    assert not prop.state and not prop.generators, "per-sequence state leaked"
    return outs, probe, rec.traces


def test_start_layer_continues_where_the_exit_layer_stopped(target_model):
    ids = torch.tensor(list(b"def add(a, b):\n    return a + b\n"))
    T, pos, attn = len(ids), torch.arange(len(ids)), DenseAttention([len(ids)])
    full, hs = target_model(ids, pos, attn, hidden_states=(3, "final"))
    for E in (1, 2, 4):
        _, first = target_model(ids, pos, attn, hidden_states=(E,), exit_layer=E)
        rest, hs2 = target_model(ids, pos, attn, hidden_states=(3, "final") if E <= 3 else ("final",),
                                 start_layer=E, start_hidden=first[E])
        torch.testing.assert_close(rest, full, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hs2["final"], hs["final"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="start_layer"):
        target_model(ids, pos, attn, start_hidden=first[4])
    with pytest.raises(ValueError, match="start_hidden"):
        target_model(ids, pos, attn, start_layer=2, start_hidden=first[4][:-1])
    with pytest.raises(ValueError, match="start_layer"):
        target_model(ids, pos, attn, start_layer=3, exit_layer=2, start_hidden=first[4])
    with pytest.raises(ValueError, match="no hidden state before"):
        target_model(ids, pos, attn, start_layer=2, start_hidden=first[4], hidden_states=(1,))


CASES = {   # name: (k, engine config)
    "k1, block 16": (1, {}),
    "k2, block 4, prefix cache": (2, dict(block_size=4, max_num_seqs=3)),
    "k3, block 16, prefix cache": (3, dict(max_num_seqs=3)),
    "k3, block 8, preemption": (3, dict(block_size=8, num_gpu_blocks=26, max_num_seqs=8)),
    "k4, block 4, preemption": (4, dict(block_size=4, num_gpu_blocks=56, max_num_seqs=8)),
    "k4, block 8, chunked prefill": (4, dict(block_size=8, max_num_batched_tokens=8)),
    "k2, block 4, chunked prefill": (2, dict(block_size=4, max_num_batched_tokens=5)),
    "k3, block 8, static batching": (3, dict(block_size=8, scheduling="static", max_num_seqs=4)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_plain_with_reuse(target_model, refs, case):
    k, cfg = CASES[case]
    outs, probe, traces = run(target_model, k, **cfg)
    assert [o.outputs[0].token_ids for o in outs] == refs
    reused = sum(T - at0 for at0, _, _, T in probe.steps)
    assert probe.verified > 20 and reused >= probe.verified, "each verify reuses its first row at least"
    if "chunked" in case:
        assert probe.cut > 0, "meant to cut proposals with the token budget"
    if "static" in case:
        assert probe.padded > 0, "meant to verify beside padding rows"
    if "preemption" in case:
        assert sum(len(t.preempted) for t in traces) > 0, "meant to force preemption"
    if "prefix" in case:
        assert traces[-1].prefix_cache_hits > 0, "the shared preamble should hit the prefix cache"


def test_recompute_is_kept_as_the_reference(target_model, refs):
    outs, probe, _ = run(target_model, 3, kv_reuse=False, block_size=8)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert all(at0 == T for at0, _, _, T in probe.steps), "the recompute variant runs every row through every block"


def test_one_row_per_sequence_through_the_first_layers(target_model):
    """Batch 1, greedy, k = 4, no budget cut: each verify sends 1 row through blocks 0 .. E-1, not 5."""
    outs, probe, _ = run(target_model, 4, params=[SamplingParams(temperature=0, max_tokens=80)], prompts=PROMPTS[:1])
    verifies = [s for s in probe.steps if s[3] > 1]
    assert len(verifies) > 10 and probe.cut == 0
    assert all(at0 == 1 for at0, *_ in verifies[1:])   # the first forward with T > 1 is the prefill
    assert max(T for *_, T in verifies) == 5


def test_n2_stop_mid_draft_and_sampled_rows(target_model, refs):
    i_stop = 2
    ref_text = bytes(refs[i_stop]).decode("utf-8", "replace")
    stop = ref_text[10:13]
    params = [SamplingParams(temperature=0, max_tokens=m, n=2 if i == 0 else 1,
                             stop=[stop] if i == i_stop else []) for i, m in enumerate(MAX_TOKENS)]
    params[1] = SamplingParams(temperature=0, max_tokens=7)
    params[4] = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS[4], seed=4)      # sampled, drafted from q
    params[5] = SamplingParams(temperature=0.8, top_k=20, max_tokens=MAX_TOKENS[5], seed=5, n=2)
    outs, probe, _ = run(target_model, 3, params=params, max_num_seqs=8, block_size=8)
    assert [c.token_ids for c in outs[0].outputs] == [refs[0], refs[0]]
    assert outs[1].outputs[0].token_ids == refs[1][:7]
    cut = ref_text.index(stop)
    assert outs[i_stop].outputs[0].text == ref_text[:cut] and outs[i_stop].outputs[0].finish_reason == "stop"
    for i in (3, 6, 7, 8):
        assert outs[i].outputs[0].token_ids == refs[i]
    again, _, _ = run(target_model, 3, params=params, max_num_seqs=8, block_size=8, kv_reuse=False)
    assert [[c.token_ids for c in o.outputs] for o in again] == [[c.token_ids for c in o.outputs] for o in outs], \
        "seeded sampling: reuse and recompute give the same tokens"


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_cache_after_reuse_equals_a_plain_prefill(target_model, block_size):
    """After reusing verifies, each sequence's cached K/V, at every layer, is what a prefill of its tokens writes."""
    llm = LLM(target_model, speculative_config=spec(3), block_size=block_size)
    eng = llm.llm_engine
    probe = Probe(llm)
    try:
        for i, p in enumerate(PROMPTS[:3]):
            eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=100))
        for _ in range(25):
            eng.step()
    finally:
        probe.close()
    probe.check()
    assert probe.verified > 30 and len(eng.scheduler.running) == 3
    plain = LLM(target_model, block_size=block_size)
    for seq in eng.scheduler.running:
        n = seq.num_computed_tokens
        plain.llm_engine.add_request(seq.seq_id + "p", seq.token_ids[:n] + [0], SamplingParams(temperature=0, max_tokens=2))
        plain.llm_engine.step()                     # one prefill of the same n tokens (+ one not compared)
        torch.testing.assert_close(cached_kv(llm, seq.seq_id, n), cached_kv(plain, seq.seq_id + "p", n),
                                   rtol=1e-4, atol=1e-4)


def test_shared_blocks_are_never_written(target_model, refs):
    """Prefix caching and n > 1 forks share blocks; with reuse copying K/V in, every block that is shared (ref
    count > 1), free, or in the prefix cache when a forward starts is unchanged by it, in every layer."""
    params = [SamplingParams(temperature=0, max_tokens=m, n=2 if i % 3 == 0 else 1) for i, m in enumerate(MAX_TOKENS)]
    llm = LLM(target_model, speculative_config=spec(3), block_size=4, max_num_seqs=6)
    eng = llm.llm_engine
    a, real = eng.allocator, eng.model_runner.execute
    checked = []

    def execute(out):
        ref = a.ref_counts()          # the blocks this forward may write are its sequences' own (ref count 1)
        guard = sorted({b for b in range(a.num_blocks) if ref[b] != 1} | set(a.cached_block_ids()))
        before = eng.kv_cache.kv[:, :, guard].clone()
        result = real(out)
        assert torch.equal(eng.kv_cache.kv[:, :, guard], before), "a shared or cached block was written"
        checked.append((sum(r > 1 for r in ref), any(s.spec_token_ids for s in out.scheduled) and out.cow_copies))
        return result

    eng.model_runner.execute = execute
    probe = Probe(llm)
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        probe.close()
    probe.check()
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert sum(1 for n, _ in checked if n) > 10, "no shared block to guard: the test proves nothing"
    assert any(cow for _, cow in checked), "no copy-on-write before a reusing verify: the test proves less"


def test_drafts_changed_after_proposing_reuse_only_the_common_prefix(target_model, refs):
    """Change every second draft after the drafter fed it: the verify reuses the rows before it only (the
    last sampled token and the first draft) and runs the rest through every block; the output stays plain."""
    llm = LLM(target_model, speculative_config=spec(4), block_size=8)
    probe = Probe(llm)
    inner, changed = llm.llm_engine.proposer.propose, [0]

    def propose(seqs, *a):
        inner(seqs, *a)
        for s in seqs:
            if len(s.spec_token_ids) >= 2:
                s.spec_token_ids[1] = (s.spec_token_ids[1] + 1) % 256
                changed[0] += 1
    llm.llm_engine.proposer.propose = propose
    try:
        outs = llm.generate(PROMPTS[:4], GREEDY[:4], use_tqdm=False)
    finally:
        probe.close()
    probe.check()
    assert [o.outputs[0].token_ids for o in outs] == refs[:4]
    assert changed[0] > 20


@pytest.mark.parametrize("value,method", [("yes", "early_exit"), (1, "early_exit"), (True, "eagle"),
                                          (False, "medusa")])
def test_bad_kv_reuse_is_rejected(target_model, value, method):
    with pytest.raises(ValueError, match="kv_reuse"):
        LLM(target_model, speculative_config={"method": method, "num_speculative_tokens": 2, "kv_reuse": value})


@pytest.mark.parametrize("backend", ["loop", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_greedy_equals_plain_on_other_backends(target_model, refs, backend):
    n = 3 if backend == "loop" else 1                  # Triton runs through its interpreter on a CPU: slow
    outs, probe, _ = run(target_model, 3, prompts=PROMPTS[:n], params=GREEDY[:n], attention_backend=backend,
                         block_size=8)
    assert [o.outputs[0].token_ids for o in outs] == refs[:n] and probe.verified > 3
