"""Speculation without a second model (Medusa, EAGLE, early exit): lossless, greedy and sampled, in every mode.

Greedy: the output equals plain greedy decoding token for token, for every method at several k, under
cache pressure with preemption, with prefix caching, with chunked prefill, with n > 1, and when requests
stop in the middle of an accepted run of drafts (max_tokens and stop strings). Sampled: the first three
output tokens of many seeded requests (tokens 2 and 3 come from the first verify step: an accepted
draft, a correction or a bonus token) follow the target's exact joint distribution, by a chi-square
test at the 0.001 level; a sampler that takes its correction or bonus token from the draft fails it.
"""
import numpy as np
import pytest
import torch

import minibatch.engine.engine as engine
from minibatch import LLM, SamplingParams
from minibatch.model.model import forward_sequences
from minibatch.sampling.reference import generate
from minibatch.model.weights import WEIGHTS_DIR
from minibatch.spec_decode import rejection_sampler
from minibatch.trace import TraceRecorder
from test_engine import MAX_TOKENS, PROMPTS

METHODS = [m for m in ("medusa", "early_exit", "eagle") if (WEIGHTS_DIR / f"{m}.safetensors").exists()]
GREEDY = [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
CASES = {   # name: (k, engine config)
    "k1": (1, {}),
    "k3, prefix cache": (3, dict(max_num_seqs=3)),    # later requests find the preamble cached
    "k4, preemption": (4, dict(block_size=8, num_gpu_blocks=26, max_num_seqs=8)),
    "k2, chunked prefill": (2, dict(max_num_batched_tokens=16, block_size=8)),
}


@pytest.fixture(scope="module")
def refs(target_model):
    return [generate(target_model, p, SamplingParams(temperature=0, max_tokens=m))[0]
            for p, m in zip(PROMPTS, MAX_TOKENS)]


def run(target, method, k, params=GREEDY, prompts=PROMPTS, **cfg):
    llm = LLM(target, speculative_config={"method": method, "num_speculative_tokens": k}, **cfg)
    rec = TraceRecorder()
    llm.llm_engine.add_hook(rec)
    outs = llm.generate(prompts, params, use_tqdm=False)
    a = llm.llm_engine.allocator
    a.check_invariants()
    assert a.num_free_blocks == a.num_blocks, "blocks leaked"
    prop = llm.llm_engine.proposer
    if hasattr(prop, "allocator"):                       # a proposer with a paged cache of its own
        prop.allocator.check_invariants()
        assert prop.allocator.num_free_blocks == prop.allocator.num_blocks, "the proposer's cache leaked"
    assert not getattr(prop, "state", None) and not getattr(prop, "generators", None), "per-sequence state leaked"
    return outs, rec.traces


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_plain(target_model, refs, method, case):
    k, cfg = CASES[case]
    outs, traces = run(target_model, method, k, **cfg)
    for o, ref in zip(outs, refs):
        assert o.outputs[0].token_ids == ref
    steps = [s for t in traces for s in t.scheduled]
    assert sum(s.proposed for s in steps) > 0 and sum(s.accepted for s in steps) > 0
    assert all(s.proposed <= k for s in steps)
    assert all(t.speculative_method == method for t in traces), "the trace records the method"
    if "preemption" in case:
        assert sum(len(t.preempted) for t in traces) > 0, "meant to force preemption"
    if "prefix" in case:
        assert traces[-1].prefix_cache_hits > 0, "the shared preamble should hit the prefix cache"


@pytest.mark.parametrize("method", METHODS)
def test_greedy_n2_and_requests_stopping_mid_draft(target_model, refs, method):
    # n = 2 (forked children propose from their parent's row); stop strings and max_tokens that cut an
    # accepted run of drafts short, next to requests that keep going
    i_stop = 2
    ref_text = bytes(refs[i_stop]).decode("utf-8", "replace")
    stop = ref_text[10:13]
    params = [SamplingParams(temperature=0, max_tokens=m, n=2 if i == 0 else 1,
                             stop=[stop] if i == i_stop else []) for i, m in enumerate(MAX_TOKENS)]
    params[1] = SamplingParams(temperature=0, max_tokens=7)
    outs, traces = run(target_model, method, 3, params=params, max_num_seqs=6)
    assert [c.token_ids for c in outs[0].outputs] == [refs[0], refs[0]]
    assert outs[1].outputs[0].token_ids == refs[1][:7]
    cut = ref_text.index(stop)
    assert outs[i_stop].outputs[0].text == ref_text[:cut] and outs[i_stop].outputs[0].finish_reason == "stop"
    for o, ref in list(zip(outs, refs))[3:]:
        assert o.outputs[0].token_ids == ref


@pytest.mark.parametrize("method", METHODS)
def test_greedy_and_sampled_requests_in_one_batch(target_model, refs, method):
    # greedy rows draft one-hot (no q), sampled rows with q: one verify batch holds both
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, max_tokens=m, seed=i) for i, m in enumerate(MAX_TOKENS)]
    outs, traces = run(target_model, method, 3, params=params)
    assert all(o.outputs[0].token_ids == refs[i] for i, o in enumerate(outs) if i % 2)
    assert any(len({s.seq_id for s in t.scheduled if s.proposed}) > 1 for t in traces)
    again, _ = run(target_model, method, 3, params=params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs], "seeded: reproducible"


