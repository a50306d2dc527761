"""EAGLE-3's draft head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", §3): one decoder layer that reads *three* of the target's hidden states, not its last one.

EAGLE-1 (``heads.EagleHead``) reads the target's top feature f (the final norm's output) and learns to predict
the next f (a feature loss) as well as the next token. EAGLE-3 makes two changes (§3.1-3.2):

1. **Fused features.** The target's states after a low, a middle and a high block, l, m, h [T, C] each, are
   concatenated and projected back to the width: g = fc(cat(l, m, h)) [T, 3C -> C]. The top layer alone is
   shaped for the very next token; the lower ones keep what later tokens need too.
2. **No feature loss; training-time test.** The layer's output a is only ever scored as a token
   (``logits``: its own RMSNorm, then the target's tied head), so it is free to be whatever helps. What it
   reads as its "feature" is g at a position the target computed, and its own previous output a at a drafted
   one; training rolls the layer out on its own outputs for k steps (``head_objectives.eagle3_loss``), as
   drafting will.

The layer is the reference's (SafeAILab ``traineagle3/cnets.py``, vLLM's ``LlamaForCausalLMEagle3``): entry p
reads the embedding e of token p and the feature x_{p-1} (g or a), each through its own RMSNorm, concatenated
[2C]; q, k, v are projected from that 2C input; the residual is x_{p-1}; then the Llama MLP. So
a_p = x' + MLP(norm(x')), x' = x_{p-1} + Attn(cat(norm(e_p), norm(x_{p-1}))). RoPE, grouped-query heads and
SwiGLU are the target's (``llama.py``), so its K/V are one more layer of the target's paged cache, exactly as
EAGLE-1's (``spec_decode/eagle.py``). Token embeddings and the LM head are the target's, frozen, not stored.

Shapes: T entries, C = n_embd, H / Hkv query / K/V heads, V = vocab_size.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from minibatch.model.llama import LlamaAttention, LlamaConfig, LlamaMLP, RMSNorm, rotary_cos_sin

DEFAULT_LAYERS = (1, 2, 4)        # low, middle, high: the residual stream after 1, 2 and 4 blocks (README)


class Eagle3Head(nn.Module):
    kind = "eagle3"

    def __init__(self, n_embd: int = 256, vocab_size: int = 256, n_head: int = 4, n_kv_head: int = 2,
                 intermediate_size: int = 768, layers=DEFAULT_LAYERS, rope_theta: float = 10000.0,
                 rms_norm_eps: float = 1e-5):
        super().__init__()
        layers = tuple(layers)
        if len(layers) != 3 or any(not isinstance(i, int) or i < 1 for i in layers) or list(layers) != sorted(set(layers)):
            raise ValueError(f"layers are three increasing block counts >= 1 (low, middle, high), got {layers!r}")
        self.n_embd, self.vocab_size, self.n_head, self.n_kv_head, self.layers = (n_embd, vocab_size, n_head,
                                                                                  n_kv_head, layers)
        self.cfg = LlamaConfig("eagle3", n_layer=1, n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd,
                               intermediate_size=intermediate_size, vocab_size=vocab_size, rope_theta=rope_theta,
                               rms_norm_eps=rms_norm_eps)
        C, D, eps = n_embd, self.cfg.head_dim, rms_norm_eps
        self.fc = nn.Linear(3 * C, C, bias=False)                   # cat(l, m, h) [3C] -> g [C]
        self.input_layernorm, self.hidden_norm = RMSNorm(C, eps), RMSNorm(C, eps)
        self.self_attn = LlamaAttention(self.cfg)
        self.self_attn.q_proj = nn.Linear(2 * C, n_head * D, bias=False)      # q, k, v read cat(e, x): 2C wide
        self.self_attn.k_proj = nn.Linear(2 * C, n_kv_head * D, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * C, n_kv_head * D, bias=False)
        self.post_attention_layernorm = RMSNorm(C, eps)
        self.mlp = LlamaMLP(self.cfg)
        self.norm = RMSNorm(C, eps)                                  # before the target's tied head
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    @classmethod
    def from_target(cls, target, layers=DEFAULT_LAYERS) -> "Eagle3Head":
        c = target.config
        if c.architecture != LlamaConfig.architecture:
            raise ValueError(f"the EAGLE-3 head is a Llama decoder layer; {c.name!r} is a {c.architecture}")
        if max(layers) > c.n_layer:
            raise ValueError(f"layers {tuple(layers)}: {c.name!r} has only {c.n_layer} blocks")
        return cls(c.n_embd, c.vocab_size, c.n_head, c.n_kv_head, c.intermediate_size, layers, c.rope_theta,
                   c.rms_norm_eps)

    def config(self) -> dict:
        c = self.cfg
        return {"kind": self.kind, "n_embd": self.n_embd, "vocab_size": self.vocab_size, "n_head": self.n_head,
                "n_kv_head": self.n_kv_head, "intermediate_size": c.intermediate_size, "layers": list(self.layers),
                "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_norm_eps}

    @property
    def hidden_states(self) -> tuple:
        """The target's hidden states it reads (``run_decoder``'s numbering: blocks run)."""
        return self.layers

    def fuse(self, states) -> torch.Tensor:
        """[l, m, h], each [T, C] -> g [T, C]: the feature of a position the target computed."""
        return self.fc(torch.cat(list(states), dim=-1))

    def forward(self, target, token_ids, features, positions, attn, layer_idx: int) -> torch.Tensor:
        """token_ids[T], features[T, C] (x_{p-1} of each entry p: g, or the layer's own a), positions[T] -> a[T, C]."""
        e = target.embed_tokens(token_ids)                                              # [T, C], frozen
        rope = rotary_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, features.dtype)
        x = torch.cat([self.input_layernorm(e), self.hidden_norm(features)], dim=-1)    # [T, 2C]
        h = features + self.self_attn(x, layer_idx, attn, rope)                         # [T, C]
        return h + self.mlp(self.post_attention_layernorm(h))

    def logits(self, target, a: torch.Tensor) -> torch.Tensor:
        """[N, V]: the layer's output through its own RMSNorm and the target's tied head."""
        return target.lm_head(self.norm(a))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
