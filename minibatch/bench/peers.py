"""Peers: minibatch against Hugging Face transformers on the same weights, timed in one process.

    pip install transformers==5.25.0     (optional: a benchmark and test dependency, not in requirements.txt)
    python -m minibatch.bench peers [--num-requests 32 --max-num-seqs 16 --max-tokens 128 --ks 4,8 --repeats 3]

Why: a teaching engine's tokens/s mean little alone. A widely used implementation running the *same*
weights on the *same* prompts, on the same CPU thread, says whether the engine is slow (issue 10, item 5).

The conversion (``to_hf``) is ``minibatch/export.py``'s, its one owner.

Rows, each timed alternately (minibatch, HF, minibatch, HF, ...) so a slow spell of the shared machine
hits both sides, best of ``--repeats`` (noise only slows; timeit's rule), printed with the min-max spread:
  continuous  minibatch continuous batching vs ``ContinuousBatchingManager`` (``init_continuous_batching``,
              ``add_request(..., max_new_tokens=)`` per request), a long-tail workload at max_num_seqs slots;
  static      ``scheduling="static"`` vs ``generate`` on left-padded batches of max_num_seqs, each running to
              its longest member: what static batching is (HF generate, FasterTransformer);
  plain       batch 1 greedy decoding vs ``generate``, one prompt at a time;
  draft k     the draft proposer vs assisted generation (Leviathan et al. 2023; ``assistant_model=`` the
              converted draft) with exactly k drafts a step on both sides: ``num_assistant_tokens=k``,
              schedule "constant", the confidence early stop off (``assistant_confidence_threshold=0``);
  ngram k     the n-gram proposer vs prompt lookup (Saxena 2023; ``prompt_lookup_num_tokens=k``,
              ``max_matching_ngram_size=3`` as minibatch's prompt_lookup_max = 3).
Tokens/s counts the tokens each request asked for (max_tokens; a byte model has no EOS), on both sides.

The slot-model bound (issue 10): a static batch holds all its slots for as many steps as its longest
member runs; continuous batching at best keeps every slot busy. If a step costs the same however many
slots are busy, continuous/static <= sum over static batches of (longest x slots) / sum of output tokens.
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
import time

import torch
import torch.nn.functional as F

from minibatch import LLM, SamplingParams
from minibatch.bench.metrics import critical_path_bound, slot_bound
from minibatch.bench.workload import describe, make_workload
from minibatch.export import PAD, to_hf
from minibatch.model.model import GPT
from minibatch.model.tokenizer import encode
from minibatch.model.weights import load_model

HF_REQUIREMENT = "transformers==5.25.0"        # tested with torch 2.13.0 (CPU); it does not pull another torch
LOGITS_TOL = 1e-4


@torch.no_grad()
def minibatch_logits(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    """tokens[B, T] -> logits[B, T, V] through GPT.forward's default call (complete sequences, no cache)."""
    B, T = tokens.shape

    def attn(layer_idx, q, k, v):                      # q, k, v: [B*T, H, D]
        q, k, v = (x.view(B, T, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))   # [B, H, T, D]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(B * T, y.shape[1], y.shape[3])          # [B*T, H, D]

    pos = torch.arange(T, device=model.device).repeat(B)
    return model(tokens.reshape(-1).to(model.device), pos, attn).view(B, T, -1)


