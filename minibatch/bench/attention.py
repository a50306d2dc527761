"""Benchmark: Triton paged attention vs PyTorch paged attention, at decode; on the CPU, "cpu" vs "batched".

    python -m minibatch.bench attention            # on a CUDA machine: the table
    python -m minibatch.bench attention --quick    # fewer, smaller configurations
    python -m minibatch.bench attention --cpu      # the CPU backends: attention alone, then a whole engine step
    python -m minibatch.bench attention --kv-dtypes  # the CPU operator's decode on fp32, bf16, fp8 and int8 blocks

Decode is the memory-bound case: each new token reads its sequence's whole
K/V context once and does ~2 FLOPs per byte, so the figure of merit is the
memory bandwidth reached, ``bytes of K/V read / time``, against the GPU's peak
(H100 ~3.35 TB/s, H200 ~4.8 TB/s HBM3). The PyTorch side is
``minibatch.attention.paged_attention_torch`` (one sequence at a time, gather
through the block table, dense softmax) and, if present, the vectorised
``paged_attention_dense``; without that module, a local per-sequence gather.

Timings: CUDA events around ``iters`` back-to-back calls after a warm-up, the
median of a few such repeats. "triton" times the kernel launch on inputs
checked once beforehand; "checked" is the public ``kernels.paged_attention``,
whose input checks take one host sync per call.

Without CUDA there is nothing to time: the script says so and runs a tiny
correctness check through the Triton interpreter instead.

``--cpu`` times the CPU backends instead (``bench_cpu``): "batched" (gathers each row's context into
[G, L, Hkv, D], then SDPA) against "cpu" (``minibatch/kv/backends/cpu.py``, the blocks read in place), each
through the engine's own path (``backends.get``, the step's metadata built once), with ``perf_counter``
around ``iters`` calls, several rounds alternating the backends: best round, median and worst. Then a whole
engine decode step of the shipped target at batch 16 (``LLM``, the step's own ``duration``, the decode steps
only), rounds alternating the backends the same way. Threads: the engine's choice (1 for the target), or
``--threads N``.

``--kv-dtypes`` (``bench_kv_dtypes``, the quantized-KV issue): decode on the CPU operator at batch 16, contexts
512, 1024 and 2048, with the blocks in fp32, bf16, fp8 e4m3 and int8 (scales per tensor, and per (token, head)),
through the engine's path; the modes alternate within each round, and each prints its best ms per call and its
ratio to fp32: of the best rounds, and the min-max of the per-round ratios (the spread). fp8 and int8 read a
quarter of fp32's bytes (plus 4 bytes per head_dim values per (token, head)), but decode each element first.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

# decode configurations: (batch, context, num_heads, num_kv_heads, head_dim, dtype)
CONFIGS = [
    (32, 1024, 32, 8, 128, torch.float16),
    (32, 4096, 32, 8, 128, torch.float16),
    (64, 2048, 32, 8, 128, torch.bfloat16),
    (64, 4096, 32, 8, 128, torch.bfloat16),
    (64, 1024, 16, 16, 64, torch.float16),
    (32, 2048, 8, 1, 64, torch.float16),     # MQA
    (1, 512, 4, 4, 64, torch.float16),       # the shipped target, batch 1 and 16, at its full context
    (16, 512, 4, 4, 64, torch.float16),
    (1, 16384, 32, 8, 128, torch.float16),   # one long context: the split over programs (flash_decode)
]
QUICK = [CONFIGS[0], CONFIGS[4]]
BLOCK_SIZE = 16
# --cpu: (batch, context, num_heads, num_kv_heads, head_dim, dtype)
CPU_CONFIGS = [
    (16, 128, 4, 4, 64, torch.float32),      # the shipped target at batch 16 ...
    (16, 512, 4, 4, 64, torch.float32),      # ... at its full context
    (16, 512, 4, 4, 64, torch.bfloat16),
    (1, 512, 4, 4, 64, torch.float32),
    (16, 1024, 8, 2, 64, torch.float32),     # GQA
]
CPU_QUICK = CPU_CONFIGS[:2]


def local_paged_reference(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
    """Per sequence: gather K/V through the block table, causal softmax with offset, in float32."""
    T, H, D = query.shape
    bs, Hkv = key_cache.shape[1], key_cache.shape[2]
    out = torch.empty_like(query)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, L in enumerate(lens):
        s, e = qsl[b], qsl[b + 1]
        if e == s:
            continue
        pos = torch.arange(L, device=query.device)
        phys = block_tables[b].long()[pos // bs]
        k = key_cache[phys, pos % bs].float().repeat_interleave(H // Hkv, 1)   # [L, H, D]
        v = value_cache[phys, pos % bs].float().repeat_interleave(H // Hkv, 1)
        scores = torch.einsum("qhd,khd->hqk", query[s:e].float(), k) * scale
        q_pos = L - (e - s) + torch.arange(e - s, device=query.device)
        scores = scores.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out


def torch_references():
    """[(name, fn)]: the project's PyTorch backends if importable, else the local one."""
    try:
        from minibatch.kv import backends
    except Exception as e:   # noqa: BLE001 - any failure means "use the local reference"
        print(f"(minibatch.kv.backends not importable: {e!r}; using the local reference)")
        return [("torch-local", local_paged_reference)]
    refs = [(n, getattr(backends, f)) for n, f in (("loop", "paged_attention_loop"),
                                                   ("batched", "paged_attention_batched"))
            if hasattr(backends, f)]
    return refs or [("torch-local", local_paged_reference)]