@pytest.mark.parametrize("method", METHODS)
def test_bad_k_is_rejected_at_construction(target_model, method):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(target_model, speculative_config={"method": method, "num_speculative_tokens": 17})
    if method == "medusa":                              # one head per draft position
        with pytest.raises(ValueError, match="heads"):
            LLM(target_model, speculative_config={"method": method, "num_speculative_tokens": 5})


# -- sampled: distributed as the target ------------------------------------------------------------------------------

PROMPT = list(b"    def __init__(self, ")
N_SAMPLES = 1200


def exact_joint(target, pairs: int = 64) -> dict:
    """P(t1, t2, t3) after PROMPT, exactly, for the ``pairs`` likeliest (t1, t2): {(t1, t2, t3): probability}."""
    p1 = forward_sequences(target, [PROMPT])[0][-1].softmax(-1)                       # [V]
    p2 = torch.stack([lg[-1] for lg in forward_sequences(target, [PROMPT + [t] for t in range(256)])]).softmax(-1)
    joint = (p1[:, None] * p2).double()                                               # [V, V]: P(t1, t2)
    top = [divmod(int(i), 256) for i in joint.flatten().topk(pairs).indices]
    p3 = torch.stack([lg[-1] for lg in forward_sequences(target, [PROMPT + list(t) for t in top])]).softmax(-1)
    return {(t1, t2, t3): float(joint[t1, t2] * p3[j, t3]) for j, (t1, t2) in enumerate(top) for t3 in range(256)}


def chi_square(toks, exact):
    """Pearson's chi-square of the observed (t1, t2, t3) against the exact joint: one cell per triple expected
    at least 5 times, everything else lumped into one cell; and its 0.001 critical value (Wilson-Hilferty)."""
    n = len(toks)
    seen = {}
    for t in map(tuple, toks.tolist()):
        seen[t] = seen.get(t, 0) + 1
    cells = [c for c, p in exact.items() if n * p >= 5]
    obs = [seen.get(c, 0) for c in cells]
    exp = [n * exact[c] for c in cells]
    obs.append(n - sum(obs))                                                         # the lumped rest
    exp.append(n - sum(exp))
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(cells)
    crit = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3
    return chi2, crit


def sample_tokens(target, method, k):
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=1000 + i) for i in range(N_SAMPLES)]
    outs, traces = run(target, method, k, params=params, prompts=[PROMPT] * N_SAMPLES, max_num_seqs=64)
    steps = [s for t in traces for s in t.scheduled]
    assert sum(s.proposed for s in steps) > N_SAMPLES // 2 and sum(s.bonus for s in steps) > N_SAMPLES // 20
    return np.array([o.outputs[0].token_ids for o in outs])                          # [N, 3]


