"""A decoder split over ``world`` ranks by attention heads (Megatron-LM §3; vLLM's and nano-vllm's layout).

GPT-2 first, then the Llama (``shard_llama`` below), whose heads are split by K/V groups.

Per block, rank r holds:
  * attention: heads r·H/W .. (r+1)·H/W. ``c_attn`` (q, k and v in one matmul) is column-parallel, each of
    q, k, v cut at the same head boundaries; the heads attend independently, through this rank's **own KV
    cache, which holds its heads only** ([layers, 2, blocks, block_size, H/W, D]); ``c_proj`` is
    row-parallel: one all-reduce.
  * MLP: ``c_fc`` column-parallel (4C/W hidden units), GELU locally, ``c_proj`` row-parallel: one all-reduce.
Replicated on every rank: the embeddings (wte, wpe), the LayerNorms and the tied LM head. Why: the LM head
is 256 x 256 here (a byte vocabulary), so splitting it would save nothing and cost an all-gather of the
logits; LayerNorm needs the whole row; and every rank then holds the same residual stream x [T, C] after
each all-reduce, so hidden states (Medusa's, EAGLE's features) are the same on every rank. (vLLM splits the
vocabulary for big vocabularies: VocabParallelEmbedding / ParallelLMHead.)

Every rank thus runs ``GPT.forward`` unchanged; only the modules inside the blocks differ. Two all-reduces of
[T, C] per block: 2 · L · T · C · bytes cross the wire each forward (minibatch/distributed/README.md counts them).

**The Llama, by K/V groups** (vLLM's ``QKVParallelLinear``). With grouped-query attention, query heads
g·H/Hkv .. (g+1)·H/Hkv - 1 read K/V head g (Hugging Face's ``repeat_kv`` layout). Every query head a rank holds
must find its K/V head in that rank's own cache, so ``tp_head_layout`` follows vLLM's rule:
  * W <= Hkv: rank r holds K/V heads r·Hkv/W .. (r+1)·Hkv/W - 1 and their query heads (W must divide Hkv);
  * W > Hkv: each K/V head is **replicated** on ``num_kv_head_replicas`` = W / Hkv ranks (W must be a multiple
    of Hkv): rank r holds K/V head r // (W / Hkv), and of that group's query heads the H/W it owns,
    r·H/W .. (r+1)·H/W - 1. The replicas compute and cache the same K/V: W / Hkv times the cache of one copy,
    the price of splitting the query heads further (the simulated clock prices it: perf/cost.py).
Either way a rank holds H/W query heads and max(1, Hkv/W) K/V heads (vLLM's ``num_heads``, ``num_kv_heads``),
and its cache is [layers, 2, blocks, block_size, max(1, Hkv/W), D]. q_proj is column-parallel by query heads,
k_proj and v_proj by K/V heads (split Hkv/W ways, or W/Hkv ranks taking the same slice), o_proj row-parallel;
the SwiGLU MLP's gate_proj and up_proj column-parallel (F/W units each: silu(gate)·up is elementwise, so local),
down_proj row-parallel. RMSNorm, the embedding and the tied head are replicated; RoPE is per head, so local.
Still two all-reduces of [T, C] per layer.
"""
from __future__ import annotations

import copy

import torch.nn as nn

from minibatch.distributed.parallel_linear import ColumnParallelLinear, RowParallelLinear, _check_split
from minibatch.model.llama import Llama, apply_rotary
from minibatch.model.model import GPT


def tp_head_layout(n_head: int, total_num_kv_heads: int, tp_size: int) -> tuple[int, int, int]:
    """vLLM's split of the heads (``QKVParallelLinear``): (num_heads, num_kv_heads, num_kv_head_replicas) per
    rank. Query heads split tp ways; K/V heads split tp ways while they can, else one a rank, each replicated
    on tp / Hkv ranks. Assumes a size ``check_tp_size`` accepted."""
    if tp_size >= total_num_kv_heads:
        return n_head // tp_size, 1, tp_size // total_num_kv_heads
    return n_head // tp_size, total_num_kv_heads // tp_size, 1


def _splits(n_head: int, n_kv: int, world: int) -> bool:
    return n_head % world == 0 and (n_kv % world == 0 or world % n_kv == 0)


