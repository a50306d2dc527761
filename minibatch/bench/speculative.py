"""Speculative decoding, every method side by side:  python -m minibatch.bench speculative

One row per (sampling, batch size, method, k), each timed against plain decoding of the same prompts
in this process, alternately (base, method, base, method, ...), so a slow spell of a shared machine
hits both sides. Each row reports:

* ``+params``: what the method adds to the served model (0 for prompt lookup; the whole draft model;
  the heads or the adapter);
* ``passes``: sequential draft passes per step (k for a draft model, EAGLE or early exit, which draft
  one token per pass; 0 for prompt lookup and Medusa, whose heads read the verify pass's hidden state);
* ``speedup``: output tokens/s over plain decoding, best round of each side, and the spread (lowest and
  highest of the per-round ratios);
* ``alpha`` (accepted / proposed) and ``alpha by position`` (position i judged only when 1 .. i-1 were
  accepted; ``SpecStats.acceptance_by_position``), ``tau`` (tokens per verify step: the accepted drafts
  + the target's own token) beside the i.i.d. ``formula`` (1 - a^(k+1)) / (1 - a) (Leviathan et al.
  2023, Eq. 1), and ``out/fwd``: output tokens per target forward over every decode step of the run;
* ``cost``: the proposer's time per step over a plain decode step's (measured from the step traces'
  ``propose_duration``), and ``predicted`` = formula / (1 + cost), Leviathan et al.'s Theorem 3.8 with
  k c measured as one number (a draft pass costs c, Medusa's heads cost a fraction of one).

``--kv-reuse off`` times early exit's recompute variant (row ``ee-recomp``: the verify runs every row through
every block) instead of its default KV reuse, ``both`` times both (``spec_decode/early_exit.py``).

``--typical`` adds, at temperature 1, rows ``medusa-typ``: Medusa with typical acceptance (§2.3.1), which
is LOSSY (its output is not distributed as the target's; ``spec_decode/typical.py``).

All figures come from the step traces (``minibatch.stats.run_stats``), one definition each.
"""
from __future__ import annotations

import time

from minibatch.llm import LLM
from minibatch.stats import run_stats
from minibatch.trace import TraceRecorder

ALL_METHODS = ("draft", "ngram", "medusa", "eagle", "early_exit", "eagle3")


def added_params(llm) -> tuple[int, str]:
    """(parameters the method adds, sequential draft passes per step: "k" or a number)."""
    prop = llm.llm_engine.proposer
    for attr in ("model", "heads", "head", "adapter"):
        mod = getattr(prop, attr, None)
        if mod is not None and hasattr(mod, "parameters"):
            n = sum(p.numel() for p in mod.parameters())
            break
    else:
        n = 0
    return n, getattr(prop, "sequential_passes", "k")


def timed_pair(a, b, prompts, params, repeats=3):
    """Output tokens/s of two engines on the same prompts, runs alternating (a, b, a, b, ...); each side keeps
    its best run (as timeit does: noise only slows). Returns per side (tok/s, outputs, traces of the best
    run, wall times of every run). Engines made with ``simulate=...`` are timed on the simulated clock (the sum
    of the run's ``simulated_duration``), which does not vary: give them repeats=1."""
    recs = [TraceRecorder(), TraceRecorder()]
    for llm, rec in zip((a, b), recs):
        llm.generate(prompts[:1], params, use_tqdm=False)                  # warm-up
        llm.llm_engine.add_hook(rec)
    best, outs, traces, walls = [float("inf")] * 2, [None, None], [None, None], [[], []]
    for _ in range(repeats):
        for i, llm in enumerate((a, b)):
            recs[i].traces.clear()
            t = time.perf_counter()
            outs[i] = llm.generate(prompts, params, use_tqdm=False)        # greedy / seeded: same every run
            walls[i].append(time.perf_counter() - t)
            if llm.llm_engine.cost_model is not None:                       # the simulated clock
                walls[i][-1] = sum(tr.simulated_duration for tr in recs[i].traces)
            if walls[i][-1] < best[i]:
                best[i], traces[i] = walls[i][-1], list(recs[i].traces)
    for llm, rec in zip((a, b), recs):
        llm.llm_engine.hooks.remove(rec)
    n = [sum(len(o.outputs[0].token_ids) for o in out) for out in outs]
    return [(n[i] / best[i], outs[i], traces[i], walls[i]) for i in range(2)]


