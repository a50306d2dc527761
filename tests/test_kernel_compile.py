"""Every Triton kernel compiled for real GPUs (sm_80 and sm_90), without one, at the launches the engine makes.

The interpreter that runs the kernels on a CPU in CI never compiles them, so a kernel that Triton's compiler
rejects (a type error, a shape that does not lower, too much shared memory) would pass CI and fail on the first
GPU. Here the engine runs on a CPU, through the interpreter, with the "triton" backend: plain decoding with
chunked prefill, draft k = 4 (n-gram verifies the same shapes), Medusa's static tree, EAGLE's dynamic tree and early exit. Every call of a
kernel's launcher (``_launch``, ``_launch_decode``, ``launch_store_kv``) is recorded; each is then replayed in
fp32, fp16 and bf16 (the float tensors rebuilt in that dtype with the same strides and storage offsets, so the
byte alignment is what a model of that dtype has), with the kernels' launches caught rather than run. Each
caught launch goes through Triton's own specialisation (the binder that ``JITFunction.run`` builds, with the
CUDA backend): dtypes, constexprs, arguments equal to 1, 16-divisible pointers and integers, exactly as on a GPU.
The launchers are also called at the kernel tests' GQA/MQA layouts (the shipped models have none).
Quantized caches (fp8 e4m3 / e5m2, int8; scales per tensor and per token-head) are launched at a GQA layout for
every kernel (``quant_launches``): their variants (``KV_FORMAT``) are compiled too. Exercise 9's launcher is
recorded too; its kernel is the student's, so the reference it stands for
(``kernels/paged_decode.py``, the same parameters) is compiled at its launches.

Each unique specialisation is then compiled by ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 80 or
90, 32))`` to a cubin (ptxas ships in the Triton wheel), in two subprocesses without ``TRITON_INTERPRET`` and
with an empty cache, and its shared memory (compiler metadata) and registers (``cuobjdump -res-usage``) are
checked against the GPU's limits. A rejected kernel fails this test.
"""
from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TARGETS = (80, 90)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}       # bytes of shared memory a block may use (A100, H100)
LAUNCHERS = {"kernels.paged_attention": "_launch", "kernels.flash_decode": "_launch_decode",
             "kernels.store_kv": "launch_store_kv"}
KERNELS = {"kernels.paged_attention": ["_paged_attention_kernel"], "kernels.paged_decode": ["_paged_decode_kernel"],
           "kernels.flash_decode": ["_flash_decode_kernel", "_combine_kernel"], "kernels.store_kv": ["_store_kv_kernel"]}
EX9 = ("exercises.ex9_paged_decode_kernel", "_paged_decode_kernel")     # stands for kernels.paged_decode's

pytestmark = pytest.mark.interpreter          # drives the engine with CPU tensors (with CUDA, the gpu tests run)


def present() -> list:
    """[(module, kernel)] of kernels/ that this copy has (a student release cuts ex9's reference kernel out)."""
    return [(m, n) for m, ns in KERNELS.items() for n in ns if hasattr(importlib.import_module(m), n)]


# ----------------------------------------------------------------------------- recording
def workloads(target, draft):
    """(name, LLM kwargs) the engine runs: every path that launches a kernel, small enough for the interpreter."""
    from minibatch.model.weights import WEIGHTS_DIR
    have = lambda m: (WEIGHTS_DIR / f"{m}.safetensors").exists()                 # noqa: E731
    runs = [("plain, chunked prefill", {}),
            ("draft k=4", dict(draft_model=draft, speculative_config={"method": "draft", "num_speculative_tokens": 4}))]
    runs += [(n, dict(speculative_config=c)) for n, c in (
        ("medusa static tree", {"method": "medusa", "tree": "static"}),
        ("eagle dynamic tree", {"method": "eagle", "tree": "dynamic"}),
        ("early exit k=3", {"method": "early_exit", "num_speculative_tokens": 3})) if have(c["method"])]
    return runs


