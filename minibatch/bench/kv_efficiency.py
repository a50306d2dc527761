"""KV memory efficiency, measured: contiguous max-length reservation vs the paged allocator.

    python -m minibatch.bench kv [--num-requests 256 --block-size 16 --max-len 512 --seed 0 --kv-budget-gib 1]

Before vLLM, a serving system reserved one contiguous KV region per request,
as long as the longest sequence it might reach (``max_len`` slots), because it
could not know the output length in advance. Everything past the request's
real length is wasted (*internal fragmentation*, plus the reserved-but-not-yet
used slots; Kwon et al., SOSP'23, §3 and Fig. 2: only 20.4-38.2 % of the KV
memory held token states). With blocks taken on demand (§4.2-4.3) the only
waste is the unfilled tail of each sequence's last block: under 4 % in vLLM.

The workload (stated in the output): prompt lengths uniform in
[max_len/16, max_len/2] (32..256 for 512), output lengths log-normal with
median max_len/8 and sigma 1 (a long tail), at least 1, capped so that
prompt + output <= max_len. Shares are measured when every request has reached
its final length -- the moment most favourable to contiguous reservation.

Then the bytes of one token under each cache dtype (``kv/quant.py``), and the tokens a pool of ``--kv-budget-gib``
holds (``KVCache.bytes_per_block`` counts the blocks, as ``from_memory_budget`` does): fp8 and int8 store 1 byte a
value against fp32's 4, so 4x the tokens, less the share the per-(token, head) scales take (4 bytes per head_dim
values: 1/(D + 1) of the bytes at D = 64, 1/129 at D = 128).
"""
from __future__ import annotations

import argparse
import math
import random

import torch

from minibatch.kv import quant
from minibatch.kv.block_allocator import BlockAllocator, NoFreeBlocksError
from minibatch.kv.kv_cache import KVCache
from minibatch.perf.models import get_model

PAPER = ("vLLM paper (Kwon et al., SOSP'23, Fig. 2): existing systems used only 20.4-38.2 % of their "
         "KV cache memory for token states; vLLM wastes under 4 %.")
BLOCK_SIZES = (8, 16, 32, 64)
BUDGET_CONTEXTS = 64          # the memory budget: room for 64 contiguous max-length reservations