@torch.no_grad()
def logits_max_diff(model: GPT, hf, num_seqs: int = 4, seq_len: int = 64, seed: int = 0) -> float:
    """max |minibatch - HF| over the logits of num_seqs random token sequences of seq_len."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (num_seqs, seq_len), generator=g)
    return (minibatch_logits(model, tokens).cpu() - hf(tokens).logits).abs().max().item()


# -- the two sides of a row: each run() builds its engine untimed, then returns (token lists, seconds) --

MB_ENGINE = {}     # engine options every minibatch side of a run shares (--threads, --attention-backend, ...)


def mb_side(model, prompts, params, **engine_kwargs):
    def run():
        llm = LLM(model, **{**MB_ENGINE, **engine_kwargs})
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t
    return run


def hf_each(hf, prompts, max_tokens: int, before=None, **generate_kwargs):
    """HF generate at batch 1, one prompt after another (before(): settings to apply, untimed)."""
    ids = [torch.tensor([encode(p)]) for p in prompts]

    def run():
        if before is not None:
            before()
        t, outs = time.perf_counter(), []
        for x in ids:
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                            pad_token_id=PAD, **generate_kwargs)
            outs.append(y[0, x.shape[1]:].tolist())
        return outs, time.perf_counter() - t
    return run


def hf_padded(model: GPT, prompts, max_tokens: list, slots: int):
    """HF generate on left-padded batches of `slots` in order, each to its longest member; outputs trimmed."""
    ids = [encode(p) for p in prompts]
    reach = max(len(x) + max(max_tokens[s - s % slots:s - s % slots + slots]) for s, x in enumerate(ids))
    hf = to_hf(model, n_positions=max(reach, model.config.n_ctx))     # see to_hf: padding's own positions

    def run():
        t, outs = time.perf_counter(), []
        for s in range(0, len(ids), slots):
            batch, ns = ids[s:s + slots], max_tokens[s:s + slots]
            L = max(map(len, batch))
            x = torch.tensor([[PAD] * (L - len(b)) + b for b in batch])                   # [b, L]
            mask = torch.tensor([[0] * (L - len(b)) + [1] * len(b) for b in batch])
            y = hf.generate(x, attention_mask=mask, max_new_tokens=max(ns), do_sample=False, pad_token_id=PAD)
            outs += [y[j, L:L + n].tolist() for j, n in enumerate(ns)]
        return outs, time.perf_counter() - t
    return run


def hf_continuous(hf, prompts, max_tokens: list, slots: int, block_size: int, token_budget: int):
    """transformers' ContinuousBatchingManager: `slots` requests per step, per-request max_new_tokens."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    ids = [encode(p) for p in prompts]
    n_ctx = hf.config.n_positions

    def run():
        gen = GenerationConfig(do_sample=False, max_new_tokens=max(max_tokens), eos_token_id=-1, pad_token_id=PAD)
        cb = ContinuousBatchingConfig(max_requests_per_batch=slots, page_size=block_size,
                                      num_blocks=slots * math.ceil(n_ctx / block_size), max_batch_tokens=token_budget)
        mgr = hf.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        mgr.warmup()                                   # builds the paged cache now, outside the timing
        mgr.start()
        try:
            t, done = time.perf_counter(), {}
            for i, (x, n) in enumerate(zip(ids, max_tokens)):
                mgr.add_request(x, request_id=f"r{i}", max_new_tokens=n)
            while len(done) < len(ids):
                out = mgr.get_result(timeout=120)
                if out is None or out.error:
                    raise RuntimeError(f"HF continuous batching failed: {out.error if out else 'no result in 120 s'}")
                if out.is_finished():
                    done[out.request_id] = list(out.generated_tokens)
            dt = time.perf_counter() - t
        finally:
            mgr.stop(block=True)
        return [done[f"r{i}"] for i in range(len(ids))], dt
    return run


def race(a, b, repeats: int) -> dict:
    """Run a, b, a, b, ... `repeats` times; tokens/s of each run, both sides' outputs, tokens equal."""
    tps, outs = ([], []), [None, None]
    for _ in range(repeats):
        for i, run in enumerate((a, b)):
            outs[i], dt = run()
            tps[i].append(sum(map(len, outs[i])) / dt)
    same = sum(x == y for x, y in zip(*outs))
    return {"mb": tps[0], "hf": tps[1], "same": same, "n": len(outs[0])}


