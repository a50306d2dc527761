"""The tiny Llama: the decoder every model a student serves next is (Llama 3, Mistral, Qwen), over a flat batch.

Four changes from GPT-2 (``model.py``), each with a consequence for the serving engine:

* **Rotary positions (RoPE**, Su et al. 2021, §3.4). No position embedding: each layer rotates q and k by
  an angle proportional to the token's position, pair by pair, so q·k depends on the *difference* of
  positions. The rotation is applied to k *before* it is stored, so a cached key carries its position: a
  prefix-cache hit is exact only because the hash chain fixes every block's position, and a tree node's
  position is its depth (``kv/tree.py``), never its index in the flat batch. Hugging Face's convention
  (``LlamaForCausalLM``): the two halves of a head, ``rotate_half(x) = [-x2, x1]``, frequencies
  ``theta ** (-2i / D)``.
* **Grouped-query attention** (Ainslie et al. 2023, §2.2). H query heads share Hkv < H key/value heads,
  H / Hkv queries per group: the KV cache holds Hkv heads, so a block holds H / Hkv times the tokens. Here
  4 query heads and 2 K/V heads: half of the GPT's KV bytes per token at the same width.
* **RMSNorm** (Zhang & Sennrich 2019): x / rms(x) * weight, no mean, no bias.
* **SwiGLU** (Shazeer 2020): down(silu(gate(x)) * up(x)), three matrices instead of two; no biases anywhere.

The calling convention is the GPT's: ``forward(input_ids[T], positions[T], attn, ...)`` with the pluggable
attention function; the attention function gets q [T, H, D] and k, v [T, Hkv, D] (every backend and kernel
handles Hkv < H). Module names are Hugging Face's, so that the export (``minibatch/export.py``) is a rename.

Shapes: T tokens, C = n_embd, H = n_head, Hkv = n_kv_head, D = C // H, F = intermediate_size, V = 256.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from minibatch.model.model import AttentionFn, run_decoder


@dataclass(frozen=True)
class LlamaConfig:
    name: str = "llama"
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 256
    intermediate_size: int = 768      # SwiGLU's hidden width: 3 matrices of C x F ~ GPT-2's 2 of C x 4C
    n_ctx: int = 512
    vocab_size: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    architecture: ClassVar[str] = "LlamaForCausalLM"     # Hugging Face's and vLLM's name: the registry's key

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 1 <= self.n_kv_head <= self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head}): each "
                             f"K/V head serves a whole group of query heads")
        if self.head_dim % 2:
            raise ValueError(f"the head size {self.head_dim} must be even: RoPE rotates pairs")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def num_kv_heads(self) -> int:
        return self.n_kv_head

    def to_dict(self) -> dict:
        return asdict(self)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple:
    """cos, sin [T, D] for the tokens at ``positions`` [T]: angle_i(p) = p * theta^(-2i/D), each twice (the
    two halves of a head are rotated together, Hugging Face's layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]                     # [T, D/2]
    emb = torch.cat([angles, angles], dim=-1)                                   # [T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by its token's angles: x * cos + rotate_half(x) * sin, rotate_half = [-x2, x1]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None, :] + torch.cat([-x2, x1], dim=-1) * sin[:, None, :]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()                                                           # the mean square in float32
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg, H, Hkv, D, C = cfg, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.n_embd
        self.q_proj = nn.Linear(C, H * D, bias=False)
        self.k_proj = nn.Linear(C, Hkv * D, bias=False)
        self.v_proj = nn.Linear(C, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, C, bias=False)

    def forward(self, x: torch.Tensor, layer_idx: int, attn: AttentionFn, rope: tuple) -> torch.Tensor:
        T, c = x.shape[0], self.cfg
        q = self.q_proj(x).view(T, c.n_head, c.head_dim)                        # [T, H, D]
        k = self.k_proj(x).view(T, c.n_kv_head, c.head_dim)                     # [T, Hkv, D]
        v = self.v_proj(x).view(T, c.n_kv_head, c.head_dim)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)                   # k rotated before it is stored
        return self.o_proj(attn(layer_idx, q, k, v).reshape(T, -1))             # [T, C]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))       # SwiGLU


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, layer_idx, attn, rope):
        x = x + self.self_attn(self.input_layernorm(x), layer_idx, attn, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """``LlamaForCausalLM``'s architecture, tied embeddings, over a flat batch (``GPT.forward``'s options)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)          # [V, C], tied to the head
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(self, input_ids, positions, attn: AttentionFn, logits_indices=None, hidden_states=(),
                exit_layer=None, all_hidden=False, start_layer=0, start_hidden=None):
        """input_ids[T], positions[T] -> logits[N, V]; the options are ``GPT.forward``'s (``run_decoder``)."""
        return run_decoder(self, input_ids, positions, attn, logits_indices, hidden_states, exit_layer, all_hidden,
                           start_layer, start_hidden)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)                                     # positions enter in every layer

    def blocks(self, positions: torch.Tensor):
        """The layers, each called as block(x, layer_idx, attn), with this batch's rotary angles computed once."""
        rope = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, self.dtype)
        return [lambda x, i, attn, layer=layer: layer(x, i, attn, rope) for layer in self.layers]

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.embed_tokens.weight.t()                                 # tied -> [N, V]