def _decode_step_time(traces, cm=None) -> float:
    """Mean duration of the steps that only decoded (no prefill in them): a plain decode step's cost.
    cm: the simulated clock's CostModel (then the simulated durations, less the proposer's share)."""
    ds = [t.simulated_duration - cm.propose_time(t) if cm else t.duration - t.propose_duration for t in traces
          if t.scheduled and all(s.phase == "decode" for s in t.scheduled)]
    return sum(ds) / len(ds) if ds else float("nan")


def _propose_time(traces, cm=None) -> float:
    ps = [cm.propose_time(t) if cm else t.propose_duration for t in traces
          if t.scheduled and all(s.phase == "decode" for s in t.scheduled)]
    return sum(ps) / len(ps) if ps else 0.0


HEADER = (f"{'entropy':<8}{'batch':>6}{'method':>11}{'k':>3}{'+params':>10}{'passes':>7}{'tok/s':>8}{'base':>7}"
          f"{'speedup':>8}{'spread':>11}{'alpha':>6}{'tau':>6}{'formula':>8}{'out/fwd':>8}{'cost':>6}{'predicted':>10}"
          f"  alpha by position")


def bench_row(model, draft, method, k, prompts, params, bs, repeats, label, plain, extra=None, name=None):
    llm = LLM(model, draft_model=draft, max_num_seqs=max(bs, 1), simulate=plain.llm_engine.config.simulate,
              speculative_config={"method": method, "num_speculative_tokens": k, **(extra or {})})
    if name:
        method = name
    elif extra:
        method = f"{method}-typ"                                             # typical acceptance: LOSSY
    (base, _, base_tr, base_walls), (tps, outs, tr, walls) = timed_pair(plain, llm, prompts, params, repeats)
    st = run_stats(tr)
    ratios = [b / s for b, s in zip(base_walls, walls)]                     # same tokens: time ratio = speed ratio
    alpha = st.get("acceptance_rate", 0.0)
    by_pos = "/".join(f"{a:.2f}" for a in st.get("acceptance_by_position", [])) or "-"
    tau = st.get("tokens_per_verify_step", 1.0)
    formula = st.get("expected_tokens_per_verify_step") or 1.0            # None for a tree (no chain formula)
    cm = llm.llm_engine.cost_model
    cost = _propose_time(tr, cm) / _decode_step_time(base_tr, plain.llm_engine.cost_model)
    predicted = formula / (1 + cost)
    n_params, passes = added_params(llm)
    passes = k if passes == "k" else int(passes)
    row = dict(entropy=label, batch=bs, method=method, k=k, params=n_params, passes=passes, tps=tps, base=base,
               speedup=tps / base, spread=(min(ratios), max(ratios)), alpha=alpha,
               alpha_by_position=st.get("acceptance_by_position", []), tau=tau, formula=formula,
               out_per_fwd=st.get("tokens_per_decode_forward") or 1.0, cost=cost, predicted=predicted)
    print(f"{label:<8}{bs:>6}{method:>11}{k:>3}{n_params:>10,}{passes:>7}{tps:>8.1f}{base:>7.1f}{tps / base:>8.2f}"
          f" {f'{min(ratios):.2f}-{max(ratios):.2f}':>10}{alpha:>6.2f}{tau:>6.2f}{formula:>8.2f}"
          f"{row['out_per_fwd']:>8.2f}{cost:>6.2f}{predicted:>10.2f}  {by_pos}", flush=True)
    return row


