"""Tensor parallelism's driver/worker split: what crosses to the workers each step, and how.

The driver (rank 0, the process that built the ``LLM``) runs the whole engine as usual: scheduler, block
allocator, block tables, sampling, speculation. Only the model and the KV cache are split (``tp_model.py``):
rank r holds heads r·H/W .. and a KV cache of their K/V heads (the Llama's max(1, Hkv/W), replicated past
Hkv ranks), **with the same blocks**, so one block table serves every rank. The workers (ranks 1 .. W-1,
one process each) hold no engine at all; each loops:

    receive one message from the driver  ->  do what it says on its own shard  ->  (all-reduces inside)

The driver sends a message for every call that touches the model or the cache, as ``TPModel`` and
``TPKVCache`` stand in for the ``GPT`` and the ``KVCache`` the engine would otherwise hold:

    "forward":     input_ids [T], positions [T], the step's AttentionMetadata (slot mapping, block tables,
                   seq_lens, query_start_loc, tree bits; the host-side lists), the backend, and the forward's
                   options (logits rows, hidden states, exit / start layer and its hidden state [T, C])
    "allocate_host" / "swap_out" / "swap_in": the host pool's tensor and its copies;
    "copy_blocks": copy-on-write pairs;   "copy_slots": a tree's accepted path moved to consecutive slots
    "shutdown"

**How**: one ``broadcast_object_list`` from rank 0 per message (the message pickled into a byte tensor): a few
kilobytes per decode step, about the size of the metadata, sent over gloo's TCP on a CPU (NCCL on GPUs).
nano-vllm instead writes the pickle into shared memory and signals an event, which saves the
collective's latency but works on one host only; a broadcast works across hosts under torchrun and has
the group's timeout, so a dead rank is an error, not a hang. The logits come from the driver's own
shard: after the last all-reduce every rank holds the same residual stream and the same (replicated)
LM head, so nothing needs to come back.

Not split: a draft model (the shipped one has 3 heads, which 2 ranks cannot share) runs whole on the driver,
with its own cache, as does n-gram lookup and Medusa's heads (they read the replicated hidden states).
EAGLE and early exit draft *inside* the target's cache (an extra layer; scratch blocks written directly),
which a head-split cache cannot hold as it is: they are refused under tensor parallelism, with that reason.
CUDA graphs are off under tensor parallelism (a broadcast of Python objects cannot be captured).
"""
from __future__ import annotations

import dataclasses
import traceback

import torch
import torch.distributed as dist

from minibatch.distributed import comm
from minibatch.distributed.tp_model import check_tp_size, shard_model, tp_head_layout
from minibatch.kv.attention import AttentionMetadata, PagedAttention
from minibatch.kv.kv_cache import KVCache
from minibatch.model.model import GPT, DenseAttention
from minibatch.model.registry import build, config_from_dict, config_to_dict

UNSPLITTABLE_METHODS = ("eagle", "eagle3", "early_exit")


class WorkerDied(RuntimeError):
    """A tensor-parallel worker stopped: the engine cannot go on with a slice of the model missing."""