def _spread(xs, fmt="{:.0f}") -> str:
    return f"{fmt.format(max(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def format_rows(rows: dict, base: str = "plain", peer: str = "HF") -> str:
    """One line per row: both sides' best tokens/s (min-max), the ratio of bests (per-round range), equality."""
    table = [("row", f"{peer} peer", "minibatch tok/s", f"{peer} tok/s", f"mb/{peer}", "same",
              f"own speed-up mb / {peer}")]
    for name, (peer, r) in rows.items():
        own = ""
        if name.startswith(("draft", "ngram")) and base in rows:
            b = rows[base][1]
            own = f"{max(r['mb']) / max(b['mb']):.2f}x / {max(r['hf']) / max(b['hf']):.2f}x"
        rounds = [m / h for m, h in zip(r["mb"], r["hf"])]
        table.append((name, peer, _spread(r["mb"]), _spread(r["hf"]),
                      f"{max(r['mb']) / max(r['hf']):.2f} ({min(rounds):.2f}-{max(rounds):.2f})",
                      f"{r['same']}/{r['n']}", own))
    widths = [max(len(row[j]) for row in table) for j in range(len(table[0]))]
    lines = ["  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))).rstrip()
             for row in table]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def check_parity(models: dict, prompts: list, max_tokens: int) -> bool:
    """Print logits parity and greedy equality (minibatch LLM vs HF generate) per model; True if both hold."""
    diffs = {n: logits_max_diff(m, h) for n, (m, h) in models.items()}
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    equal = {n: race(mb_side(m, prompts, params, max_num_seqs=1), hf_each(h, prompts, max_tokens), 1)["same"]
             for n, (m, h) in models.items()}
    ok = all(d <= LOGITS_TOL for d in diffs.values()) and all(e == len(prompts) for e in equal.values())
    print("logits parity, max |minibatch - HF| over 4 random sequences x 64 tokens: " +
          ", ".join(f"{n} {d:.1e}" for n, d in diffs.items()) + f" (limit {LOGITS_TOL:.0e})")
    print(f"greedy tokens equal, {len(prompts)} code prompts x {max_tokens} tokens: " +
          ", ".join(f"{n} {e}/{len(prompts)}" for n, e in equal.items()) + (": ok" if ok else ": FAILED"))
    return ok


def time_rows(args, target, hf_target, hf_draft, wl, short) -> dict:
    """Every row of the table: name -> (HF peer, race result)."""
    slots, r = args.max_num_seqs, args.repeats
    prompts, lens, per_req = [w.prompt for w in wl], [w.max_tokens for w in wl], [w.sampling_params() for w in wl]
    kv = dict(max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size)
    one = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows = {"continuous": ("ContinuousBatchingManager", race(
                mb_side(target, prompts, per_req, max_num_seqs=slots, **kv),
                hf_continuous(hf_target, prompts, lens, slots, args.block_size, args.max_num_batched_tokens), r)),
            "static": (f"generate, left-padded x{slots}", race(
                mb_side(target, prompts, per_req, max_num_seqs=slots, scheduling="static", **kv),
                hf_padded(target, prompts, lens, slots), r)),
            "plain": ("generate, batch 1", race(
                mb_side(target, short, one, max_num_seqs=1), hf_each(hf_target, short, args.max_tokens), r))}

    def spec(method, k):
        return mb_side(target, short, one, max_num_seqs=1,
                       speculative_config={"method": method, "num_speculative_tokens": k})

    for k in args.ks:
        def exactly_k(k=k):                            # HF reads these from the assistant's generation config
            hf_draft.generation_config.update(num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                                              assistant_confidence_threshold=0.0)
        rows[f"draft k={k}"] = ("assisted generation", race(spec("draft", k), hf_each(
            hf_target, short, args.max_tokens, before=exactly_k, assistant_model=hf_draft), r))
    for k in args.ks:
        rows[f"ngram k={k}"] = ("prompt lookup", race(spec("ngram", k), hf_each(
            hf_target, short, args.max_tokens, prompt_lookup_num_tokens=k, max_matching_ngram_size=3), r))
    return rows


