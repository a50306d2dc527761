"""Hardware profiles: the few numbers a roofline needs, each with the datasheet it comes from.

A roofline (Williams, Waterman and Patterson, CACM 2009) times an operator as the slower of two
limits: its arithmetic at the chip's peak, and its memory traffic at the chip's bandwidth. So a
profile holds

* ``peak_flops``: dense (no structured sparsity) peak FLOP/s by dtype, {"fp32": ..., "bf16": ...};
* ``mem_bandwidth``: bytes/s to device memory (HBM, GDDR, or a laptop's unified memory);
* ``mem_capacity``: bytes of device memory;
* ``launch_overhead``: seconds per kernel launched eagerly, and ``graph_overhead``: seconds per
  CUDA-graph replay (one launch for a whole decode step; vLLM captures graphs for pure-decode batches);
* ``interconnect_bandwidth``: bytes/s per direction between two devices for tensor parallelism (0: none);
* ``host_bandwidth``: bytes/s per direction between host memory and the device (PCIe), and ``host_latency``:
  seconds per transfer over it: what swapping and the host tier's loads cost (0: not modelled);
* ``sources``: where each number comes from. Datasheet figures are quoted as printed; the launch
  overheads are not on any datasheet and say "estimate" with their basis.

Decimal units throughout (1 TB/s = 1e12 B/s, 80 GB = 80e9 B), as the datasheets print them.
A profile of *this* machine is measured by ``python -m minibatch.bench calibrate`` (``calibrate.py``) and
read back with ``load_profile``.
"""
from __future__ import annotations

import json
import math
import pathlib
from dataclasses import asdict, dataclass, field

T, G = 1e12, 1e9
DTYPES = ("fp32", "bf16", "fp16")

_HOST_LATENCY = ("estimate: ~10 us per host <-> device cudaMemcpyAsync (driver call and PCIe round trip; NVIDIA "
                 "CUDA C++ Best Practices Guide, 'Data Transfer Between Host and Device': small transfers are "
                 "dominated by per-transfer overhead, so batch them)")
