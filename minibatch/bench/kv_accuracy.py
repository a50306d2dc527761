"""What quantized KV blocks cost in accuracy, measured:  python -m minibatch.bench kv-accuracy [--small]

For the GPT ("target") and the Llama ("llama"), and each cache mode (``MODES``: the model's fp32, bf16, fp8 e4m3
with a per-tensor scale of 1.0 or calibrated on the first batch (vLLM's ``calculate_kv_scales``), fp8 e4m3 / e5m2
and int8 with a scale per (token, KV head), int8 per tensor calibrated), on held-out code (``model/data.py``'s
validation split, the windows ``train.evaluate`` draws):

* bits per byte: the windows are prefilled in chunks of ``--chunk`` tokens through ``KVCache`` + ``PagedAttention``
  (backend "batched"), as the engine's model runner does, so every chunk after the first attends to the
  quantized blocks the earlier ones stored (``kv/quant.py``); the byte tokenizer makes nats / ln 2 per token bpb;
* next-token KL(fp32 cache || this cache) at the same positions, in nats;
* greedy agreement: held-out prompts (``held_out_prompts``: 160 bytes each) decoded greedily
  through the same cache, prefill then one token a step; how many are identical to the fp32 cache's, and the
  median first divergence (the index of the first differing new token) of the rest, and how near a tie the fp32
  run was there (its top logit's margin over the runner-up: a flip at a near tie is rounding, not garbage);
* K's outlier channels, per layer: each channel's (KV head, dim) amax of K over the held-out windows, as stored
  (after RoPE, for the Llama), and the top channels' ratio to the median channel: a per-tensor or per-(token,
  head) scale is set by the few large channels, so the many small ones get few steps; KIVI (Liu et al. 2024,
  §3) quantizes keys per channel for this reason, values per token.

The fp32 row is the reference: it runs the same code, so its KL is 0 and its greedy runs are identical by
construction, and the test (tests/test_bench_kv.py) holds that, with KL > 0 for every quantized row.
"""
from __future__ import annotations

import argparse
import math
import statistics

import numpy as np
import torch
import torch.nn.functional as F

from minibatch.kv.attention import PagedAttention
from minibatch.kv.kv_cache import KVCache
from minibatch.kv.metadata import AttentionMetadata
from minibatch.model.data import load_corpus, val_documents
from minibatch.model.tokenizer import encode
from minibatch.model.training import sample_windows
from minibatch.model.weights import load_model

BLOCK_SIZE = 16
BACKEND = "batched"          # reads every quantized mode (kv/backends/QUANTIZED_BACKENDS)
# (label, kv_cache_dtype, scale_granularity, calculate_kv_scales, the blocks' dtype for "auto")
MODES = [("fp32 (model)", "auto", "per_tensor", False, torch.float32),
         ("bf16", "auto", "per_tensor", False, torch.bfloat16),
         ("fp8_e4m3 tensor 1.0", "fp8_e4m3", "per_tensor", False, None),
         ("fp8_e4m3 tensor calib", "fp8_e4m3", "per_tensor", True, None),
         ("fp8_e4m3 token-head", "fp8_e4m3", "per_token_head", False, None),
         ("fp8_e5m2 token-head", "fp8_e5m2", "per_token_head", False, None),
         ("int8 tensor calib", "int8", "per_tensor", True, None),
         ("int8 token-head", "int8", "per_token_head", False, None)]
MODELS = ("target", "llama")
SIZES = {"full": dict(windows=16, seq=512, chunk=64, prompts=64, max_tokens=64),
         "small": dict(windows=2, seq=96, chunk=32, prompts=4, max_tokens=8)}


