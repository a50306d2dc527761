"""The cost of one engine step on hardware we do not have: a roofline per operator over a ``StepTrace``.

A step runs one flat batch through the model. The trace says, per scheduled row b, its new tokens
q_b (``num_tokens``) and its context after the step c_b = ``num_computed_before`` + q_b. With
T = sum_b q_b, hidden size H, query width Q = n_heads x d, K/V width K = n_kv x d, MLP size I,
vocabulary V, w bytes per weight (and per activation), every layer runs

    qkv        FLOPs 2 T H (Q + 2K)       bytes w [H (Q + 2K)  +  T (H + Q + 2K)]
    attention  FLOPs sum_b 4 q_b c_b Q    bytes w [sum_b c_b 2K  +  T 2K  +  2 T Q]
                                          (each row's K/V read over its context, the new K/V written)
    o_proj     FLOPs 2 T Q H              bytes w [Q H  +  T (Q + H)]
    mlp        FLOPs 2 T m                bytes w [m  +  T (2H + 2I)],  m = 3 H I gated, 2 H I not
    tp_allreduce (tensor parallelism, 2 per layer)   bytes 2 (tp-1)/tp T H w over the interconnect

and the output head     lm_head  FLOPs 2 N H V   bytes w H V + 4 N V,
N = rows that need logits (every token of a decode or verify row, the last token of a prompt's last
chunk). Weights are read once per step, however many rows share them (the input embedding is a gather of
T rows, left out): that is why decode is
memory-bound and why batching and speculation pay on a GPU.

Each operator takes  max(FLOPs / peak, bytes / bandwidth)  (Williams et al.'s roofline, CACM 2009);
``breakdown()`` says which term bound it. Each kernel adds the profile's launch overhead; a uniform decode
step (every row a decode of one length: 1, or 1 + k drafts) on a profile with CUDA graphs adds one graph
replay instead (vLLM V1 captures those). A measured
profile (``calibrate.py``) also adds a host cost per step, per row (scheduling, Python) and per token
(on a CPU, the elementwise work that a roofline of matrix products misses).

With ``host`` (``simulate="h100+cpu:..."``, ``perf/host.py``) the step also pays the host CPU's time,
cpu = factor (per_step + per_seq B) for B scheduled rows: cpu + device under synchronous scheduling, max(cpu,
device) under asynchronous scheduling (``StepTrace.async_scheduling``; the first step pays both).

The proposer's work this step (``StepTrace.drafted``: per sequence drafted for, [drafts, depth, context])
is costed from what ran: a draft model's ``depth`` passes (the draft profile), an EAGLE layer's passes
(one layer of the target + its fc and head), early exit's shallow passes (the first E/L of the target's
layers + the head), Medusa's heads (one pass: per head a residual block H x H and a head H x V);
prompt lookup costs nothing on the device. With tensor parallelism (``simulate="2xh100:..."``) every
weight, FLOP and byte is split tp ways and the all-reduces are added, except the K/V heads: a rank holds
max(1, n_kv / tp) of them (vLLM's rule, ``minibatch/distributed/tp_model.py``), since past n_kv ranks each
K/V head is replicated on tp / n_kv ranks. So K above becomes K_r = max(1, n_kv / tp) x d per rank, in the
k/v projections' weights and outputs, the cache a step reads and writes, and the KV pool's budget.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import torch

from minibatch.kv import quant
from minibatch.perf.hardware import HardwareProfile, get_hardware
from minibatch.perf.host import HOST_CPU, HostCpuProfile
from minibatch.perf.models import CHECKPOINTS, DEFAULT_DRAFT, ModelProfile, get_model

KERNELS_PER_LAYER = 10     # 2 norms, qkv, rotary/cache write, attention, o_proj, 2 residual adds, mlp in, mlp out
KERNELS_HEAD = 3           # final norm, lm_head, sampling
HOST_SUFFIX = "+cpu"       # 'h100+cpu:target': the device and the host CPU beside it (perf/host.py)


def kv_bytes_per_token(m: ModelProfile, kv_cache_dtype: str = "auto", scale_granularity: str = "per_tensor") -> float:
    """One token's K/V in every layer at the cache's dtype (``kv/quant.py`` counts it): the model's dtype for
    "auto" (``m.kv_bytes_per_token``), one byte a value for fp8/int8, plus 4 bytes per (token, KV head) scale."""
    if quant.check_kv_cache_dtype(kv_cache_dtype) == "auto":
        return m.kv_bytes_per_token
    return quant.bytes_per_token(m.n_layer, m.n_kv_heads, m.head_dim, kv_cache_dtype,
                                 torch.float32 if m.dtype_bytes == 4 else torch.bfloat16, scale_granularity)


@dataclass
class Op:
    name: str
    flops: float
    bytes: float
    kernels: int = 1
    link: bool = False         # traffic over the tensor-parallel interconnect, not device memory


def parse_simulate(spec: str):
    """'[Nx]HARDWARE:MODEL[:DRAFT]' -> (hardware name, tp, model name, draft name or None); names not checked."""
    if not isinstance(spec, str):
        raise TypeError(f"simulate must be a str like 'h100:llama-3-8b', got {type(spec).__name__}")
    m = re.fullmatch(r"(?:(\d+)x)?([^:\s]+):([^:\s]+)(?::([^:\s]+))?", spec.strip())
    if not m:
        raise ValueError(f"malformed simulate string {spec!r}; expected '[Nx]HARDWARE:MODEL[:DRAFT]', e.g. "
                         f"'h100:llama-3-8b', '2xh100:llama-3-70b' or 'h100:llama-3-8b:llama-3.2-1b' ('h100+cpu:...' adds the "
                         f"host CPU's time per step)")
    tp = int(m.group(1) or 1)
    if tp < 1:
        raise ValueError(f"simulate {spec!r}: the tensor-parallel degree must be >= 1")
    return m.group(2), tp, m.group(3), m.group(4)


class CostModel:
    """step_time(trace) -> seconds on ``hardware`` for ``model``; breakdown(trace) -> the operators."""

    def __init__(self, hardware: HardwareProfile, model: ModelProfile, draft: ModelProfile | None = None,
                 tp: int = 1, host: HostCpuProfile | None = None, kv_cache_dtype: str = "auto",
                 scale_granularity: str = "per_tensor"):
        if tp > 1 and hardware.interconnect_bandwidth <= 0:
            raise ValueError(f"{hardware.name} has no interconnect for tensor parallelism (tp={tp}); use tp=1")
        self.hw, self.model, self.draft, self.tp, self.host = hardware, model, draft, tp, host
        # the target's KV cache (kv/quant.py): what attention reads and writes, and what a swapped block moves,
        # is priced at its stored bytes and scales; the draft model keeps its own cache in its own dtype
        self.kv_cache_dtype = quant.check_kv_cache_dtype(kv_cache_dtype)
        self.scale_granularity = quant.check_scale_granularity(scale_granularity)

    @classmethod
    def from_spec(cls, spec: str, kv_cache_dtype: str = "auto", scale_granularity: str = "per_tensor") -> "CostModel":
        """'h100:llama-3-8b'; 'h100+cpu:target' adds the host CPU's time per step (perf/host.py)."""
        hw, tp, model, draft = parse_simulate(spec)
        host = None
        if hw.endswith(HOST_SUFFIX):
            hw, host = hw[: -len(HOST_SUFFIX)], HOST_CPU
        m = get_model(model)
        return cls(get_hardware(hw), m, get_model(draft or DEFAULT_DRAFT.get(model, "draft")), tp, host,
                   kv_cache_dtype, scale_granularity)

    def __repr__(self):
        tp = f"{self.tp}x" if self.tp > 1 else ""
        host = HOST_SUFFIX if self.host else ""
        return f"CostModel({tp}{self.hw.name}{host}:{self.model.name}, draft {self.draft.name if self.draft else None})"

    # -- memory ---------------------------------------------------------------------------------------------
    def num_gpu_blocks(self, block_size: int, gpu_memory_utilization: float = 0.9, kv_cache_dtype: str = "auto",
                       scale_granularity: str = "per_tensor") -> int:
        """vLLM's KV budget: (memory x gpu_memory_utilization - weights) / bytes of one block, per device; a
        quantized cache's block counts its stored bytes and its scales (``kv_bytes_per_token``)."""
        m, budget = self.model, self.hw.mem_capacity * gpu_memory_utilization
        kv_proj = m.n_layer * m.hidden * 2 * m.dtype_bytes                 # k/v projections' bytes per unit of K
        weights = (m.weight_bytes - kv_proj * m.kv_dim) / self.tp + kv_proj * self.kv_dim_per_rank(m)
        if weights >= budget:
            raise ValueError(f"{m.name}'s weights ({weights / 1e9:.1f} GB per device) do not fit {self.hw.name}'s "
                             f"{self.hw.mem_capacity / 1e9:.0f} GB x gpu_memory_utilization {gpu_memory_utilization} "
                             f"= {budget / 1e9:.1f} GB; choose a larger profile, tensor parallelism ('2x{self.hw.name}"
                             f":{m.name}'), a higher gpu_memory_utilization or a smaller model")
        per_token = kv_bytes_per_token(m, kv_cache_dtype, scale_granularity)
        return int((budget - weights) // (block_size * per_token * self.kv_dim_per_rank(m) / m.kv_dim))

    def kv_dim_per_rank(self, m: ModelProfile) -> float:
        """K/V width a rank holds: max(1, n_kv / tp) heads x d. Past n_kv ranks every rank still holds (and
        reads, and writes) one whole K/V head, replicated on tp / n_kv ranks: those bytes are not split."""
        return max(1.0, m.n_kv_heads / self.tp) * m.head_dim

    def kv_bytes_per_rank_token(self, m: ModelProfile) -> float:
        """Bytes of one token's K and V in one layer, on one rank: 2 x Kr x the element size for "auto", one byte a
        value plus the scales for a quantized target cache (``kv_bytes_per_token``)."""
        dtype = self.kv_cache_dtype if m is self.model else "auto"
        return kv_bytes_per_token(m, dtype, self.scale_granularity) / m.n_layer * self.kv_dim_per_rank(m) / m.kv_dim

    # -- operators ------------------------------------------------------------------------------------------
    def forward_ops(self, m: ModelProfile, rows, layers: int | None = None, head: bool = True,
                    prefix: str = "") -> list:
        """The operators of one forward of model m over rows [(q, context after, logits rows)]."""
        tp, w = self.tp, m.dtype_bytes
        L = m.n_layer if layers is None else layers
        T = sum(q for q, _, _ in rows)
        H, Q, Kr, I = m.hidden, m.q_dim, self.kv_dim_per_rank(m), m.intermediate     # Kr: K/V width a rank
        mw = (3 if m.gated_mlp else 2) * H * I
        qkv = Q / tp + 2 * Kr                                                          # q, k, v outputs a rank
        kv = self.kv_bytes_per_rank_token(m)            # a token's K and V as the cache stores them (2 Kr w: auto)
        per_layer = [
            Op("qkv", 2 * T * H * qkv, w * (H * qkv + T * (H + qkv)), 2),
            Op("attention", sum(4 * q * c * Q for q, c, _ in rows) / tp,
               kv * (sum(c for _, c, _ in rows) + T) + w * 2 * T * Q / tp, 2),
            Op("o_proj", 2 * T * Q * H / tp, w * (Q * H / tp + T * (Q / tp + H)), 2),
            Op("mlp", 2 * T * mw / tp, w * (mw / tp + T * (2 * H + 2 * I / tp)), 4)]
        if tp > 1:
            per_layer.append(Op("tp_allreduce", 0.0, 2 * 2 * (tp - 1) / tp * T * H * w, 2, link=True))
        ops = [Op(prefix + o.name, o.flops * L, o.bytes * L, o.kernels * L, o.link) for o in per_layer]
        N = sum(n for _, _, n in rows)
        if head and N:
            ops.append(Op(prefix + "lm_head", 2 * N * H * m.vocab / tp, w * H * m.vocab / tp + 4 * N * m.vocab,
                          KERNELS_HEAD))
        return ops

    def target_rows(self, trace) -> list:
        rows = []
        for s in trace.scheduled:
            c = s.num_computed_before + s.num_tokens
            rows.append((s.num_tokens, c, s.num_tokens if s.phase == "decode" else int(bool(s.new_token_ids))))
        if trace.num_padding_slots and rows:           # static batching: finished members compute a token each
            c = round(sum(c for _, c, _ in rows) / len(rows))
            rows += [(1, c, 1)] * trace.num_padding_slots
        return rows

    def propose_ops(self, trace) -> list:
        """What the proposer ran after this step (``trace.drafted``), costed by method (see the docstring)."""
        drafted, method = getattr(trace, "drafted", None) or [], trace.speculative_method
        if not drafted or method in (None, "ngram"):
            return []
        m, H = self.model, self.model.hidden
        depth = max(d for _, d, _ in drafted)
        if method == "medusa":                          # one pass of `depth` heads, each a ResBlock + a head
            n = len(drafted)
            return [Op("medusa_heads", depth * 2 * n * (H * H + H * m.vocab) / self.tp,
                       depth * m.dtype_bytes * (H * H + H * m.vocab) / self.tp, 3 * depth)]
        ops = []
        for j in range(depth):
            rows = [(math.ceil(n / d), c + j, math.ceil(n / d)) for n, d, c in drafted if d > j]
            if method == "draft":
                ops += self.forward_ops(self.draft or m, rows, prefix="draft.")
            elif method == "eagle":                     # fc [2H -> H], one decoder layer, the target's head
                T = sum(q for q, _, _ in rows)
                ops.append(Op("eagle.fc", 2 * T * 2 * H * H / self.tp, m.dtype_bytes * 2 * H * H / self.tp))
                ops += self.forward_ops(m, rows, layers=1, prefix="eagle.")
            elif method == "early_exit":                # the first E/L of the target's layers + the head
                ops += self.forward_ops(m, rows, layers=self._exit_layers(), prefix="exit.")
            else:
                raise ValueError(f"no cost for speculative method {method!r}")
        return ops

    def _exit_layers(self) -> int:
        """Early exit's shallow passes: the shipped exit layer E of the shipped target's L, scaled to this model."""
        e = json.loads((CHECKPOINTS / "early_exit.json").read_text())["config"]["exit_layer"]
        n = json.loads((CHECKPOINTS / "target.json").read_text())["config"]["n_layer"]
        return max(1, round(self.model.n_layer * e / n))

    # -- time -----------------------------------------------------------------------------------------------
    def op_time(self, op: Op) -> tuple[float, float]:
        """(compute seconds, memory or link seconds) of one operator; its time is the larger."""
        bw = self.hw.interconnect_bandwidth if op.link else self.hw.mem_bandwidth
        return op.flops / self.hw.flops(self.model.dtype), op.bytes / bw

    def breakdown(self, trace) -> list:
        """One dict per operator: FLOPs, bytes, both times, the time it takes and which term bound it."""
        out = []
        for op in self.forward_ops(self.model, self.target_rows(trace)) + self.propose_ops(trace):
            tc, tm = self.op_time(op)
            out.append({"op": op.name, "flops": op.flops, "bytes": op.bytes, "compute_s": tc, "memory_s": tm,
                        "time_s": max(tc, tm), "bound": "compute" if tc > tm else ("link" if op.link else "memory"),
                        "intensity": op.flops / op.bytes if op.bytes else math.inf})
        return out

    def target_overhead(self, trace) -> float:
        """The target forward's launches (per kernel, or one graph replay for a uniform decode step) + the
        host's time per step, per row and per token."""
        hw, rows = self.hw, self.target_rows(trace)
        # vLLM V1 replays a graph for a uniform decode batch: every row a decode of the same length (1, or 1 + k)
        uniform = (trace.scheduled and all(s.phase == "decode" for s in trace.scheduled)
                   and len({s.num_tokens for s in trace.scheduled}) == 1 and not trace.num_padding_slots)
        if hw.cuda_graphs and uniform:
            t = hw.graph_overhead
        else:
            t = hw.launch_overhead * sum(o.kernels for o in self.forward_ops(self.model, rows))
        return t + hw.step_overhead + hw.row_overhead * len(rows) + hw.token_overhead * sum(q for q, _, _ in rows)

    def _draft_tokens(self, trace) -> int:
        """Tokens the proposer fed: one per draft over its passes (Medusa: one row per sequence, one pass)."""
        if trace.speculative_method in (None, "ngram"):
            return 0
        return len(trace.drafted) if trace.speculative_method == "medusa" else sum(n for n, _, _ in trace.drafted)

    def propose_time(self, trace) -> float:
        """The proposer's share of ``step_time``: its operators, its launches (a graph replay per pass with
        graphs on) and its tokens' host time (0 without drafts)."""
        ops = self.propose_ops(trace)
        if not ops:
            return 0.0
        hw, depth = self.hw, max(d for _, d, _ in trace.drafted)
        passes = 1 if trace.speculative_method == "medusa" else depth
        launches = passes * hw.graph_overhead if hw.cuda_graphs else hw.launch_overhead * sum(o.kernels for o in ops)
        return sum(max(self.op_time(o)) for o in ops) + launches + hw.token_overhead * self._draft_tokens(trace)

    def device_time(self, trace) -> float:
        """Seconds on the device: the operators' roofline times plus the overheads, plus the memory hierarchy's
        copies, which run before the forward (engine/memory_hierarchy.py)."""
        if not trace.scheduled:
            return self.transfer_time(trace)
        target = sum(max(self.op_time(o)) for o in self.forward_ops(self.model, self.target_rows(trace)))
        return target + self.target_overhead(trace) + self.propose_time(trace) + self.transfer_time(trace)

    def cpu_time(self, trace) -> float:
        """Seconds of the host CPU's work in the step (perf/host.py; 0 without ``host``)."""
        return self.host.step_time(len(trace.scheduled)) if self.host else 0.0

    def step_time(self, trace) -> float:
        """Seconds the step would take: the device's time and the host CPU's, in series (synchronous
        scheduling), or overlapped, max(cpu, device), when the trace says the step was scheduled
        asynchronously (``StepTrace.async_scheduling``), except the first step, whose schedule nothing hid."""
        device, cpu = self.device_time(trace), self.cpu_time(trace)
        if getattr(trace, "async_scheduling", False) and trace.step > 0:
            return max(cpu, device)
        return cpu + device

    def transfer_time(self, trace, per_block: bool = False) -> float:
        """The step's host <-> device copies (swap out/in, offload, load-back) over PCIe: each direction's bytes at
        ``host_bandwidth``, plus ``host_latency`` per transfer. The simulated model's blocks are priced, not the
        tiny model's: a block is ``block_size`` tokens of its KV (``kv_bytes_per_token``, per device under TP).
        minibatch copies each direction as one batched copy per layer (vLLM's ``swap_blocks`` per layer);
        ``per_block=True`` prices vLLM V0's CUDA loop instead, one transfer per block per layer for K and for V,
        whose per-transfer latency is what makes swapping slow at small blocks (PagedAttention §7.3, Fig. 19)."""
        hw, m = self.hw, self.model
        if not hw.host_bandwidth:
            return 0.0
        per = trace.block_size * self.kv_bytes_per_rank_token(m) * m.n_layer
        t = 0.0
        for blocks in (getattr(trace, "blocks_to_host", 0), getattr(trace, "blocks_to_device", 0)):
            if blocks:
                transfers = 2 * m.n_layer * blocks if per_block else m.n_layer
                t += transfers * hw.host_latency + blocks * per / hw.host_bandwidth
        return t