def parse_args(prog: str, description: str, argv, ks=(4, 8)) -> argparse.Namespace:
    """The options of a peers bench (HF here, vLLM in vllm_peer.py), checked once."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--num-requests", type=int, default=32, help="continuous/static: long-tail requests")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="slots, both sides")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of a step, both sides")
    ap.add_argument("--block-size", type=int, default=16, help="tokens a KV block (HF: page_size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-prompts", type=int, default=4, help="batch-1 rows: prompts, one after another")
    ap.add_argument("--max-tokens", type=int, default=128, help="batch-1 rows: tokens per prompt")
    ap.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=list(ks),
                    help="proposal lengths for the draft and n-gram rows")
    ap.add_argument("--repeats", type=int, default=3, help="alternating timed runs per row, best kept")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads a side (minibatch's engines, the peer's)")
    ap.add_argument("--attention-backend", default=None,
                    help="minibatch's attention backend (default: the engine's choice, cpu on a CPU)")
    ap.add_argument("--cuda-graph-mode", default="auto",
                    help="minibatch's decode step: auto (plain on a CPU), compile (torch.compiled per batch size at "
                         "each engine's start, untimed, as vLLM's CPU runner does)")
    ap.add_argument("--prefix-cache", default="hash", choices=["hash", "radix"],
                    help="minibatch's prefix cache (vLLM's hash chain, or SGLang's radix tree)")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    for name in ("num_requests", "max_num_seqs", "num_prompts", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(k < 1 for k in args.ks):
        ap.error(f"--ks must be integers >= 1, got {args.ks}")
    return args


def main(argv=None) -> int:
    args = parse_args("python -m minibatch.bench peers", __doc__.splitlines()[0], argv)
    try:
        import transformers
    except ImportError:
        print(f"peers needs Hugging Face transformers, an optional dependency: pip install {HF_REQUIREMENT}",
              file=sys.stderr)
        return 2
    transformers.logging.set_verbosity_error()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)   # e.g. "no psutil" on CPU
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)                 # as many threads each side: both run in this process
    MB_ENGINE.update(num_threads=args.threads, attention_backend=args.attention_backend,
                     cuda_graph_mode=args.cuda_graph_mode, prefix_cache=args.prefix_cache)
    try:
        with torch.no_grad():
            return _run(args, transformers.__version__)
    finally:
        torch.set_num_threads(threads)


def _run(args, hf_version: str) -> int:
    target, draft = load_model("target", device="cpu"), load_model("draft", device="cpu")
    hf_target, hf_draft = to_hf(target), to_hf(draft)
    print(f"transformers {hf_version}, torch {torch.__version__}, CPU, {torch.get_num_threads()} thread(s) a side; "
          f"target {target.num_params():,} parameters, draft {draft.num_params():,}")
    wl = make_workload("longtail", num_requests=args.num_requests, seed=args.seed)
    short = [w.prompt for w in make_workload("longtail", num_requests=args.num_prompts, seed=args.seed)]
    if not check_parity({"target": (target, hf_target), "draft": (draft, hf_draft)}, short,
                        min(32, args.max_tokens)):
        print("the converted model does not match minibatch's: timings would compare different models")
        return 1
    print(f"\ncontinuous/static rows: {describe(wl)}\nbatch-1 rows: {len(short)} prompts x {args.max_tokens} "
          f"tokens, greedy. Each row: best of {args.repeats} alternating runs (min-max); mb/HF = ratio of bests "
          f"(range over rounds); same = requests with equal tokens; own speed-up = over its own plain row.\n"
          f"static, HF side: finished members compute thrown-away tokens until their batch's longest is done, "
          f"past position {target.config.n_ctx} if need be (zero position embeddings there).")
    rows = time_rows(args, target, hf_target, hf_draft, wl, short)
    print(format_rows(rows))
    slots, lens = args.max_num_seqs, [w.max_tokens for w in wl]
    bound, cp = slot_bound(lens, slots), critical_path_bound(lens, slots)
    mb = max(rows["continuous"][1]["mb"]) / max(rows["static"][1]["mb"])
    hf = max(rows["continuous"][1]["hf"]) / max(rows["static"][1]["hf"])
    print(f"\nslot-model bound, continuous/static at {slots} slots: {bound:.2f}x (sum over static batches of "
          f"longest x slots / sum of output tokens); with the longest request's critical path: {cp:.2f}x.\n"
          f"measured continuous/static: minibatch {mb:.2f}x = {mb / bound:.2f} of the bound, HF {hf:.2f}x = "
          f"{hf / bound:.2f} of the bound (a CPU step's cost grows with its rows, so a measured ratio can pass "
          f"the critical-path bound, which counts steps)")
    return 0