def make_decode_batch(B, ctx, H, Hkv, D, dtype, device, seed=0):
    """One decode token per sequence; contexts near ctx, not multiples of the block size;
    blocks shuffled over a pool with 25% to spare."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    seq_lens = ctx - torch.randint(0, BLOCK_SIZE, (B,), generator=g)
    n_blocks = (seq_lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    max_blocks = int(n_blocks.max())
    num_blocks = int(n_blocks.sum() * 5 // 4) + 1
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(B, max_blocks, dtype=torch.int32)
    start = 0
    for b in range(B):
        n = int(n_blocks[b])
        block_tables[b, :n] = perm[start:start + n].to(torch.int32)
        start += n
    kv = torch.randn(2, num_blocks, BLOCK_SIZE, Hkv, D, device=device, dtype=dtype)
    query = torch.randn(B, H, D, device=device, dtype=dtype)
    return dict(query=query, key_cache=kv[0], value_cache=kv[1],
                block_tables=block_tables.to(device), seq_lens=seq_lens.to(torch.int32).to(device),
                query_start_loc=torch.arange(B + 1, dtype=torch.int32, device=device))


def cuda_time_ms(fn, iters, repeats=5):
    """Median over `repeats` of (time of `iters` back-to-back calls) / iters, in ms."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def bench_cuda(configs, iters):
    import kernels
    from kernels.flash_decode import _launch_decode
    from kernels.paged_attention import _launch, check_paged_inputs

    refs = torch_references()
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
          f"triton {__import__('triton').__version__}; block_size {BLOCK_SIZE}; decode (1 token/seq)")
    print(f"device copy bandwidth (read + write of 1 GiB, torch copy_): {copy_gbps():.0f} GB/s")
    head = (f"{'B':>3} {'ctx':>5} {'H':>3} {'Hkv':>3} {'D':>4} {'dtype':>8} | {'triton':>8} "
            f"{'checked':>8} | " + " ".join(f"{n:>11}" for n, _ in refs)
            + f" | {'speed-up':>8} {'GB/s':>7} | {'flash':>8} {'GB/s':>7} | {'max|err|':>8}")
    print("times in ms; speed-up = first PyTorch reference / triton; GB/s = K/V bytes read / time; triton = "
          "paged_attention, flash = flash_decode (the engine's decode kernel)\n" + head + "\n" + "-" * len(head))
    for B, ctx, H, Hkv, D, dtype in configs:
        try:
            x = make_decode_batch(B, ctx, H, Hkv, D, dtype, "cuda")
            args = [x[n] for n in ("query", "key_cache", "value_cache", "block_tables",
                                   "seq_lens", "query_start_loc")]
            scale = 1.0 / math.sqrt(D)
            max_q = check_paged_inputs(*args, scale, 1)
            out = torch.empty_like(x["query"])
            t_tri = cuda_time_ms(lambda: _launch(*args, scale, max_q, out), iters)
            t_chk = cuda_time_ms(lambda: kernels.paged_attention(*args, scale, 1), iters)
            t_fl = cuda_time_ms(lambda: _launch_decode(*args[:5], scale, out), iters)
            t_refs = []
            for _, fn in refs:
                try:
                    t_refs.append(cuda_time_ms(lambda: fn(*args, scale), max(1, iters // 10), 3))
                except torch.cuda.OutOfMemoryError:
                    t_refs.append(float("nan"))
                    torch.cuda.empty_cache()
            want = refs[0][1](*args, scale)
            err = max((kernels.paged_attention(*args, scale).float() - want.float()).abs().max().item(),
                      (kernels.flash_decode(*args[:5], scale).float() - want.float()).abs().max().item())
            kv_bytes = 2 * int(x["seq_lens"].sum()) * Hkv * D * x["key_cache"].element_size()
            print(f"{B:>3} {ctx:>5} {H:>3} {Hkv:>3} {D:>4} {str(dtype)[6:]:>8} | {t_tri:8.3f} "
                  f"{t_chk:8.3f} | " + " ".join(f"{t:11.3f}" for t in t_refs)
                  + f" | {t_refs[0] / t_tri:7.1f}x {kv_bytes / t_tri / 1e6:7.0f} | {t_fl:8.3f} "
                  f"{kv_bytes / t_fl / 1e6:7.0f} | {err:8.1e}"
                  + ("  <-- MISMATCH" if not err < 2e-2 else ""), flush=True)
            del x, args, out, want
            torch.cuda.empty_cache()
        except Exception as e:   # noqa: BLE001 - report and go on with the next row
            print(f"{B:>3} {ctx:>5} {H:>3} {Hkv:>3} {D:>4} {str(dtype)[6:]:>8} | failed: {e!r}")
            torch.cuda.empty_cache()


def copy_gbps(nbytes: int = 1 << 30) -> float:
    """What the card's memory moves in a plain device-to-device copy: (read + write) bytes / time."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), 10)
    del src, dst
    return 2 * nbytes / ms / 1e6


def smoke_cpu():
    """Tiny correctness check through the Triton interpreter (no timings)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")       # before the first import of kernels
    import kernels
    print("CUDA is needed for timings; running a tiny correctness check through the "
          "Triton interpreter instead.")
    t0 = time.perf_counter()
    x = make_decode_batch(3, 40, 8, 2, 32, torch.float32, "cpu")
    args = [x[n] for n in ("query", "key_cache", "value_cache", "block_tables",
                           "seq_lens", "query_start_loc")]
    outs = {"triton": kernels.paged_attention(*args, 32 ** -0.5), "flash": kernels.flash_decode(*args[:5], 32 ** -0.5)}
    for name, fn in torch_references()[:1] + [("torch-local", local_paged_reference)]:
        for kernel, out in outs.items():
            err = (out - fn(*args, 32 ** -0.5)).abs().max().item()
            print(f"  {kernel} vs {name}: max |err| = {err:.1e} ({'ok' if err < 1e-4 else 'MISMATCH'})")
    print(f"  ({time.perf_counter() - t0:.1f} s)")


def spread(samples) -> str:
    """best / median / worst of a list of times in ms."""
    return f"{min(samples):7.3f} {statistics.median(samples):7.3f} {max(samples):7.3f}"


def bench_cpu(configs, iters, rounds):
    """Attention alone: "batched" vs "cpu", each through the engine's path, per layer call, in ms."""
    from minibatch.kv import backends
    from minibatch.kv.attention import AttentionMetadata
    if backends.cpu_kernel.load() is None:
        print("the 'cpu' backend's operator cannot be built here (see the warning above): nothing to compare")
        return False
    print(f"CPU: {torch.get_num_threads()} thread(s); torch {torch.__version__}; block_size {BLOCK_SIZE}; decode; "
          f"ms per call over {iters} calls, {rounds} rounds alternating: best / median / worst")
    head = (f"{'B':>3} {'ctx':>5} {'H':>3} {'Hkv':>3} {'D':>4} {'dtype':>8} | {'batched':^23} | {'cpu':^23} | "
            f"{'speed-up':>8} | {'max|err|':>8}")
    print(head + "\n" + "-" * len(head))
    for B, ctx, H, Hkv, D, dtype in configs:
        x = make_decode_batch(B, ctx, H, Hkv, D, dtype, "cpu")
        lens = x["seq_lens"].tolist()
        md = AttentionMetadata(None, x["block_tables"], x["seq_lens"], x["query_start_loc"], 1, max(lens), None,
                               lens, [1] * B)
        call = (x["query"], x["key_cache"], x["value_cache"], md, D ** -0.5)
        fns = {name: backends.get(name)[1] for name in ("batched", "cpu")}
        times = {name: [] for name in fns}
        for name, fn in fns.items():
            fn(*call)                                          # warm-up (and "batched"'s plan, made once a step)
        for _ in range(rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn(*call)
                times[name].append((time.perf_counter() - t0) / iters * 1e3)
        err = (fns["cpu"](*call).float() - fns["batched"](*call).float()).abs().max().item()
        print(f"{B:>3} {ctx:>5} {H:>3} {Hkv:>3} {D:>4} {str(dtype)[6:]:>8} | {spread(times['batched'])} | "
              f"{spread(times['cpu'])} | {min(times['batched']) / min(times['cpu']):7.2f}x | {err:8.1e}", flush=True)
    return True


KV_CONTEXTS = (512, 1024, 2048)
# (label, kv_cache_dtype, scale granularity, query and model dtype)
KV_MODES = [("fp32", "auto", None, torch.float32), ("bf16", "auto", None, torch.bfloat16),
            ("fp8_e4m3", "fp8_e4m3", "per_tensor", torch.float32), ("int8", "int8", "per_tensor", torch.float32),
            ("fp8 tok-head", "fp8_e4m3", "per_token_head", torch.float32),
            ("int8 tok-head", "int8", "per_token_head", torch.float32)]


def _kv_call(x, kv_cache_dtype, granularity, dtype):
    """The decode batch x with its blocks stored as ``kv_cache_dtype`` (quant.py's torch quantize, the reference
    the stores are held to): (query, key_cache, value_cache, scales)."""
    from minibatch.kv import quant
    q, kc, vc = (x[n].to(dtype) for n in ("query", "key_cache", "value_cache"))
    if kv_cache_dtype == "auto":
        return q, kc, vc, {}
    if granularity == "per_tensor":
        ks, vs = (torch.tensor(quant.calibrate_scale(c, kv_cache_dtype)) for c in (kc, vc))
    else:
        ks, vs = (quant.token_head_scales(c, kv_cache_dtype) for c in (kc, vc))      # [N, bs, Hkv]
    kq, vq = quant.quantize(kc, kv_cache_dtype, ks), quant.quantize(vc, kv_cache_dtype, vs)
    return q, kq, vq, dict(k_scale=ks.contiguous(), v_scale=vs.contiguous())


def bench_kv_dtypes(iters, rounds, B=16, H=4, Hkv=4, D=64):
    """Decode on the CPU operator for each KV dtype (KV_MODES) and context (KV_CONTEXTS), batch B."""
    from minibatch.kv import backends
    from minibatch.kv.attention import AttentionMetadata
    if backends.cpu_kernel.load() is None:
        print("the 'cpu' backend's operator cannot be built here (see the warning above): nothing to time")
        return
    attend = backends.get("cpu")[1]
    print(f"CPU operator, decode, batch {B}, H {H}, Hkv {Hkv}, D {D}, block_size {BLOCK_SIZE}; "
          f"{torch.get_num_threads()} thread(s); ms per call over {iters} calls, best of {rounds} rounds "
          f"alternating the modes; ratio to fp32: best rounds [min-max over rounds]")
    head = f"{'ctx':>5} {'KV blocks':>14} | {'best ms':>8} | {'ratio to fp32':^22}"
    print(head + "\n" + "-" * len(head))
    for ctx in KV_CONTEXTS:
        x = make_decode_batch(B, ctx, H, Hkv, D, torch.float32, "cpu")
        lens = x["seq_lens"].tolist()
        md = AttentionMetadata(None, x["block_tables"], x["seq_lens"], x["query_start_loc"], 1, max(lens), None,
                               lens, [1] * B)
        calls = {label: _kv_call(x, *mode) for label, *mode in KV_MODES}
        times = {label: [] for label in calls}
        for _ in range(rounds + 1):                            # the first round warms up, untimed
            for label, (q, kc, vc, scales) in calls.items():
                t0 = time.perf_counter()
                for _ in range(iters):
                    attend(q, kc, vc, md, D ** -0.5, **scales)
                times[label].append((time.perf_counter() - t0) / iters * 1e3)
        for label, t in times.items():
            t, ref = t[1:], times["fp32"][1:]
            ratios = [a / b for a, b in zip(t, ref)]
            print(f"{ctx:>5} {label:>14} | {min(t):8.3f} | {min(t) / min(ref):5.2f} "
                  f"[{min(ratios):5.2f}-{max(ratios):5.2f}]", flush=True)


def bench_engine_decode(batch, prompt_len, max_tokens, rounds):
    """A whole decode step of the shipped target through ``LLM``: ``batch`` requests, every step after their
    prefills a batch-``batch`` decode; the median decode step of each round, rounds alternating the backends."""
    from minibatch import LLM, SamplingParams
    text = (b"def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
            * 64)
    medians = {"batched": [], "cpu": []}
    best_step = {}
    for _ in range(rounds):
        for backend in medians:
            llm = LLM("target", attention_backend=backend, max_num_seqs=batch)
            eng, traces = llm.llm_engine, []
            eng.add_hook(traces.append)
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            for i in range(batch):                   # distinct prompts (no prefix-cache sharing), lengths spread
                n = prompt_len // 2 + (prompt_len * i) // (2 * batch)
                eng.add_request(f"r{i}", list(text[i * 7: i * 7 + n]), params)
            while eng.has_unfinished_requests():
                eng.step()
            steps = [t.duration * 1e3 for t in traces
                     if len(t.scheduled) == batch and all(s.phase == "decode" for s in t.scheduled)]
            medians[backend].append(statistics.median(steps))
            best_step[backend] = min(best_step.get(backend, float("inf")), min(steps))
    print(f"\nengine decode step, target model, batch {batch}, prompts {prompt_len // 2}..{prompt_len - 1} bytes, "
          f"{max_tokens} tokens each ({len(steps)} decode steps a round; {torch.get_num_threads()} thread(s)); "
          f"ms, the median step of each of {rounds} rounds: best / median / worst")
    for backend, m in medians.items():
        print(f"  {backend:>8}: {spread(m)}   (fastest single step {best_step[backend]:.3f})")
    print(f"  speed-up (best rounds): {min(medians['batched']) / min(medians['cpu']):.2f}x")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two small configurations only")
    p.add_argument("--iters", type=int, default=50, help="calls per timing sample (triton; --cpu)")
    p.add_argument("--cpu", action="store_true", help="time the CPU backends, 'batched' vs 'cpu', and an engine step")
    p.add_argument("--rounds", type=int, default=7, help="--cpu, --kv-dtypes: timed rounds, alternating")
    p.add_argument("--kv-dtypes", action="store_true",
                   help="the CPU operator's decode on fp32, bf16, fp8 and int8 KV blocks, at contexts 512-2048")
    a = p.parse_args(argv)
    if a.kv_dtypes:
        with torch.no_grad():
            bench_kv_dtypes(a.iters, a.rounds)
        return
    if a.cpu:
        with torch.no_grad():
            if bench_cpu(CPU_QUICK if a.quick else CPU_CONFIGS, a.iters, a.rounds):
                bench_engine_decode(16, 384, 32 if a.quick else 96, max(1, a.rounds // 2) if a.quick else a.rounds)
        return
    if not torch.cuda.is_available():
        smoke_cpu()
        return
    torch.manual_seed(0)
    bench_cuda(QUICK if a.quick else CONFIGS, a.iters)


if __name__ == "__main__":
    main()