@pytest.fixture(scope="module")
def exact(target_model):
    return exact_joint(target_model)


@pytest.mark.parametrize("method", METHODS)
def test_sampled_tokens_are_distributed_as_the_target(target_model, exact, method):
    chi2, crit = chi_square(sample_tokens(target_model, method, 1), exact)
    assert chi2 < crit, f"{method}: chi-square {chi2:.1f} of the first three tokens rejects the target's " \
                        f"distribution at the 0.001 level ({crit:.1f})"


def _from_the_draft(bonus_only):
    """A broken sampler: the correction token (rejections) and/or the bonus token is the draft's own token."""
    real = rejection_sampler.rejection_sample

    def mutant(drafts, q, p, generators=None, num_draft_tokens=None, greedy=None):
        toks, n_acc = real(drafts, q, p, generators, num_draft_tokens, greedy)
        for b, (n, k_b) in enumerate(zip(n_acc.tolist(), num_draft_tokens or [drafts.shape[1]] * len(drafts))):
            if k_b and (n == k_b) == bonus_only:
                toks[b, n] = drafts[b, k_b - 1] if bonus_only else drafts[b, n]   # bonus: repeat the last draft
        return toks, n_acc
    return mutant


@pytest.mark.parametrize("bonus_only", [False, True])
def test_a_sampler_that_takes_the_draft_fails_the_check(target_model, exact, monkeypatch, bonus_only):
    monkeypatch.setattr(engine, "REJECTION_SAMPLE", _from_the_draft(bonus_only))     # the part engines are built with
    chi2, crit = chi_square(sample_tokens(target_model, METHODS[0], 1), exact)
    assert chi2 > 2 * crit, f"the check missed a sampler that takes the {'bonus' if bonus_only else 'correction'} " \
                            f"token from the draft: chi-square {chi2:.1f}, critical value {crit:.1f}"


# -- the drafts are what the method's module computes on the whole sequence --------------------------------------------

def dense_drafts(target, proposer, token_ids, k):
    """The greedy drafts recomputed from scratch, with no cache: dense attention over the whole sequence."""
    from minibatch.model.model import DenseAttention

    def run_target(ids, **kw):
        x = torch.tensor(ids)
        return target(x, torch.arange(len(ids)), DenseAttention([len(ids)]), **kw)[1]

    if proposer.method == "medusa":              # h_t produced the newest token t + 1; head i guesses t + 2 + i
        h = run_target(token_ids[:-1], hidden_states=("final",))["final"][-1:]
        return proposer.heads(h)[0, :k].argmax(-1).tolist()
    if proposer.method == "eagle":                # entry p = (token p, f_{p-1}), f_{-1} = 0; then its own f^
        m = len(token_ids) - 1
        f = run_target(token_ids[:m], hidden_states=("final",))["final"]
        feats, ids, out = torch.cat([torch.zeros(1, f.shape[1]), f]), list(token_ids), []
        for _ in range(k):
            n = len(ids)
            f_hat = proposer.head(target, torch.tensor(ids), feats, torch.arange(n), DenseAttention([n]), 0)
            out.append(int((f_hat[-1] @ target.wte.weight.t()).argmax()))
            ids, feats = ids + [out[-1]], torch.cat([feats, f_hat[-1:]])
        return out
    ids, E = list(token_ids), proposer.E                        # early exit: k passes of E blocks + adapter
    for _ in range(k):
        x = run_target(ids, hidden_states=(E,), exit_layer=E)[E][-1:]
        ids.append(int(proposer.adapter.logits(target, x)[0].argmax()))
    return ids[len(token_ids):]