class _Attention:
    """PagedAttention, with what the model hands it cast to a bf16 cache's dtype (the model computes in fp32),
    and each layer's K recorded when asked (the outlier channels)."""

    def __init__(self, cache: KVCache, md: AttentionMetadata, record=None):
        self.inner, self.dtype, self.record = PagedAttention(cache, md, BACKEND), cache.kv.dtype, record

    def __call__(self, layer, q, k, v):
        if self.record is not None:
            self.record.setdefault(layer, []).append(k.detach().abs().amax(0))   # [Hkv, D]
        if self.dtype == torch.bfloat16:
            k, v = k.to(self.dtype), v.to(self.dtype)
        return self.inner(layer, q, k, v)


def make_cache(model, mode, num_seqs: int, max_len: int):
    """A pool with room for num_seqs sequences of max_len tokens, and each sequence's block table."""
    _, dtype, granularity, calibrate, auto_dtype = mode
    cfg, per = model.config, -(-max_len // BLOCK_SIZE)
    cache = KVCache(cfg.n_layer, num_seqs * per, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype=auto_dtype or torch.float32, kv_cache_dtype=dtype,
                    scale_granularity=granularity, calculate_kv_scales=calibrate)
    return cache, [list(range(b * per, (b + 1) * per)) for b in range(num_seqs)]


@torch.no_grad()
def chunked_logits(model, mode, x: torch.Tensor, chunk: int, record=None) -> torch.Tensor:
    """x [B, S] token ids -> logits [B, S, V], prefilled ``chunk`` tokens a step through the paged cache."""
    B, S = x.shape
    cache, tables = make_cache(model, mode, B, S)
    out = []
    for s in range(0, S, chunk):
        n = min(chunk, S - s)
        md = AttentionMetadata.build(tables, [s] * B, [n] * B, BLOCK_SIZE)
        out.append(model(x[:, s:s + n].reshape(-1), md.positions, _Attention(cache, md, record)).view(B, n, -1))
    return torch.cat(out, 1)


@torch.no_grad()
def greedy(model, mode, ps: list, max_tokens: int) -> tuple:
    """Each prompt's max_tokens greedy tokens, the prompts prefilled together, then one decode step a token;
    and at each token the margin of the top logit over the runner-up (nats: how near a tie the choice was)."""
    ids = [encode(p) for p in ps]
    cache, tables = make_cache(model, mode, len(ids), max(map(len, ids)) + max_tokens)
    md = AttentionMetadata.build(tables, [0] * len(ids), [len(t) for t in ids], BLOCK_SIZE)
    last = torch.tensor([len(t) for t in ids]).cumsum(0) - 1
    logits = model(torch.tensor([t for s in ids for t in s]), md.positions, _Attention(cache, md), last)
    toks, margins, ctx = [], [], [len(t) for t in ids]
    for step in range(max_tokens):
        if step:
            md = AttentionMetadata.build(tables, ctx, [1] * len(ids), BLOCK_SIZE)
            logits = model(toks[-1], md.positions, _Attention(cache, md))
            ctx = [c + 1 for c in ctx]
        top2 = logits.float().topk(2, -1).values                       # [B, 2]
        toks.append(logits.argmax(-1))
        margins.append(top2[:, 0] - top2[:, 1])
    return torch.stack(toks, 1).tolist(), torch.stack(margins, 1)      # [B][max_tokens], [B, max_tokens]


def held_out_prompts(n: int, length: int = 160) -> list:
    """n prompts of ``length`` bytes from the held-out files (``head_acceptance``'s: min_len 600, seed 11); the
    split has fewer such files than 64, so prompt i starts at byte length * (i // files) of file i % files."""
    docs = val_documents(n, min_len=600, seed=11)
    return [docs[i % len(docs)][length * (i // len(docs)):][:length] for i in range(n)]


def first_divergence(a: list, b: list):
    """The index of the first differing token, None where the runs are identical."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def k_outliers(record: dict, top: int = 3) -> list:
    """[(layer, [top channels' amax / median channel's], (head, dim) of the largest)], from each layer's
    per-channel amax of |K| (record: {layer: [[Hkv, D] per call]})."""
    rows = []
    for layer in sorted(record):
        amax = torch.stack(record[layer]).amax(0)                      # [Hkv, D]
        D, flat = amax.shape[1], amax.flatten()
        rows.append((layer, (flat.topk(top).values / flat.median()).tolist(), divmod(int(flat.argmax()), D)))
    return rows


def measure(name: str, size: dict, seed: int = 1234) -> dict:
    model = load_model(name, device="cpu")
    x, y = sample_windows(load_corpus("val"), size["windows"], size["seq"], np.random.default_rng(seed))
    ps = held_out_prompts(size["prompts"])
    record, rows = {}, {}
    for mode in MODES:
        logits = chunked_logits(model, mode, x, size["chunk"], record if mode[1] == "auto" and not rows else None)
        logp = F.log_softmax(logits.float(), -1).flatten(0, 1)                     # [B * S, V]
        nll = F.nll_loss(logp, y.reshape(-1), reduction="sum").item()
        if not rows:
            ref_logp, (ref_runs, ref_margins) = logp, greedy(model, mode, ps, size["max_tokens"])
            runs = ref_runs
        else:
            runs, _ = greedy(model, mode, ps, size["max_tokens"])
        kl = F.kl_div(logp, ref_logp, log_target=True, reduction="batchmean").item()   # KL(ref || this)
        div = [first_divergence(a, b) for a, b in zip(ref_runs, runs)]
        rest = [d for d in div if d is not None]
        tie = [float(ref_margins[b, d]) for b, d in enumerate(div) if d is not None]   # the fp32 run's margin there
        rows[mode[0]] = {"bpb": nll / y.numel() / math.log(2), "kl": kl, "identical": div.count(None),
                         "prompts": len(div), "median_divergence": statistics.median(rest) if rest else None,
                         "median_margin_there": statistics.median(tie) if tie else None}
    rows["fp32 (model)"]["median_margin"] = float(ref_margins.median())
    return {"modes": rows, "k_outliers": k_outliers(record)}


def print_table(name: str, res: dict, size: dict) -> None:
    ref = res["modes"]["fp32 (model)"]["bpb"]
    print(f"\n{name}: {size['windows']} held-out windows x {size['seq']} bytes, prefilled {size['chunk']} a chunk "
          f"through the paged cache ({BACKEND}); greedy: {size['prompts']} prompts x {size['max_tokens']} tokens")
    print(f"  (median div: the first differing new token of the runs that differ; margin: the fp32 run's top logit over "
          f"its runner-up there, against {res['modes']['fp32 (model)']['median_margin']:.2f} at the median token)")
    print(f"  {'mode':22s} {'bpb':>7s} {'vs fp32':>8s} {'KL (nats)':>10s} {'identical':>10s} {'median div':>10s} "
          f"{'margin':>7s}")
    for label, r in res["modes"].items():
        md, mg = ("-" if r[k] is None else f"{r[k]:{f}}" for k, f in (("median_divergence", "g"),
                                                                         ("median_margin_there", ".3f")))
        print(f"  {label:22s} {r['bpb']:7.4f} {100 * (r['bpb'] / ref - 1):+7.2f}% {r['kl']:10.2e} "
              f"{r['identical']:>4d} / {r['prompts']:<3d} {md:>10s} {mg:>7s}")
    print("  K's outlier channels (amax of |K| per (KV head, dim) channel over the windows; top 3 / median):")
    for layer, ratios, ch in res["k_outliers"]:
        print(f"    layer {layer}: {' '.join(f'{r:5.1f}x' for r in ratios)}   (largest: head {ch[0]}, dim {ch[1]})")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m minibatch.bench kv-accuracy", description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a CI-sized run (seconds)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    args = ap.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    bad = [n for n in names if n not in MODELS]
    if bad or not names:
        ap.error(f"--models: unknown {bad}; choose from {list(MODELS)}")
    size = SIZES["small" if args.small else "full"]
    out = {}
    for name in names:
        out[name] = measure(name, size)
        print_table(name, out[name], size)
    return out


if __name__ == "__main__":
    main()