def record_engine_calls(target, draft) -> tuple[list, list]:
    """Run every workload with the launchers wrapped: [(module, launcher, args, kwargs)], and the names run."""
    from minibatch import LLM, SamplingParams
    calls = []
    originals = {m: getattr(importlib.import_module(m), f) for m, f in LAUNCHERS.items()}

    def wrap(mod, fn):
        def launcher(*args, **kwargs):
            calls.append((mod, args, kwargs))
            return fn(*args, **kwargs)
        return launcher
    prompts = ["def fib(n):\n    return", "The cat sat on the mat because it was warm and the sun shone. " * 2]
    params = [SamplingParams(temperature=0, max_tokens=4), SamplingParams(temperature=0, max_tokens=3)]
    names = []
    try:
        for m, f in LAUNCHERS.items():
            setattr(importlib.import_module(m), f, wrap(m, originals[m]))
        for name, kw in workloads(target, draft):
            llm = LLM(target, attention_backend="triton", block_size=8, max_num_batched_tokens=48, **kw)
            llm.generate(prompts, params, use_tqdm=False)
            names.append(name)
    finally:
        for m, f in LAUNCHERS.items():
            setattr(importlib.import_module(m), f, originals[m])
    return calls, names


def in_dtype(x, dtype):
    """A float tensor rebuilt in dtype with x's shape, strides and storage offset (contents irrelevant)."""
    if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
        return x
    base = torch.empty(x.untyped_storage().nbytes() // x.element_size(), dtype=dtype)
    return base.as_strided(x.shape, x.stride(), x.storage_offset())


def gqa_calls():
    """The launchers at the kernel tests' head layouts the shipped models lack: GQA, MQA, head_dim 24 and 128
    (decode, a mixed batch, a tree), as [(module, args, kwargs)]."""
    from test_kernels import make_batch
    out = []
    for (H, Hkv), D in (((8, 2), 128), ((32, 8), 64), ((4, 1), 24)):
        b = make_batch([1, 1], [40, 9], 16, H, Hkv, D)
        out.append(("kernels.flash_decode", (b["query"], b["key_cache"], b["value_cache"], b["block_tables"],
                                             b["seq_lens"], 0.1, torch.empty_like(b["query"])), {}))
        b = make_batch([1, 12, 5], [50, 30, 23], 16, H, Hkv, D)
        args = [b[n] for n in ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc")]
        for tree in (None, torch.full((18,), -1, dtype=torch.int64)):
            out.append(("kernels.paged_attention", (*args, 0.1, 12, torch.empty_like(b["query"])),
                        {"tree_bits": tree}))
    return out


# (kv_cache_dtype, scale granularity, query dtype): every format per token-head in fp16, per tensor, bf16 and fp32
QUANT = [(f, "per_token_head", torch.float16) for f in ("fp8_e4m3", "fp8_e5m2", "int8")] + [
    ("fp8_e4m3", "per_tensor", torch.float16), ("fp8_e5m2", "per_token_head", torch.bfloat16),
    ("int8", "per_tensor", torch.float32)]


def quant_launches() -> None:
    """Every kernel on a quantized cache (launches caught by ``Catch``): the store, paged attention with and
    without a tree, flash decode split and not, paged decode; H 8, Hkv 2, D 64, block size 16."""
    from kernels.flash_decode import _launch_decode
    from kernels.paged_attention import _launch
    from kernels.paged_decode import paged_decode
    from kernels.store_kv import launch_store_kv
    from minibatch.kv import quant
    from test_kernels import make_batch
    for name, granularity, dt in QUANT:
        b = make_batch([1, 12, 5], [50, 30, 23], 16, 8, 2, 64, dtype=dt)
        kc, vc = (torch.zeros(b["key_cache"].shape, dtype=quant.storage_dtype(name)) for _ in range(2))
        ks, vs = (torch.ones(1) if granularity == "per_tensor" else torch.ones(kc.shape[:3]) for _ in range(2))
        sc = dict(k_scale=ks, v_scale=vs)
        launch_store_kv(b["query"][:, :2], b["query"][:, 2:4], kc, vc, b["query_start_loc"][1:].long(), **sc)
        args = (b["query"], kc, vc, b["block_tables"], b["seq_lens"], b["query_start_loc"], 0.1, 12,
                torch.empty_like(b["query"]))
        for tree in (None, torch.full((18,), -1, dtype=torch.int64)):
            _launch(*args, tree_bits=tree, **sc)
        d = make_batch([1, 1], [40, 9], 16, 8, 2, 64, dtype=dt)
        for width in (d["block_tables"][:, :3], d["block_tables"][:, :1].repeat(1, 20)):     # one split, and several
            _launch_decode(d["query"], kc, vc, width, d["seq_lens"], 0.1, torch.empty_like(d["query"]), **sc)
        paged_decode(d["query"], kc, vc, d["block_tables"], d["seq_lens"], 0.1, **sc)


def ex9_calls():
    """Exercise 9's launcher at the graded test's layouts: MHA/GQA/MQA, int32/int64 tables, D 24/64."""
    sys.path.insert(0, str(ROOT / "tests" / "exercises"))
    try:
        from test_ex9_paged_decode_kernel import make_batch
    finally:
        sys.path.pop(0)
    out = []
    for (H, Hkv), bs, D, idx in (((4, 4), 8, 24, torch.int32), ((8, 2), 16, 64, torch.int64), ((4, 1), 32, 64,
                                                                                                 torch.int32)):
        b = make_batch([5, 17, 40], bs, H, Hkv, D, idx_dtype=idx)
        out.append((b["query"], b["key_cache"], b["value_cache"], b["block_tables"], b["seq_lens"], 0.125))
    return out


class Catch:
    """Replace the kernels' run (the interpreter's, or the JIT's) with a recorder: launches are caught, not run."""

    def __init__(self, kernels: dict):
        self.kernels, self.caught = kernels, []        # kernels: {(module, name): the kernel to compile for it}

    def __enter__(self):
        for (m, n), as_ in self.kernels.items():
            k = getattr(importlib.import_module(m), n)
            k.run = (lambda as_: lambda *args, grid, warmup, **kw: self.caught.append((as_, args, kw)))(as_)
        return self

    def __exit__(self, *exc):
        for m, n in self.kernels:
            del getattr(importlib.import_module(m), n).run


def specialise(kernel_id, args, kwargs, binders) -> dict:
    """Triton's own specialisation of a launch, with the CUDA backend: what JITFunction.run passes to compile."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature
    if kernel_id not in binders:
        k = getattr(importlib.import_module(kernel_id[0]), kernel_id[1])
        jf = k if isinstance(k, JITFunction) else JITFunction(k.fn, **k.kwargs)   # the interpreter keeps fn, kwargs
        backend = make_backend(GPUTarget("cuda", 80, 32))
        binders[kernel_id] = jf, backend, create_function_from_signature(jf.signature, jf.params, backend)
    jf, backend, binder = binders[kernel_id]
    bound, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jf._pack_args(backend, kwargs, bound, spec, options)
    return {"kernel": list(kernel_id), "signature": signature,
            "constexprs": [[list(p), v] for p, v in constexprs.items()],
            "attrs": [[list(p), v] for p, v in attrs.items()],
            "options": {k: v for k, v in kwargs.items() if k in options.__dict__},   # num_warps etc. if the launch set them
            "num_warps": options.num_warps, "num_stages": options.num_stages}


# ----------------------------------------------------------------------------- compiling (a subprocess)
def compile_one(spec: dict, cap: int) -> dict:
    """Compile one specialisation for sm_<cap> down to a cubin; its shared memory, registers and spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    kernel = getattr(importlib.import_module(spec["kernel"][0]), spec["kernel"][1])
    src = ASTSource(kernel, spec["signature"], {tuple(p): v for p, v in spec["constexprs"]},
                    {tuple(p): v for p, v in spec["attrs"]})
    names = getattr(importlib.import_module(spec["kernel"][0]), spec["kernel"][1]).arg_names
    res = {"kernel": spec["kernel"][1], "cap": cap, "dtype": next(t for t in spec["signature"].values() if "*" in t),
           "constexprs": {names[p[0]]: v for p, v in spec["constexprs"]}}
    try:
        k = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=spec["options"])
    except Exception as e:                                           # the compiler's rejection, reported
        return dict(res, error=f"{type(e).__name__}: {str(e)[-1500:]}")
    res.update(shared=k.metadata.shared, stages=list(k.asm))
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if "cubin" in k.asm and tool.exists():
        path = Path(os.environ["TRITON_CACHE_DIR"]) / f"k{os.getpid()}.cubin"
        path.write_bytes(k.asm["cubin"])
        usage = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True).stdout
        for key, name in (("REG", "regs"), ("STACK", "stack"), ("LOCAL", "local")):
            m = re.search(rf"{key}:(\d+)", usage)
            res[name] = int(m.group(1)) if m else None
    return res