def check_tp_size(config, world: int) -> None:
    """A clear error for a split that cannot be made, at construction (the one check of the head split)."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {world!r}")
    if config.architecture not in SHARDERS:
        if world > 1:
            raise ValueError(f"tensor parallelism has no split for {config.architecture} ({config.name!r}); it splits "
                             f"{sorted(SHARDERS)}: use tensor_parallel_size=1")
        return
    H, Hkv = config.n_head, config.num_kv_heads
    if _splits(H, Hkv, world):
        return
    sizes = [d for d in range(1, H + 1) if _splits(H, Hkv, d)]
    if H == Hkv:                                   # multi-head attention: a K/V head per query head
        raise ValueError(f"tensor_parallel_size={world} does not divide the model's {H} attention heads "
                         f"({config.name}): each rank must hold whole heads; choose one of {sizes}")
    raise ValueError(f"tensor_parallel_size={world} does not split {config.name}'s {H} query heads and {Hkv} "
                     f"K/V heads: each rank holds whole query heads (a divisor of {H}) and either whole K/V "
                     f"groups (a divisor of {Hkv}) or one K/V head replicated on tensor_parallel_size / {Hkv} "
                     f"ranks (a multiple of {Hkv}); choose one of {sizes}")


class ParallelAttention(nn.Module):
    """``CausalSelfAttention`` on this rank's H / W heads: x [T, C] -> [T, C] (after the all-reduce)."""

    def __init__(self, full, rank: int, world: int):
        super().__init__()
        self.n_head = _check_split(full.n_head, world, "the attention heads")
        self.head_dim = full.head_dim
        self.c_attn = ColumnParallelLinear(full.c_attn, rank, world, row_groups=3)   # [3 * C / W, C]
        self.c_proj = RowParallelLinear(full.c_proj, rank, world)                    # [C, C / W]

    def forward(self, x, layer_idx: int, attn):
        T = x.shape[0]
        local = self.n_head * self.head_dim                                         # C / W
        q, k, v = self.c_attn(x).split(local, dim=1)                                # 3 x [T, C / W]
        shape = (T, self.n_head, self.head_dim)                                     # [T, H / W, D]
        y = attn(layer_idx, q.view(shape), k.view(shape), v.view(shape))
        return self.c_proj(y.reshape(T, local))


class ParallelMLP(nn.Module):
    def __init__(self, full, rank: int, world: int):
        super().__init__()
        self.c_fc = ColumnParallelLinear(full.c_fc, rank, world)      # [4C / W, C]
        self.c_proj = RowParallelLinear(full.c_proj, rank, world)     # [C, 4C / W]

    def forward(self, x):
        return self.c_proj(nn.functional.gelu(self.c_fc(x), approximate="tanh"))


def shard_gpt(model: GPT, rank: int, world: int) -> GPT:
    """A copy of ``model`` holding rank ``rank``'s slices: the same ``GPT.forward``, H / W heads per layer."""
    check_tp_size(model.config, world)
    local = copy.deepcopy(model)
    for block in local.h:
        block.attn = ParallelAttention(block.attn, rank, world)
        block.mlp = ParallelMLP(block.mlp, rank, world)
    return local


# -- the Llama: split by K/V groups -----------------------------------------------------------------------------------
class ParallelLlamaAttention(nn.Module):
    """``LlamaAttention`` on this rank's heads: H / W query heads and max(1, Hkv / W) K/V heads; x [T, C] -> [T, C]."""

    def __init__(self, full, rank: int, world: int):
        super().__init__()
        cfg = full.cfg
        self.n_head, self.n_kv_head, self.num_kv_head_replicas = tp_head_layout(cfg.n_head, cfg.n_kv_head, world)
        self.head_dim = cfg.head_dim
        # K/V by K/V head: rank r takes slice r // replicas of Hkv / num_kv_heads slices (replicas take the same)
        kv_rank, kv_world = rank // self.num_kv_head_replicas, world // self.num_kv_head_replicas
        self.q_proj = ColumnParallelLinear(full.q_proj, rank, world)             # [H/W · D, C]: heads r·H/W ..
        self.k_proj = ColumnParallelLinear(full.k_proj, kv_rank, kv_world)       # [max(1, Hkv/W) · D, C]
        self.v_proj = ColumnParallelLinear(full.v_proj, kv_rank, kv_world)
        self.o_proj = RowParallelLinear(full.o_proj, rank, world)                # [C, H/W · D]

    def forward(self, x, layer_idx: int, attn, rope: tuple):
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.n_head, self.head_dim)             # [T, H/W, D]
        k = self.k_proj(x).view(T, self.n_kv_head, self.head_dim)          # [T, max(1, Hkv/W), D]
        v = self.v_proj(x).view(T, self.n_kv_head, self.head_dim)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return self.o_proj(attn(layer_idx, q, k, v).reshape(T, -1))


class ParallelLlamaMLP(nn.Module):
    def __init__(self, full, rank: int, world: int):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(full.gate_proj, rank, world)     # [F/W, C]
        self.up_proj = ColumnParallelLinear(full.up_proj, rank, world)         # [F/W, C]
        self.down_proj = RowParallelLinear(full.down_proj, rank, world)        # [C, F/W]

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def shard_llama(model: Llama, rank: int, world: int) -> Llama:
    """A copy of ``model`` holding rank ``rank``'s query heads and K/V heads: the same ``Llama.forward``."""
    check_tp_size(model.config, world)
    local = copy.deepcopy(model)
    for layer in local.layers:
        layer.self_attn = ParallelLlamaAttention(layer.self_attn, rank, world)
        layer.mlp = ParallelLlamaMLP(layer.mlp, rank, world)
    return local


SHARDERS = {"GPT2LMHeadModel": shard_gpt, "LlamaForCausalLM": shard_llama}   # architecture -> its split


def shard_model(model, rank: int, world: int):
    """Rank ``rank``'s shard of any model tensor parallelism can split (``check_tp_size`` says which)."""
    check_tp_size(model.config, world)
    return SHARDERS[model.config.architecture](model, rank, world)