def bench_speculative(args) -> list:
    """Every method's rows for ``--model`` (target, llama, or both: target,llama); a model other than the GPT
    target gets the GPT's rows after its own, on the same prompts, so the two read side by side."""
    names = getattr(args, "model", "target").split(",")
    if "target" not in names:
        names.append("target")
    rows = []
    for name in names:
        rows += bench_model(args, name)
    return rows


def bench_model(args, name: str) -> list:
    from minibatch.sampling.sampler import SamplingParams
    from minibatch.model.data import val_documents
    from minibatch.model.weights import load_model
    model = load_model(name, device=args.device)
    draft = load_model("draft", device=model.device)
    methods = args.methods or [m for m in ALL_METHODS if _available(m, name)]
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {list(ALL_METHODS)}")
    methods = [m for m in methods if _available(m, name)]             # --methods eagle3 on the GPT: no head
    print(f"model: {name}; device: {model.device}; target {model.num_params():,} parameters; methods "
          f"{', '.join(methods)}")
    if getattr(args, "simulate", None):
        args.repeats = 1
        print(f"clock: simulated, {args.simulate} (minibatch.perf's roofline; the draft costed as "
              f"{draft_name(args.simulate)}): tok/s, speedup and cost are simulated, alpha and tau are real")
    docs = val_documents(32, min_len=600, seed=11)
    prompts = [d[:160].decode("utf-8", "ignore") for d in docs]
    print(f"each row: best of {args.repeats} runs, alternating with plain decoding (base) on the same code prompts; "
          f"spread = lowest-highest per-round ratio;\nformula = (1 - a^(k+1)) / (1 - a); cost = proposer time per "
          f"step / plain decode step; predicted = formula / (1 + cost) (Leviathan et al. 2023)")
    print(HEADER)
    rows = []
    for temp, label in ((0.0, "low"), (1.0, "high")):
        for bs in args.batch_sizes:
            ps = prompts[:bs]
            sp = SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=0 if temp else None)
            plain = LLM(model, max_num_seqs=max(bs, 1), simulate=getattr(args, "simulate", None))
            for method in methods:
                for k in args.ks:
                    if k > _max_k(method, name):
                        continue
                    if method != "early_exit" or getattr(args, "kv_reuse", "on") != "off":
                        rows.append(bench_row(model, draft, method, k, ps, sp, bs, args.repeats, label, plain))
                    if method == "early_exit" and getattr(args, "kv_reuse", "on") != "on":
                        rows.append(bench_row(model, draft, method, k, ps, sp, bs, args.repeats, label, plain,
                                              extra={"kv_reuse": False}, name="ee-recomp"))
                    if getattr(args, "typical", False) and method == "medusa" and temp > 0:
                        rows.append(bench_row(model, draft, method, k, ps, sp, bs, args.repeats, label, plain,
                                              extra={"acceptance": "typical"}))
    for r in rows:
        r["model"] = name
    return rows


def draft_name(simulate: str) -> str:
    """Which model a simulated draft pass is costed as (perf/cost.py: the spec's third part or the default)."""
    from minibatch.perf.cost import CostModel
    return CostModel.from_spec(simulate).draft.name


def _available(method: str, model: str = "target") -> bool:
    """Whether ``model`` can speculate with ``method``: no head needed, or its own head ships."""
    from minibatch.model.weights import HEADS_OF, WEIGHTS_DIR, head_preset
    return method in ("draft", "ngram") or (method in HEADS_OF.get(model, ()) and
                                            (WEIGHTS_DIR / f"{head_preset(method, model)}.safetensors").exists())


def _max_k(method: str, model: str = "target") -> int:
    if method == "medusa":
        from minibatch.model.weights import head_preset, read_manifest
        return read_manifest(head_preset("medusa", model))["config"]["num_heads"]
    return 16