# -- what one message holds -------------------------------------------------------------------------------------
def _to(obj, device):
    """Tensors inside lists/tuples/dicts moved to ``device`` (CPU to pickle them; the rank's device to use them)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def pack_attention(attn) -> tuple:
    """The attention object a forward was given, as plain data a worker can rebuild it from."""
    if isinstance(attn, PagedAttention):
        fields = {f.name: getattr(attn.metadata, f.name) for f in dataclasses.fields(attn.metadata) if f.name != "plan"}
        return ("paged", _to(fields, "cpu"), attn.backend)
    if isinstance(attn, DenseAttention):
        return ("dense", attn.query_start_loc.cpu())
    raise TypeError(f"tensor parallelism cannot send an attention of type {type(attn).__name__} to its workers; "
                    f"it knows PagedAttention and DenseAttention")


def unpack_attention(packed, kv_cache: KVCache, device):
    if packed[0] == "dense":
        a = DenseAttention([])
        a.query_start_loc = packed[1]
        return a
    _, fields, backend = packed
    return PagedAttention(kv_cache, AttentionMetadata(**_to(fields, device)), backend)


# -- the driver's stand-ins ----------------------------------------------------------------------------------------
class TPGroup:
    """The driver's handle on its workers: sends each message, and names the rank when one has died."""

    def __init__(self, procs, world: int):
        self.procs, self.world, self.closed = procs, world, False

    def send(self, msg) -> None:
        try:
            dist.broadcast_object_list([msg], src=0)
        except Exception as e:                       # a dead peer: gloo's socket closes, or the timeout fires
            raise self._died(e) from e

    def run(self, fn, *args, **kw):
        """``fn`` on the driver's own shard (its collectives meet the workers'), with the same error naming."""
        try:
            return fn(*args, **kw)
        except RuntimeError as e:
            if isinstance(e, WorkerDied) or not self._dead():
                raise
            raise self._died(e) from e

    def _dead(self) -> list:
        return [(r, p.exitcode) for r, p in enumerate(self.procs, start=1) if not p.is_alive()]

    def _died(self, cause) -> WorkerDied:
        for p in self.procs:
            p.join(timeout=1.0)
        dead = self._dead()
        who = ", ".join(f"rank {r} (exit code {c})" for r, c in dead) or "a rank that stopped answering"
        self.close(graceful=False)
        return WorkerDied(f"tensor-parallel worker {who} died mid-step; the engine stopped: {cause}")

    def close(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful:
            try:
                dist.broadcast_object_list([("shutdown",)], src=0)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
        comm.shutdown()


class TPModel(torch.nn.Module):
    """Stands in for the ``GPT`` on the driver: each call is sent to the workers, then run on rank 0's shard.
    Attributes (config, wte, ln_f, h, device, dtype, ...) are the shard's, so proposers read it as a GPT."""

    def __init__(self, shard: GPT, group: TPGroup, num_params: int):
        super().__init__()
        self.shard, self.group, self._num_params = shard, group, num_params

    def num_params(self) -> int:
        """The whole model's parameters (rank 0 holds about 1 / W of the blocks' share)."""
        return self._num_params

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.shard, name)

    @property
    def device(self):
        return self.shard.device

    @property
    def dtype(self):
        return self.shard.dtype

    def forward(self, input_ids, positions, attn, **kw):
        self.group.send(("forward", input_ids.cpu(), positions.cpu(), pack_attention(attn), _to(kw, "cpu")))
        return self.group.run(self.shard, input_ids, positions, attn, **kw)


class TPKVCache(KVCache):
    """Rank 0's cache (its heads only); the cache operations the engine asks for reach every rank."""

    group: TPGroup = None

    def copy_blocks(self, pairs) -> None:
        pairs = [tuple(p) for p in pairs]
        if pairs:
            self.group.send(("copy_blocks", pairs))
        super().copy_blocks(pairs)

    def copy_slots(self, src, dst, num_layers=None) -> None:
        self.group.send(("copy_slots", src.cpu(), dst.cpu(), num_layers))
        super().copy_slots(src, dst, num_layers)

    # The memory hierarchy: every rank keeps its heads' share of each host block (the host block ids are rank 0's
    # scheduler's, the same on every rank, as the device ones are).
    def allocate_host(self, num_host_blocks: int) -> None:
        self.group.send(("allocate_host", num_host_blocks))
        super().allocate_host(num_host_blocks)

    def swap_out(self, pairs) -> None:
        pairs = [tuple(p) for p in pairs]
        if pairs:
            self.group.send(("swap_out", pairs))
        super().swap_out(pairs)

    def swap_in(self, pairs) -> None:
        pairs = [tuple(p) for p in pairs]
        if pairs:
            self.group.send(("swap_in", pairs))
        super().swap_in(pairs)