def compile_all(specs: list, shard: int, shards: int) -> list:
    return [compile_one(s, cap) for i, (s, cap) in enumerate((s, c) for s in specs for c in TARGETS)
            if i % shards == shard]


# ----------------------------------------------------------------------------- the test
@pytest.fixture(scope="module")
def specs(target_model, draft_model):
    t0, cpu = time.time(), time.process_time()
    calls, names = record_engine_calls(target_model, draft_model)
    launched = {m for m, _, _ in calls}
    assert launched == set(LAUNCHERS), f"a launcher the engine should reach was not: {set(LAUNCHERS) - launched}"
    ours = {k: k for k in present()}
    ref = ("kernels.paged_decode", "_paged_decode_kernel")
    with Catch({**ours, EX9: ref} if ref in ours else ours) as catch:
        for m, args, kwargs in calls + gqa_calls():
            for dt in DTYPES:
                getattr(importlib.import_module(m), LAUNCHERS[m])(*(in_dtype(a, dt) for a in args),
                                                                  **{k: in_dtype(v, dt) for k, v in kwargs.items()})
        if ("kernels.paged_decode", "_paged_decode_kernel") in ours:          # not in a student release
            quant_launches()
        ex9 = importlib.import_module(EX9[0])
        for args in ex9_calls() if ref in ours else ():
            for dt in DTYPES:
                ex9.paged_decode(*(in_dtype(a, dt) for a in args))
    if ref in ours:
        ref, stub = (getattr(importlib.import_module(m), n) for m, n in (ref, EX9))
        assert ref.arg_names == stub.arg_names, "exercise 9's kernel must keep the reference's parameters"
    binders, unique = {}, {}
    for kernel_id, args, kwargs in catch.caught:
        s = specialise(kernel_id, args, kwargs, binders)
        unique.setdefault(json.dumps(s, sort_keys=True), s)
    print(f"\n{len(calls)} launcher calls in {names}; {len(catch.caught)} launches in 3 dtypes -> "
          f"{len(unique)} specialisations ({time.time() - t0:.0f} s, {time.process_time() - cpu:.0f} s CPU)")
    return list(unique.values())


