"""GPT-2 split over ``world`` ranks by attention heads (Megatron-LM §3; vLLM's and nano-vllm's layout).

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
[T, C] per block: 2 · L · T · C · bytes cross the wire each forward (the README's TP section counts them).
"""
from __future__ import annotations

import copy

import torch.nn as nn

from minibatch.distributed.parallel_linear import ColumnParallelLinear, RowParallelLinear, _check_split
from minibatch.model.model import GPT


def check_tp_size(config, world: int) -> None:
    """A clear error for a split that cannot be made, at construction."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {world!r}")
    if world > 1 and config.architecture != "GPT2LMHeadModel":
        raise ValueError(f"tensor parallelism splits GPT-2's fused c_attn by heads (tp_model.py); {config.name!r} is a "
                         f"{config.architecture}, whose split by K/V groups is not built: use tensor_parallel_size=1")
    if config.n_head % world:
        raise ValueError(f"tensor_parallel_size={world} does not divide the model's {config.n_head} attention heads "
                         f"({config.name}): each rank must hold whole heads; choose one of "
                         f"{[d for d in range(1, config.n_head + 1) if config.n_head % d == 0]}")


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