_LAUNCH = ("estimate: ~4 us per eager CUDA kernel launch incl. PyTorch dispatch, ~10 us per graph replay "
           "(NVIDIA technical blog 'Getting Started with CUDA Graphs', 2019: launch overheads of a few us per kernel)")


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_flops: dict                # dtype -> dense FLOP/s
    mem_bandwidth: float            # B/s
    mem_capacity: float             # B
    launch_overhead: float          # s per eager kernel
    graph_overhead: float = 0.0     # s per graph replay (a pure-decode step with graphs on)
    cuda_graphs: bool = False       # replay pure-decode steps as one graph (vLLM's default on CUDA)
    interconnect_bandwidth: float = 0.0     # B/s per direction, tensor parallelism; 0: a single device
    step_overhead: float = 0.0      # s per engine step outside the kernels (scheduling, Python): measured on
                                    # this machine by calibrate; 0 on the datasheet profiles (not modelled)
    row_overhead: float = 0.0       # s per scheduled sequence per step outside the kernels (as above)
    token_overhead: float = 0.0     # s per token fed, beyond the roofline (as above: elementwise work on a CPU)
    host_bandwidth: float = 0.0     # B/s per direction host <-> device (swap, offload, load-back); 0: not modelled
    host_latency: float = 0.0       # s per host <-> device transfer (one cudaMemcpyAsync), whatever its size
    sources: dict = field(default_factory=dict)

    def __post_init__(self):
        bad = [d for d in self.peak_flops if d not in DTYPES]
        if bad or not self.peak_flops:
            raise ValueError(f"{self.name}: peak_flops needs dtypes from {list(DTYPES)}, got {list(self.peak_flops)}")
        for k in ("mem_bandwidth", "mem_capacity"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{self.name}: {k} must be a positive number, got {v!r}")
        for k in ("launch_overhead", "graph_overhead", "interconnect_bandwidth", "step_overhead", "row_overhead",
                  "token_overhead", "host_bandwidth", "host_latency"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{self.name}: {k} must be a number >= 0, got {v!r}")
        if any(not (isinstance(v, (int, float)) and v > 0) for v in self.peak_flops.values()):
            raise ValueError(f"{self.name}: every peak_flops value must be > 0, got {self.peak_flops}")

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for dtype; fp16 and bf16 stand in for each other (same tensor-core rate on these parts)."""
        p = self.peak_flops
        alt = {"bf16": "fp16", "fp16": "bf16"}.get(dtype)
        if dtype in p:
            return p[dtype]
        if alt in p:
            return p[alt]
        return p["fp32"] if "fp32" in p else max(p.values())

    def ridge(self, dtype: str) -> float:
        """The ridge point, FLOPs per byte: below it an operator is memory-bound, above it compute-bound."""
        return self.flops(dtype) / self.mem_bandwidth

    def to_dict(self) -> dict:
        return asdict(self)


PROFILES = {
    "h100": HardwareProfile(
        "h100", {"bf16": 989.4 * T, "fp16": 989.4 * T, "fp32": 67 * T}, 3.35 * T, 80 * G, 4e-6, 10e-6, True,
        450 * G,
        host_bandwidth=64 * G, host_latency=10e-6,
        sources={"peak_flops": "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16 Tensor Core 1,979 TFLOPS "
                               "with sparsity (989.4 dense), FP32 67 TFLOPS",
                 "mem_bandwidth": "same datasheet, H100 SXM: GPU memory bandwidth 3.35 TB/s",
                 "mem_capacity": "same datasheet, H100 SXM: 80 GB HBM3",
                 "interconnect_bandwidth": "same datasheet: NVLink 900 GB/s (bidirectional; 450 GB/s each way)",
                 "host_bandwidth": "same datasheet: PCIe Gen5 128 GB/s (bidirectional; 64 GB/s each way)",
                 "host_latency": _HOST_LATENCY,
                 "launch_overhead": _LAUNCH}),
    "h200": HardwareProfile(
        "h200", {"bf16": 989.4 * T, "fp16": 989.4 * T, "fp32": 67 * T}, 4.8 * T, 141 * G, 4e-6, 10e-6, True,
        450 * G,
        host_bandwidth=64 * G, host_latency=10e-6,
        sources={"peak_flops": "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: BF16 Tensor Core 1,979 TFLOPS "
                               "with sparsity (989.4 dense), FP32 67 TFLOPS",
                 "mem_bandwidth": "same datasheet: GPU memory bandwidth 4.8 TB/s",
                 "mem_capacity": "same datasheet: 141 GB HBM3e",
                 "interconnect_bandwidth": "same datasheet: NVLink 900 GB/s (bidirectional; 450 GB/s each way)",
                 "host_bandwidth": "same datasheet: PCIe Gen5 128 GB/s (bidirectional; 64 GB/s each way)",
                 "host_latency": _HOST_LATENCY,
                 "launch_overhead": _LAUNCH}),
    "a100": HardwareProfile(
        "a100", {"bf16": 312 * T, "fp16": 312 * T, "fp32": 19.5 * T}, 2.039 * T, 80 * G, 4e-6, 10e-6, True,
        300 * G,
        host_bandwidth=32 * G, host_latency=10e-6,
        sources={"peak_flops": "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: BF16 Tensor Core 312 TFLOPS "
                               "(624 with sparsity), FP32 19.5 TFLOPS",
                 "mem_bandwidth": "same datasheet, A100 80GB SXM: GPU memory bandwidth 2,039 GB/s",
                 "mem_capacity": "same datasheet: 80 GB HBM2e",
                 "interconnect_bandwidth": "same datasheet: NVLink 600 GB/s (bidirectional; 300 GB/s each way)",
                 "host_bandwidth": "same datasheet: PCIe Gen4 64 GB/s (bidirectional; 32 GB/s each way)",
                 "host_latency": _HOST_LATENCY,
                 "launch_overhead": _LAUNCH}),
    "l4": HardwareProfile(
        "l4", {"bf16": 121 * T, "fp16": 121 * T, "fp32": 30.3 * T}, 300 * G, 24 * G, 4e-6, 10e-6, True,
        32 * G,
        host_bandwidth=32 * G, host_latency=10e-6,
        sources={"peak_flops": "NVIDIA L4 Tensor Core GPU datasheet: BF16/FP16 Tensor Core 242 TFLOPS with "
                               "sparsity (121 dense), FP32 30.3 TFLOPS",
                 "mem_bandwidth": "same datasheet: GPU memory bandwidth 300 GB/s",
                 "mem_capacity": "same datasheet: 24 GB GDDR6",
                 "interconnect_bandwidth": "same datasheet: PCIe Gen4 x16 64 GB/s (bidirectional; 32 GB/s each "
                                           "way), no NVLink",
                 "host_bandwidth": "same datasheet: PCIe Gen4 x16 64 GB/s (bidirectional; 32 GB/s each way)",
                 "host_latency": _HOST_LATENCY,
                 "launch_overhead": _LAUNCH}),
    "rtx4090": HardwareProfile(
        "rtx4090", {"bf16": 165.2 * T, "fp16": 165.2 * T, "fp32": 82.6 * T}, 1008 * G, 24 * G, 4e-6, 10e-6, True,
        32 * G,
        host_bandwidth=32 * G, host_latency=10e-6,
        sources={"peak_flops": "NVIDIA Ada GPU architecture whitepaper (v2.1), Appendix A, GeForce RTX 4090: peak "
                               "FP16/BF16 Tensor TFLOPS with FP32 accumulate 165.2 (330.3 with sparsity), peak FP32 "
                               "82.6 TFLOPS",
                 "mem_bandwidth": "same table: memory bandwidth 1008 GB/s",
                 "mem_capacity": "same table: 24 GB GDDR6X",
                 "interconnect_bandwidth": "PCIe 4.0 x16, 64 GB/s bidirectional (32 GB/s each way); no NVLink",
                 "host_bandwidth": "PCIe 4.0 x16, 64 GB/s bidirectional (32 GB/s each way)",
                 "host_latency": _HOST_LATENCY,
                 "launch_overhead": _LAUNCH}),
    "m1-max": HardwareProfile(
        "m1-max", {"fp32": 10.4 * T, "fp16": 10.4 * T}, 400 * G, 64 * G, 8e-6, 0.0, False, 0.0,
        host_bandwidth=400 * G, host_latency=1e-6,
        sources={"peak_flops": "Apple newsroom, 'Introducing M1 Pro and M1 Max' (Oct 18, 2021): M1 Max GPU "
                               "(32 cores) 10.4 teraflops (FP32; FP16 runs at the same rate on this GPU)",
                 "mem_bandwidth": "same release: up to 400 GB/s memory bandwidth",
                 "mem_capacity": "same release: up to 64 GB unified memory",
                 "interconnect_bandwidth": "a single laptop chip: no tensor parallelism",
                 "host_bandwidth": "unified memory: the host tier is the same DRAM (the memory bandwidth above)",
                 "host_latency": "estimate: ~1 us, a copy within unified memory (no PCIe)",
                 "launch_overhead": "estimate: ~8 us per Metal (MPS) command through PyTorch; no graph replay"}),
}


def load_profile(path) -> HardwareProfile:
    """A profile written by ``python -m minibatch.bench calibrate --out FILE``; a clear error if it is not one."""
    p = pathlib.Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"no calibration file {str(p)!r} (write one with: python -m minibatch.bench calibrate "
                         f"--out {p})") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: not a calibration file (JSON expected): {e}") from None
    if not isinstance(data, dict) or data.get("format") != "minibatch-hardware/1":
        raise ValueError(f"{p}: not a minibatch hardware profile (format 'minibatch-hardware/1' expected)")
    fields = set(HardwareProfile.__dataclass_fields__)
    prof = data.get("profile")
    if not isinstance(prof, dict):
        raise ValueError(f"{p}: the calibration file has no 'profile' object")
    missing = {"name", "peak_flops", "mem_bandwidth", "mem_capacity", "launch_overhead"} - set(prof)
    unknown = set(prof) - fields
    if missing or unknown:
        raise ValueError(f"{p}: profile fields missing {sorted(missing)} / unknown {sorted(unknown)}; "
                         f"expected {sorted(fields)}")
    if not isinstance(prof["peak_flops"], dict):
        raise ValueError(f"{p}: peak_flops must be an object dtype -> FLOP/s")
    return HardwareProfile(**prof)


def save_profile(profile: HardwareProfile, path, meta: dict | None = None) -> None:
    data = {"format": "minibatch-hardware/1", "meta": dict(meta or {}), "profile": profile.to_dict()}
    pathlib.Path(path).write_text(json.dumps(data, indent=1))


def get_hardware(name: str) -> HardwareProfile:
    """A named profile, or a calibration file (a path ending in .json)."""
    if name.endswith(".json"):
        return load_profile(name)
    if name not in PROFILES:
        raise ValueError(f"unknown hardware profile {name!r}; choose one of {sorted(PROFILES)} or a calibration "
                         f"file (.json, from python -m minibatch.bench calibrate)")
    return PROFILES[name]