def test_specialisations_cover_every_kernel_dtype_and_path(specs):
    kinds = {(s["kernel"][1], s["signature"]["q_ptr" if "q_ptr" in s["signature"] else next(iter(s["signature"]))])
             for s in specs}
    for name in [n for _, n in present() if n != "_combine_kernel"]:
        for dt in ("*fp32", "*fp16", "*bf16"):
            assert (name, dt) in kinds, f"{name} was never launched with {dt}"
    flags = {dict((tuple(p), v) for p, v in s["constexprs"]).get((_arg("HAS_TREE"),)) for s in specs
             if s["kernel"][1] == "_paged_attention_kernel"}
    assert flags == {True, False}, "trees (HAS_TREE) and plain prefill/verify both compiled"
    if ("kernels.paged_decode", "_paged_decode_kernel") in present():  # every kernel in every quantized format
        formats = {(s["kernel"][1], dict((tuple(p), v) for p, v in s["constexprs"]).get(
            (_arg("KV_FORMAT", *s["kernel"]),))) for s in specs if s["kernel"][1] != "_combine_kernel"}
        for _, name in [k for k in present() if k[1] != "_combine_kernel"]:
            assert {f for n, f in formats if n == name} == {0, 1, 2, 3}, f"{name}: {formats}"
    splits = {dict((tuple(p), v) for p, v in s["constexprs"]).get((_arg("SPLIT", "kernels.flash_decode",
                                                                        "_flash_decode_kernel"),))
              for s in specs if s["kernel"][1] == "_flash_decode_kernel"}
    assert splits == {True, False}, "short and split decodes both compiled"
    for s in specs:                                       # the block table's width is never specialised on
        if "stride_bt" in s["signature"]:
            i = _arg("stride_bt", *s["kernel"])
            assert not any(p == [i] for p, _ in s["attrs"]) and s["signature"]["stride_bt"] == "i32", s