# -- the worker ---------------------------------------------------------------------------------------------------------
def worker_main(rank: int, world: int, addr: str, port: int, config: dict, state: dict, cache_shape: tuple,
                device: str, timeout_s: float, kv_quant: dict) -> None:
    """Rank ``rank``'s loop: its shard of the model and of the cache, and one message at a time."""
    torch.set_num_threads(1)              # the driver owns the machine's other cores (engine/threads policy)
    comm.init(rank, world, addr, port, device, timeout_s)
    try:
        full = build(config_from_dict(config, "the driver's model"))       # any architecture the registry knows
        full.load_state_dict(state)
        dtype = next(iter(state.values())).dtype
        shard = shard_model(full.to(device=device, dtype=dtype), rank, world).eval()
        cache = _cache(cache_shape, dtype, device, kv_quant)
        with torch.inference_mode():
            while True:
                box = [None]
                dist.broadcast_object_list(box, src=0)
                msg = box[0]
                if msg[0] == "shutdown":
                    break
                if msg[0] == "forward":
                    _, ids, pos, packed, kw = msg
                    shard(ids.to(device), pos.to(device), unpack_attention(packed, cache, device), **_to(kw, device))
                elif msg[0] == "copy_blocks":
                    cache.copy_blocks(msg[1])
                elif msg[0] == "copy_slots":
                    cache.copy_slots(msg[1].to(device), msg[2].to(device), msg[3])
                elif msg[0] in ("allocate_host", "swap_out", "swap_in"):
                    getattr(cache, msg[0])(msg[1])
                    cache.wait_copies()
    except Exception:
        traceback.print_exc()
        raise SystemExit(1)
    finally:
        comm.shutdown()


def _cache(cache_shape: tuple, dtype, device, kv_quant: dict, cls=KVCache) -> KVCache:
    """A rank's cache: its heads, every block, and the quantized cache's settings (``kv_quant``: kv_cache_dtype,
    scale_granularity, calculate_kv_scales). A quantized rank keeps its own heads' scales; per tensor, calibrated on
    the amax over every rank's heads (an all-reduce, max), so each rank, and one engine, takes the same scale."""
    cache = cls(*cache_shape, dtype=dtype, device=device, **kv_quant)
    if kv_quant.get("calculate_kv_scales"):
        cache.reduce_amax = lambda amax: dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    return cache


def worker_device(model_device, rank: int) -> str:
    """Rank r's device: GPU r on a CUDA machine (one GPU per rank, as vLLM places them), else the CPU."""
    return f"cuda:{rank}" if torch.device(model_device).type == "cuda" else "cpu"


def launch(model: GPT, world: int, cache_shape: tuple, timeout_s: float = None, kv_quant: dict = None):
    """Start ranks 1 .. world-1, join rank 0 here; returns (TPModel, TPGroup). ``cache_shape`` is
    (layers, blocks, block_size, kv heads *per rank*, head dim)."""
    if torch.device(model.device).type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"tensor_parallel_size={world} needs {world} GPUs, this machine has "
                         f"{torch.cuda.device_count()}")
    timeout_s = comm.collective_timeout_s() if timeout_s is None else timeout_s
    addr, port = "127.0.0.1", comm.free_port()
    ctx = comm.spawn_context()
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    procs = [ctx.Process(target=worker_main, daemon=True, name=f"minibatch-tp-rank{r}",
                         args=(r, world, addr, port, config_to_dict(model.config), state, cache_shape,
                               worker_device(model.device, r), timeout_s, kv_quant or {}))
             for r in range(1, world)]
    for p in procs:
        p.start()
    try:
        comm.init_watching(procs, [f"tensor-parallel worker rank {r}" for r in range(1, world)], 0, world, addr,
                           port, model.device, timeout_s)      # the workers' timeout, rank 0's too
    except Exception:
        for p in procs:
            p.kill()
        raise
    group = TPGroup(procs, world)
    return TPModel(shard_model(model, 0, world).eval(), group, model.num_params()), group


def start(model: GPT, engine_config, num_cache_blocks: int):
    """The engine's way in: workers launched, and the driver's (TPModel, TPKVCache, TPGroup).
    Rank 0's cache has the same blocks as every rank's, and its own max(1, Hkv / W) K/V heads."""
    mc, world = model.config, engine_config.tensor_parallel_size
    check_tp_size(mc, world)                   # before any process starts
    _, num_kv_heads, _ = tp_head_layout(mc.n_head, mc.num_kv_heads, world)     # past Hkv: one, replicated
    shape = (mc.n_layer, num_cache_blocks, engine_config.block_size, num_kv_heads, mc.head_dim)
    kv_quant = {"kv_cache_dtype": engine_config.kv_cache_dtype, "scale_granularity": engine_config.scale_granularity,
                "calculate_kv_scales": engine_config.calculate_kv_scales}
    tp_model, group = launch(model, world, shape, kv_quant=kv_quant)
    cache = _cache(shape, model.dtype, model.device, kv_quant, TPKVCache)
    cache.group = group
    return tp_model, cache, group
