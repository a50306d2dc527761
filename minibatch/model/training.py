"""What both training scripts share (``train.py``: the GPTs; ``train_heads.py``: the speculative heads on the
frozen target): windows of the corpus, the dense causal attention of a training batch, and the one
learning-rate schedule (linear warm-up, then cosine down to 10 %).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def batched_causal_attention(batch: int, seq: int):
    """Attention fn for training: the flat batch is a [batch, seq] rectangle of full windows."""
    def attn(layer_idx, q, k, v):                                 # q [B*S, H, D], k, v [B*S, Hkv, D]
        H, D = q.shape[1:]
        Hkv = k.shape[1]                                          # < H: grouped-query attention (Llama)
        q = q.view(batch, seq, H, D).transpose(1, 2)              # [B, H, S, D]
        k, v = (t.view(batch, seq, Hkv, D).transpose(1, 2) for t in (k, v))     # [B, Hkv, S, D]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hkv != H)
        return y.transpose(1, 2).reshape(batch * seq, H, D)
    return attn


def sample_windows(data: np.ndarray, batch: int, seq: int, rng: np.random.Generator):
    starts = rng.integers(0, len(data) - seq - 1, size=batch)
    x = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int64)
    x = torch.from_numpy(x)
    return x[:, :-1], x[:, 1:]                                    # inputs, next-byte targets


def cosine_lr(step: int, lr: float, warmup: int, steps: int) -> float:
    """The learning rate at ``step``: linear warm-up over ``warmup`` steps, then cosine from ``lr`` to 10 %."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))
