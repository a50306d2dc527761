"""Everything a lecture varies, in one place, checked once when it is made."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

from minibatch.engine.cuda_graphs import MODES
from minibatch.engine.memory_hierarchy import PREEMPTION_MODES, WRITE_POLICIES
from minibatch.engine.request_queue import POLICIES, check_cache_aware
from minibatch.engine.scheduler import ORDERS
from minibatch.kv import quant
from minibatch.kv.attention import check_backend
from minibatch.kv.backends import QUANTIZED_BACKENDS
from minibatch.kv.radix_allocator import PREFIX_CACHES
from minibatch.spec_decode.config import check_speculative_config
from minibatch.engine.threads import check_num_threads

SCHEDULINGS = ("continuous", "static")


def _int(name: str, value, lo: int) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


@dataclass
class EngineConfig:
    block_size: int = 16
    num_gpu_blocks: Optional[int] = None       # None: room for max_num_seqs full contexts
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512          # the token budget of one step
    enable_prefix_caching: bool = True
    attention_backend: Optional[str] = None    # "loop" (the teaching version), "batched", "triton", "cpu";
                                               # None: the engine picks ("cpu" on a CPU, "batched" on a GPU)
    scheduling: str = "continuous"             # or "static"
    policy: str = "fcfs"                       # or "priority", or SGLang's cache-aware "lpm", "dfs-weight"
    scheduling_policy: Optional[str] = None    # vLLM's name for policy: given, it sets policy (read policy)
    cache_aware_max_waiting: int = 128         # lpm / dfs-weight: above this many waiting requests, FCFS (SGLang's)
    prefix_cache: str = "hash"                 # with enable_prefix_caching: vLLM's hash chain, or SGLang's "radix" tree
    order: str = "decode-first"                # or "prefill-first"
    speculative_config: Optional[dict] = None  # {"method": "draft" | "ngram", "num_speculative_tokens": k}
    seed: int = 0                              # the generator of requests without a seed
    simulate: Optional[str] = None             # "h100:llama-3-8b": also time every step on that hardware and model,
                                               # a simulated clock (minibatch/perf); the KV pool gets its budget
    gpu_memory_utilization: float = 0.9        # simulate: the share of device memory for weights + KV (vLLM's name)
    tensor_parallel_size: int = 1              # ranks the model's heads split over (minibatch/distributed/)
    disaggregated: bool = False                # a prefill instance and a decode instance behind a router
    # CUDA graphs for pure-decode steps (engine/cuda_graphs.py), vLLM's switch and names. On CUDA they are on
    # unless enforce_eager=True; on the CPU there is nothing to capture. cuda_graph_mode="eager-replay" runs
    # the graphs' padded fixed buffers eagerly (any device: how CI checks the graph path); "compile" (CPU, the
    # "cpu" attention backend) torch.compiles that padded forward once per size at start-up; cuda_graph_sizes
    # None = 1, 2, 4, 8, 16, 32, ... up to max_num_seqs.
    enforce_eager: bool = False
    cuda_graph_mode: str = "auto"              # or "eager-replay", "compile"
    cuda_graph_sizes: Optional[list] = None
    num_threads: Optional[int] = None          # CPU threads; None: from the model's size (engine/threads.py)
    # The KV cache's host tier (engine/memory_hierarchy.py, kv/host_pool.py), vLLM's names. preemption_mode "swap"
    # keeps a preempted request's blocks in a host swap space of swap_space GiB (None: as many blocks as the device
    # pool, all the paper's admission rule can ever need); kv_offload_space GiB > 0 gives the prefix cache a host
    # tier (vLLM V1's CPU offloading), written through as blocks fill or back when the device evicts them.
    preemption_mode: str = "recompute"         # or "swap"
    swap_space: Optional[float] = None         # GiB (2**30 bytes), as vLLM V0's --swap-space
    kv_offload_space: float = 0.0              # GiB; 0: no host tier
    kv_offload_write_policy: str = "write_through"   # or "write_back" (SGLang HiCache's names)
    # Schedule step N+1 while step N's forward runs (engine/async_scheduler.py; vLLM's --async-scheduling)
    async_scheduling: bool = False
    # Quantized KV blocks (kv/quant.py), vLLM's names: "auto" (the model's dtype), "fp8_e4m3" (or "fp8"),
    # "fp8_e5m2", "int8"; scales per tensor (1.0, or calculate_kv_scales: from the first batch) or per (token, head)
    kv_cache_dtype: str = "auto"
    scale_granularity: str = "per_tensor"
    calculate_kv_scales: bool = False

    def __post_init__(self):
        _int("block_size", self.block_size, 1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_gpu_blocks is not None:
            _int("num_gpu_blocks", self.num_gpu_blocks, 1)
        _int("max_num_seqs", self.max_num_seqs, 1)
        _int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than one block "
                             f"({self.block_size} tokens)")
        check_backend(self.attention_backend)
        if self.scheduling_policy is not None:     # an alias, folded into policy once (so replace() stays right)
            if self.policy not in ("fcfs", self.scheduling_policy):
                raise ValueError(f"policy={self.policy!r} and scheduling_policy={self.scheduling_policy!r} disagree: "
                                 f"they are one setting (scheduling_policy is vLLM's name), give one")
            self.policy, self.scheduling_policy = self.scheduling_policy, None
        for name, allowed in (("scheduling", SCHEDULINGS), ("policy", POLICIES), ("order", ORDERS),
                              ("prefix_cache", PREFIX_CACHES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; choose one of {list(allowed)}")
        check_cache_aware(self.policy, self.enable_prefix_caching)
        _int("cache_aware_max_waiting", self.cache_aware_max_waiting, 0)
        if self.speculative_config is not None:
            check_speculative_config(self.speculative_config)
        _int("seed", self.seed, 0)
        if not (isinstance(self.gpu_memory_utilization, numbers.Real) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.simulate is not None:
            self.cost_model()                      # an unknown profile or a malformed string fails here, named
        _int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if not isinstance(self.disaggregated, bool):
            raise TypeError(f"disaggregated must be True or False, got {self.disaggregated!r}")
        method = (self.speculative_config or {}).get("method")
        if self.tensor_parallel_size > 1 and method in ("eagle", "eagle3", "early_exit"):
            raise ValueError(f"speculative method {method!r} drafts inside the target's KV cache (an extra layer or "
                             f"scratch blocks written directly), which a head-split cache does not hold: use "
                             f"'draft', 'ngram' or 'medusa' with tensor_parallel_size > 1")
        self._check_graphs()
        check_num_threads(self.num_threads)
        self._check_hierarchy()
        self._check_async()
        self._check_kv_quant()

    def _check_kv_quant(self) -> None:
        """The quantized cache's settings, once: the name made canonical ("fp8" -> "fp8_e4m3"), the storage dtype
        present in this torch, and what cannot read or carry quantized blocks yet refused, saying why."""
        self.kv_cache_dtype = quant.check_kv_cache_dtype(self.kv_cache_dtype)
        quant.check_scale_granularity(self.scale_granularity)
        if not isinstance(self.calculate_kv_scales, bool):
            raise ValueError(f"calculate_kv_scales must be True or False, got {self.calculate_kv_scales!r}")
        if self.kv_cache_dtype == "auto":
            if self.calculate_kv_scales:
                raise ValueError("calculate_kv_scales needs a quantized kv_cache_dtype; 'auto' has no scale")
            return
        quant.storage_dtype(self.kv_cache_dtype)             # fp8 on a torch without it: named here
        if self.calculate_kv_scales and self.scale_granularity != "per_tensor":
            raise ValueError("calculate_kv_scales calibrates per-tensor scales: it needs "
                             "scale_granularity='per_tensor'")
        if self.attention_backend is not None and self.attention_backend not in QUANTIZED_BACKENDS:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is read by the attention backends "
                             f"{list(QUANTIZED_BACKENDS)} only so far, not {self.attention_backend!r}")

    def _check_async(self) -> None:
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        if not self.async_scheduling:
            return
        conflicts = [(self.scheduling == "static", "scheduling='static' (the static baseline has no placeholders)"),
                     (self.speculative_config is not None, "speculative_config (drafts for step N+1 are proposed "
                      "from step N's tokens, which are not known when step N+1 is scheduled; vLLM 0.32 overlaps "
                      "speculation only where the drafts are made on the device inside the step (EAGLE, "
                      "draft_model, ngram_gpu) and turns async scheduling off for its CPU n-gram; minibatch's "
                      "proposers run on the host after the step: not supported yet)"),
                     (self.tensor_parallel_size > 1, "tensor_parallel_size > 1 (the workers' message loop is one "
                      "step at a time)"),
                     (self.disaggregated, "disaggregated=True (each instance steps alone)")]
        for bad, what in conflicts:
            if bad:
                raise ValueError(f"async_scheduling=True cannot go with {what}")

    def _check_hierarchy(self) -> None:
        for name, allowed in (("preemption_mode", PREEMPTION_MODES), ("kv_offload_write_policy", WRITE_POLICIES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; choose one of {list(allowed)}")
        for name in ("swap_space", "kv_offload_space"):
            v = getattr(self, name)
            if v is None and name == "swap_space":
                continue
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a number of GiB >= 0, got {v!r}")
        if self.preemption_mode == "swap" and self.scheduling == "static":
            raise ValueError("preemption_mode='swap' needs scheduling='continuous': the static baseline never preempts")
        if self.kv_offload_space and not self.enable_prefix_caching:
            raise ValueError("kv_offload_space > 0 is a host tier of the prefix cache: it needs "
                             "enable_prefix_caching=True")
        if self.kv_offload_space and self.disaggregated:
            raise ValueError("kv_offload_space with disaggregated=True: the decode instance writes transferred "
                             "blocks outside the scheduler's step, which the host tier's copies cannot follow; "
                             "use one or the other")

    def host_blocks(self, bytes_per_block: int, num_device_blocks: int) -> tuple:
        """(swap blocks, host-tier blocks) of the host pool; a ValueError when they exceed the host's free memory."""
        gib = 2 ** 30
        swap = 0
        if self.preemption_mode == "swap":
            swap = num_device_blocks if self.swap_space is None else int(self.swap_space * gib) // bytes_per_block
        offload = int(self.kv_offload_space * gib) // bytes_per_block
        if self.kv_offload_space and offload < 1:
            raise ValueError(f"kv_offload_space={self.kv_offload_space} GiB holds no block ({bytes_per_block} bytes)")
        free = available_memory()
        if free is not None and (swap + offload) * bytes_per_block > free:
            raise ValueError(f"swap_space and kv_offload_space ask for {(swap + offload) * bytes_per_block / gib:.2f} "
                             f"GiB of host memory; this machine has {free / gib:.2f} GiB free")
        return swap, offload


    def cost_model(self):
        """The simulated clock's CostModel (minibatch/perf/cost.py), or None without ``simulate``."""
        if self.simulate is None:
            return None
        from minibatch.perf.cost import CostModel
        return CostModel.from_spec(self.simulate, self.kv_cache_dtype, self.scale_granularity)

    def _check_graphs(self) -> None:
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        if self.cuda_graph_mode not in MODES:
            raise ValueError(f"unknown cuda_graph_mode {self.cuda_graph_mode!r}; choose one of {list(MODES)}")
        if self.enforce_eager and self.cuda_graph_mode != "auto":
            raise ValueError(f"enforce_eager=True turns CUDA graphs off: it cannot go with "
                             f"cuda_graph_mode={self.cuda_graph_mode!r}")
        if self.cuda_graph_sizes is not None:
            if not isinstance(self.cuda_graph_sizes, (list, tuple)) or not self.cuda_graph_sizes:
                raise ValueError(f"cuda_graph_sizes must be a non-empty list of batch sizes, got "
                                 f"{self.cuda_graph_sizes!r}")
            for b in self.cuda_graph_sizes:
                _int("each of cuda_graph_sizes", b, 1)
                if b > self.max_num_seqs:
                    raise ValueError(f"cuda_graph_sizes holds {b}, over max_num_seqs={self.max_num_seqs}: "
                                     f"no decode batch is ever that large")

    def num_blocks_for(self, n_ctx: int) -> int:
        """The pool's size: num_gpu_blocks, or enough for max_num_seqs sequences at full context."""
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks
        if self.simulate is not None:              # the simulated model's budget (vLLM's formula, perf/cost.py),
            # allocated only up to what max_num_seqs full contexts can hold: blocks past that could only keep
            # freed prefixes cached, and would cost this machine gigabytes for a GPU-sized pool
            budget = self.cost_model().num_gpu_blocks(self.block_size, self.gpu_memory_utilization,
                                                      self.kv_cache_dtype, self.scale_granularity)
            return min(budget, self.max_num_seqs * -(-n_ctx // self.block_size))
        return self.max_num_seqs * -(-n_ctx // self.block_size)


def available_memory():
    """Bytes of host memory free now (Linux: MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