def sample_request(rng: random.Random, max_len: int) -> tuple[int, int]:
    """(prompt length, output length) from the stated distribution."""
    prompt = rng.randint(max(1, max_len // 16), max(1, max_len // 2))
    output = int(round(rng.lognormvariate(math.log(max_len / 8), 1.0)))
    return prompt, max(1, min(output, max_len - prompt))


def paged_share(requests, block_size: int, grow_by_decode: bool = False) -> float:
    """Share of the allocated block slots that hold real tokens, through the real BlockAllocator."""
    total = sum(p + o for p, o in requests)
    a = BlockAllocator(sum(-(-(p + o) // block_size) for p, o in requests), block_size,
                       enable_prefix_caching=False)   # distinct prompts: measure paging alone
    for i, (p, o) in enumerate(requests):
        if grow_by_decode:                            # as the engine does: prompt, then one block at a time
            a.allocate(i, [0] * p)
            for _ in range(o):
                a.append_slots(i, 1)                  # one decode slot at a time
        else:
            a.allocate(i, [0] * (p + o))
    a.check_invariants(range(len(requests)))
    used_blocks = a.num_blocks - a.num_free_blocks
    return total / (used_blocks * block_size)


def paged_fit(rng: random.Random, max_len: int, block_size: int) -> int:
    """How many requests (fresh draws, at final length) a budget of 64 x max_len slots holds at once."""
    a = BlockAllocator(BUDGET_CONTEXTS * max_len // block_size, block_size, enable_prefix_caching=False)
    n = 0
    while True:
        p, o = sample_request(rng, max_len)
        try:
            a.allocate(n, [0] * (p + o))
        except NoFreeBlocksError:
            return n
        n += 1


# Grouped-query attention is the other saving: H query heads share Hkv K/V heads, so a token's K/V is Hkv / H of
# multi-head attention's at the same width (Ainslie et al. 2023), and a block holds H / Hkv times the tokens.
KV_MODELS = ("target", "llama", "llama-2-13b", "llama-3-8b", "llama-3-70b")


def kv_per_token() -> list:
    """[(name, query heads, K/V heads, KV bytes per token, what multi-head attention would need)], from the
    shipped checkpoints' configs and the published ones (minibatch.perf.models)."""
    rows = []
    for name in KV_MODELS:
        m = get_model(name)
        rows.append((name, m.n_heads, m.n_kv_heads, m.kv_bytes_per_token,
                     m.kv_bytes_per_token * m.n_heads // m.n_kv_heads))
    return rows


# The capacity table: (label, kv_cache_dtype, the model's dtype for "auto", scale granularity)
CAPACITY_MODELS = ("target", "llama", "llama-3-8b")
CAPACITY_MODES = ([("fp32", "auto", torch.float32, "per_tensor"), ("bf16", "auto", torch.bfloat16, "per_tensor")]
                  + [(f"{d} {g}", d, torch.float32, g) for d in ("fp8_e4m3", "fp8_e5m2", "int8")
                     for g in quant.SCALE_GRANULARITIES])


def capacity(name: str, budget_bytes: int, block_size: int) -> list:
    """[(mode, KV bytes per token, the scales' share of them, tokens the budget holds, ratio to fp32's)] for
    model ``name``'s shapes (minibatch.perf.models); tokens are whole blocks, as the pool is."""
    m, rows = get_model(name), []
    for label, dtype, model_dtype, granularity in CAPACITY_MODES:
        per_token = quant.bytes_per_token(m.n_layer, m.n_kv_heads, m.head_dim, dtype, model_dtype, granularity)
        unscaled = quant.bytes_per_token(m.n_layer, m.n_kv_heads, m.head_dim, dtype, model_dtype, "per_tensor")
        per_block = KVCache.bytes_per_block(m.n_layer, block_size, m.n_kv_heads, m.head_dim, model_dtype, dtype,
                                            granularity)
        rows.append([label, per_token, 1 - unscaled / per_token, budget_bytes // per_block * block_size])
    for r in rows:
        r.append(r[3] / rows[0][3])
    return [tuple(r) for r in rows]


def print_capacity(budget_bytes: int, block_size: int) -> dict:
    print(f"\nKV capacity per cache dtype in a pool of {budget_bytes / 2**30:g} GiB (block size {block_size}; "
          f"per_tensor's 2 x layers scales are not per token; per_token_head stores a float32 per token, head, K/V):")
    out = {}
    for name in CAPACITY_MODELS:
        m = get_model(name)
        print(f"  {name} ({m.n_layer} layers x {m.n_kv_heads} K/V heads x head dim {m.head_dim})")
        print(f"    {'mode':24s} {'B/token':>9s} {'scales':>7s} {'tokens':>12s} {'x fp32':>7s}")
        rows = out[name] = capacity(name, budget_bytes, block_size)
        for label, b, share, tokens, ratio in rows:
            print(f"    {label:24s} {b:>9,d} {100 * share:6.2f}% {tokens:>12,d} {ratio:6.2f}x")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m minibatch.bench kv", description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-budget-gib", type=float, default=1.0, help="the pool's bytes in the capacity table")
    args = ap.parse_args(argv)
    if args.num_requests < 1 or args.max_len < 2 or args.block_size < 1 or not args.kv_budget_gib > 0:
        ap.error("need --num-requests >= 1, --max-len >= 2, --block-size >= 1, --kv-budget-gib > 0")
    rng = random.Random(args.seed)
    reqs = [sample_request(rng, args.max_len) for _ in range(args.num_requests)]
    lens = sorted(p + o for p, o in reqs)
    tokens = sum(lens)

    contiguous = tokens / (len(reqs) * args.max_len)            # each request reserved max_len slots
    paged = paged_share(reqs, args.block_size, grow_by_decode=True)
    fit_contig = BUDGET_CONTEXTS                                 # budget // max_len, whatever the lengths
    fit_paged = paged_fit(random.Random(args.seed + 1), args.max_len, args.block_size)
    by_bs = {bs: paged_share(reqs, bs) for bs in BLOCK_SIZES}
    fit_by_bs = {bs: paged_fit(random.Random(args.seed + 1), args.max_len, bs) for bs in BLOCK_SIZES}

    m = args.max_len
    print(f"workload: {len(reqs)} requests, seed {args.seed}; prompt ~ uniform[{max(1, m // 16)}, "
          f"{max(1, m // 2)}], output ~ lognormal(median {m / 8:g}, sigma 1) >= 1, prompt + output <= {m}")
    print(f"  total length: mean {tokens / len(reqs):.1f}, median {lens[len(lens) // 2]}, max {lens[-1]}")
    print("\nshare of reserved KV memory holding real tokens (every request at its final length):")
    print(f"  (a) contiguous, {m} slots reserved per request : {100 * contiguous:5.1f} %")
    print(f"  (b) paged, block size {args.block_size:<3d} (BlockAllocator)  : {100 * paged:5.1f} %"
          f"   (waste {100 * (1 - paged):.1f} %: the unfilled tails of last blocks)")
    print(f"\nsequences that fit at once in {BUDGET_CONTEXTS} x {m} = {BUDGET_CONTEXTS * m} slots:")
    print(f"  (a) contiguous: {fit_contig}    (b) paged: {fit_paged}  ({fit_paged / fit_contig:.1f}x)")
    print("\nblock size   token share   waste   sequences that fit")
    for bs in BLOCK_SIZES:
        print(f"  {bs:>8d}   {100 * by_bs[bs]:9.1f} %   {100 * (1 - by_bs[bs]):4.1f} %   {fit_by_bs[bs]:>8d}")
    print(f"\n{PAPER}")
    rows = kv_per_token()
    print("\nKV bytes per token (2 x layers x K/V heads x head dim x bytes; grouped-query attention shares K/V heads):")
    for name, h, hkv, b, mha in rows:
        print(f"  {name:12s} {h:>3d} query / {hkv:>2d} K/V heads: {b:>9,d} B  ({b / mha:.2f} of multi-head's {mha:,d} B)")
    cap = print_capacity(int(args.kv_budget_gib * 2**30), args.block_size)
    return {"kv_bytes_per_token": {r[0]: r[3] for r in rows}, "capacity": cap, "contiguous_share": contiguous, "paged_share": paged, "contiguous_fit": fit_contig,
            "paged_fit": fit_paged, "by_block_size": by_bs, "fit_by_block_size": fit_by_bs}


if __name__ == "__main__":
    main()