def _arg(name, module="kernels.paged_attention", kernel="_paged_attention_kernel"):
    return getattr(importlib.import_module(module), kernel).arg_names.index(name)


def test_every_launched_specialisation_compiles_for_sm80_and_sm90(specs, tmp_path):
    (tmp_path / "specs.json").write_text(json.dumps(specs))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    (tmp_path / "cache").mkdir()
    t0, cpu, shards = time.time(), os.times(), 2
    procs = [subprocess.Popen([sys.executable, __file__, str(tmp_path / "specs.json"), str(i), str(shards),
                               str(tmp_path / f"out{i}.json")], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
             for i in range(shards)]
    errs = [p.communicate(timeout=900)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(e[-3000:] for e in errs)
    results = [r for i in range(shards) for r in json.loads((tmp_path / f"out{i}.json").read_text())]
    assert len(results) == len(specs) * len(TARGETS)
    rejected = [r for r in results if "error" in r]
    assert not rejected, "the compiler rejected:\n" + "\n".join(f"{r['kernel']} sm_{r['cap']}: {r['error']}"
                                                               for r in rejected[:5])
    for r in results:
        assert "cubin" in r["stages"], r
        assert r["shared"] <= SHARED_LIMIT[r["cap"]], f"{r['kernel']} needs {r['shared']} B of shared memory"
    print(f"\ncompiled {len(specs)} specialisations x sm_{'/sm_'.join(map(str, TARGETS))} = {len(results)} cubins "
          f"in {time.time() - t0:.0f} s, {os.times().children_user - cpu.children_user:.0f} s CPU (ptxas from the "
          f"Triton wheel)")
    for name in sorted({r["kernel"] for r in results}):
        rs = [r for r in results if r["kernel"] == name]
        top = max(rs, key=lambda r: r.get("regs") or 0)
        print(f"  {name}: {len(rs) // len(TARGETS)} specialisations; shared <= {max(r['shared'] for r in rs)} B, "
              f"registers {min(r.get('regs') or 0 for r in rs)}-{top.get('regs')} (most: sm_{top['cap']} "
              f"{top['dtype']} {top['constexprs']}), spilled (local) <= {max(r.get('local') or 0 for r in rs)} B")
    out = os.environ.get("MINIBATCH_COMPILE_REPORT")
    if out:
        Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":                     # the compiling subprocess: specs.json shard shards out.json
    spec_file, shard, shards, out_file = sys.argv[1:]
    Path(out_file).write_text(json.dumps(compile_all(json.loads(Path(spec_file).read_text()), int(shard),
                                                     int(shards))))