@pytest.mark.parametrize("method", METHODS)
def test_drafts_equal_the_dense_computation(target_model, method):
    llm = LLM(target_model, speculative_config={"method": method, "num_speculative_tokens": 3},
              block_size=8, max_num_batched_tokens=24)           # chunked prefill, drafts across block edges
    prop, seen = llm.llm_engine.proposer, []
    real = prop.propose

    def spy(seqs, *a):
        real(seqs, *a)
        seen.extend((list(s.token_ids), list(s.spec_token_ids)) for s in seqs if s.spec_token_ids)
    prop.propose = spy
    llm.generate(PROMPTS[:4], GREEDY[:4], use_tqdm=False)
    assert len(seen) > 20
    for ids, drafts in seen[::3]:
        assert drafts == dense_drafts(target_model, prop, ids, len(drafts)), f"after {len(ids)} tokens"


# -- typical acceptance: opt-in, and lossy ---------------------------------------------------------------------------

def tv_joint(toks, exact):
    """Total variation between the observed (t1, t2, t3) and the exact joint (pairs outside it: one cell)."""
    n, seen = len(toks), {}
    for t in map(tuple, toks.tolist()):
        seen[t] = seen.get(t, 0) + 1
    inside = sum(abs(seen.get(c, 0) / n - p) for c, p in exact.items())
    rest_obs = sum(v for c, v in seen.items() if c not in exact) / n
    return 0.5 * (inside + abs(rest_obs - (1 - sum(exact.values()))))


@pytest.mark.skipif("medusa" not in METHODS, reason="no shipped medusa heads")
def test_typical_acceptance_is_opt_in_labelled_and_measurably_lossy(target_model, refs, exact):
    typical = {"method": "medusa", "num_speculative_tokens": 1, "acceptance": "typical"}
    llm = LLM(target_model, speculative_config=typical)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)            # greedy rows accept the argmax either way
    assert [o.outputs[0].token_ids for o in outs] == refs and outs[0].outputs[0].spec["lossless"] is False
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=1000 + i) for i in range(N_SAMPLES)]
    toks = {}
    for acc in ("rejection", "typical"):
        llm = LLM(target_model, max_num_seqs=64, speculative_config={**typical, "acceptance": acc})
        outs = llm.generate([PROMPT] * N_SAMPLES, params, use_tqdm=False)
        assert outs[0].outputs[0].spec["lossless"] is (acc == "rejection")
        toks[acc] = np.array([o.outputs[0].token_ids for o in outs])
    chi2, crit = chi_square(toks["typical"], exact)
    tv_typ, tv_rej = tv_joint(toks["typical"], exact), tv_joint(toks["rejection"], exact)
    p1 = forward_sequences(target_model, [PROMPT])[0][-1].softmax(-1)
    p2 = (p1[:, None] * torch.stack([lg[-1] for lg in forward_sequences(
        target_model, [PROMPT + [t] for t in range(256)])]).softmax(-1)).sum(0).double().numpy()   # P(t2)
    tv2 = {a: 0.5 * np.abs(np.bincount(t[:, 1], minlength=256) / len(t) - p2).sum() for a, t in toks.items()}
    print(f"TV from the target's exact distribution, {N_SAMPLES} samples: first three tokens jointly: typical "
          f"{tv_typ:.3f}, rejection {tv_rej:.3f} (its noise floor); second token: typical {tv2['typical']:.3f}, "
          f"rejection {tv2['rejection']:.3f}")
    assert chi2 > crit and tv_typ > tv_rej + 0.03 and tv2["typical"] > tv2["rejection"], (chi2, crit, tv_typ, tv2)


@pytest.mark.parametrize("cfg,match", [({"acceptance": "greedy"}, "unknown acceptance"),
                                       ({"posterior_alpha": 0.3}, "only with acceptance='typical'"),
                                       ({"acceptance": "typical", "posterior_threshold": 0}, "posterior_threshold")])
def test_bad_typical_config(target_model, cfg, match):
    with pytest.raises(ValueError, match=match):
        LLM(target_model, speculative_config={"method": "ngram", "num_speculative_tokens": 2, **cfg})
