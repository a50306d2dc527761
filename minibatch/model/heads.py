"""Speculative heads: small modules on top of the frozen target that guess its next tokens.

A draft model is a second network with its own weights, cache and prefill. These heads are the
other road (Cai et al. 2024; Li et al. 2024; Elhoushi et al. 2024): keep *one* model and add a
little to it, reading what the target computes anyway.

* ``MedusaHeads`` (Medusa-1, Cai et al. 2024, §2.1.1): K heads on the target's last hidden state
  (after ``ln_f``). Head i is a residual block ``h + SiLU(W_i h + b_i)`` (W_i, b_i zero-initialised,
  so it starts as the identity) and its own vocabulary projection (initialised from the tied LM
  head); it predicts the token at t + 2 + i from h_t, where the target's own head predicts t + 1.
  Trained with the backbone frozen, loss sum_i 0.8^i CE_i (§2.1.1's lambda_k).
* ``ExitAdapter`` (early exit, LayerSkip / Kangaroo): a residual MLP on the target's state after E
  blocks, so that the target's own first E layers + ln_f + head draft.
* ``EagleHead`` (EAGLE, Li et al. 2024): fc(2C -> C) on (token embedding, target feature), one transformer
  block (the target's kind: GPT-2's, or a Llama decoder layer), the target's head; trained on SmoothL1 to the
  next feature + 0.1 x CE to the target's distribution.
* ``Eagle3Head`` (EAGLE-3, ``eagle3_head.py``): one Llama layer on three fused target states.

Each head reads one checkpoint's hidden states: ``head_for`` picks the head of the target's checkpoint by name
(``weights.head_preset``: ``medusa`` for the GPT target, ``llama_medusa`` for the Llama) and ``load_head``
refuses one whose manifest names another checkpoint.

Shapes: N = rows, C = n_embd, V = vocab_size, K = heads.
Each module knows its ``config()`` (stored in the checkpoint's ``.json``) and is rebuilt from it by
``load_head``, which verifies the SHA-256 first and unpickles nothing (``weights.load_tensors``).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minibatch.model.eagle3_head import Eagle3Head           # EAGLE-3 has its own room
from minibatch.model.weights import HEADS_OF, check_dtype, head_preset, load_tensors, resolve_device


def token_embedding(target) -> torch.Tensor:
    """The target's token embedding [V, C], which is also its tied LM head (the GPT's ``wte``, the Llama's
    ``embed_tokens``): the heads start from it and score their guesses through ``target.lm_head``."""
    return (target.wte if hasattr(target, "wte") else target.embed_tokens).weight


class MedusaHeads(nn.Module):
    kind = "medusa"

    def __init__(self, n_embd: int = 256, vocab_size: int = 256, num_heads: int = 4):
        super().__init__()
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        self.n_embd, self.vocab_size, self.num_heads = n_embd, vocab_size, num_heads
        self.res = nn.ModuleList(nn.Linear(n_embd, n_embd) for _ in range(num_heads))
        self.lm_head = nn.ModuleList(nn.Linear(n_embd, vocab_size, bias=False) for _ in range(num_heads))
        for lin in self.res:                                   # identity at the start: h + SiLU(0) = h
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    @classmethod
    def from_target(cls, target, num_heads: int = 4) -> "MedusaHeads":
        """Fresh heads whose projections start as the target's tied LM head (so head i starts by guessing
        t + 1 again, a far better start than random)."""
        cfg = target.config
        heads = cls(cfg.n_embd, cfg.vocab_size, num_heads)
        for lin in heads.lm_head:
            lin.weight.data.copy_(token_embedding(target).detach().float())
        return heads.to(target.device)

    def config(self) -> dict:
        return {"kind": self.kind, "n_embd": self.n_embd, "vocab_size": self.vocab_size,
                "num_heads": self.num_heads}

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h[N, C] (the target's ln_f output) -> logits[N, K, V]; head i guesses token t + 2 + i."""
        return torch.stack([head(h + F.silu(res(h))) for res, head in zip(self.res, self.lm_head)], dim=1)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class ExitAdapter(nn.Module):
    """Early exit (LayerSkip, Elhoushi et al. 2024 §3; Kangaroo, Liu et al. 2024 §3.1): the target's first E
    blocks draft, through this light adapter, then the target's own ln_f and tied head.

    ``x_E + W2 GELU(W1 LN(x_E))`` on the residual stream after E blocks (W2 zero-initialised: it starts
    as the plain early exit). It stands in for what blocks E .. L-1 would add. It has no attention of its
    own, so it needs no K/V: the drafter's only K/V are those of the target's first E layers, which are the
    target's own. Trained against the full target's distribution (soft cross-entropy), the target frozen."""
    kind = "early_exit"

    def __init__(self, n_embd: int = 256, vocab_size: int = 256, exit_layer: int = 1, hidden: int = 256):
        super().__init__()
        if not isinstance(exit_layer, int) or exit_layer < 1:
            raise ValueError(f"exit_layer must be an int >= 1, got {exit_layer!r}")
        self.n_embd, self.vocab_size, self.exit_layer, self.hidden = n_embd, vocab_size, exit_layer, hidden
        self.ln = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, hidden)
        self.proj = nn.Linear(hidden, n_embd)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def config(self) -> dict:
        return {"kind": self.kind, "n_embd": self.n_embd, "vocab_size": self.vocab_size,
                "exit_layer": self.exit_layer, "hidden": self.hidden}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x[N, C], the residual stream after ``exit_layer`` blocks -> [N, C], a guess at the last block's."""
        return x + self.proj(F.gelu(self.fc(self.ln(x)), approximate="tanh"))

    def logits(self, target, x: torch.Tensor) -> torch.Tensor:
        """[N, V]: the adapted state through the target's final norm (the GPT's LayerNorm ln_f, the Llama's
        RMSNorm) and tied LM head."""
        return target.lm_head(target.final_norm(self(x)))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class EagleHead(nn.Module):
    """EAGLE (Li et al. 2024, §4.1): a one-block autoregressive head in the target's *feature* space.

    Entry p reads concat(embedding of token p, the target's feature f_{p-1}) (the feature is the ln_f output
    that feeds the LM head), maps it with fc(2C -> C), adds the target's position embedding of p, and runs one
    transformer block (attending over the earlier entries: its K/V are one more layer of the target's paged
    cache). The result f^_p is a guess of f_p, and the target's frozen tied head turns it into a guess of
    token p + 1. Drafting feeds f^_p back in as the feature of the next entry: EAGLE drafts in feature space.
    Token and position embeddings are the target's own, frozen and not stored here.

    Entry p depends only on tokens 0 .. p (as the target's K/V at p do), so its K/V may sit in the target's
    slot p and be shared by the prefix cache and by forks as the target's are. (EAGLE's paper indexes the same
    entry by its feature: (f_p, token p + 1) -> f_{p+1}; the slot is one further here so that it is.)

    On a Llama target (``architecture="LlamaForCausalLM"``) the block is the target's own kind, llama.py's
    ``LlamaDecoderLayer``: RMSNorm, rotary positions (applied to its keys before they are stored, as the
    target's are: there is no position embedding to add), and the target's grouped-query heads, so that its
    K/V have the shape of one more layer of the target's cache. That is vLLM's ``LlamaForCausalLMEagle``."""
    kind = "eagle"

    def __init__(self, n_embd: int = 256, vocab_size: int = 256, n_head: int = 4,
                 architecture: str = "GPT2LMHeadModel", n_kv_head: int | None = None,
                 intermediate_size: int | None = None, rope_theta: float = 10000.0, rms_norm_eps: float = 1e-5):
        super().__init__()
        from minibatch.model.model import Block, GPTConfig
        from minibatch.model.llama import LlamaConfig, LlamaDecoderLayer
        self.n_embd, self.vocab_size, self.n_head, self.architecture = n_embd, vocab_size, n_head, architecture
        self.fc = nn.Linear(2 * n_embd, n_embd)
        if architecture == GPTConfig.architecture:
            self.n_kv_head = n_head
            self.block = Block(GPTConfig("eagle", n_layer=1, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size))
        elif architecture == LlamaConfig.architecture:
            self.n_kv_head = n_kv_head
            self.llama = LlamaConfig("eagle", n_layer=1, n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd,
                                     intermediate_size=intermediate_size, vocab_size=vocab_size,
                                     rope_theta=rope_theta, rms_norm_eps=rms_norm_eps)
            self.block = LlamaDecoderLayer(self.llama)
        else:
            raise ValueError(f"architecture {architecture!r}: an EAGLE head is built for "
                             f"{[GPTConfig.architecture, LlamaConfig.architecture]}")

    @classmethod
    def from_target(cls, target, **kw):
        """A fresh head whose block is the target's kind of block (the GPT's, or a Llama decoder layer)."""
        c = target.config
        if c.architecture == "GPT2LMHeadModel":
            return cls(c.n_embd, c.vocab_size, c.n_head, **kw)
        return cls(c.n_embd, c.vocab_size, c.n_head, c.architecture, c.n_kv_head, c.intermediate_size,
                   c.rope_theta, c.rms_norm_eps, **kw)

    def config(self) -> dict:
        out = {"kind": self.kind, "n_embd": self.n_embd, "vocab_size": self.vocab_size, "n_head": self.n_head}
        if self.architecture != "GPT2LMHeadModel":         # the GPT's manifest predates the field: keep it so
            c = self.llama
            out.update(architecture=self.architecture, n_kv_head=c.n_kv_head, intermediate_size=c.intermediate_size,
                       rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps)
        return out

    def _block(self, x, positions, attn, layer_idx):
        if self.architecture == "GPT2LMHeadModel":
            return self.block(x, layer_idx, attn)
        from minibatch.model.llama import rotary_cos_sin
        rope = rotary_cos_sin(positions, self.llama.head_dim, self.llama.rope_theta, x.dtype)
        return self.block(x, layer_idx, attn, rope)

    def forward(self, target, token_ids, features, positions, attn, layer_idx: int) -> torch.Tensor:
        """token_ids[T], features[T, C] (f_{p-1} of each entry p), positions[T] -> f^[T, C]."""
        x = self.fc(torch.cat([token_embedding(target)[token_ids], features], dim=-1))          # [T, C]
        if self.architecture == "GPT2LMHeadModel":
            x = x + target.wpe(positions)                 # the GPT's learned positions; the Llama's are rotary
        return self._block(x, positions, attn, layer_idx)

    def logits(self, target, f_hat: torch.Tensor) -> torch.Tensor:
        """[N, V]: a guessed feature (already normalised, as the target's ln_f output is) through the tied head."""
        return target.lm_head(f_hat)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


KINDS = {"medusa": MedusaHeads, "early_exit": ExitAdapter, "eagle": EagleHead, "eagle3": Eagle3Head}


def build_head(config: dict) -> nn.Module:
    config = dict(config)
    kind = config.pop("kind", None)
    if kind not in KINDS:
        raise ValueError(f"unknown head kind {kind!r}; known: {sorted(KINDS)}")
    return KINDS[kind](**config)


def head_for(kind: str, target, directory=None) -> nn.Module:
    """The head of ``kind`` for this target, picked by the target's checkpoint name (``head_preset``: the GPT
    target's ``medusa``, the Llama's ``llama_medusa``), then loaded and checked by ``load_head`` (which refuses
    one trained on another checkpoint). A model none of whose shipped heads is of this kind is refused here,
    naming the head it would need; a model of another name (one built in a test, say) is offered the GPT's."""
    name = target.config.name
    preset = head_preset(kind, name) if name in HEADS_OF else kind
    if directory is None and kind not in HEADS_OF.get(name, HEADS_OF["target"]):
        have = [m for m, kinds in HEADS_OF.items() if kind in kinds]
        raise ValueError(f"method {kind!r} needs the head {preset!r} (minibatch/model/checkpoints/{preset}.safetensors)"
                         f" trained on {name!r}, which does not ship; it ships for {have}. Train it with python -m "
                         f"minibatch.model.train --preset {kind} --model {name}, or give its directory as "
                         f"speculative_config['model']")
    return load_head(preset, target, directory=directory)


def load_head(preset: str, target=None, device=None, dtype=torch.float32, directory=None):
    """The shipped head ``preset`` ("medusa", ...), checksum verified, in eval mode, on the target's device
    and dtype when a target is given. A head trained for another width or vocabulary is a clear error."""
    kw = {} if directory is None else {"directory": directory}
    tensors, manifest = load_tensors(preset, **kw)
    head = build_head(manifest["config"])
    if preset != head.kind and not preset.endswith("_" + head.kind):     # medusa, llama_medusa, ...
        raise ValueError(f"{preset}.json describes a {head.kind!r} head, not a {preset!r} one")
    head.load_state_dict(tensors)
    if target is not None:
        cfg = target.config
        trained_on, this = manifest.get("target_sha256"), getattr(target, "manifest", {}).get("sha256")
        if trained_on and this and trained_on != this:
            raise ValueError(f"the shipped {preset} head was trained on the hidden states of another checkpoint, "
                             f"{manifest.get('target', 'target')!r} (SHA-256 {trained_on[:12]}...), not on this "
                             f"{cfg.name!r} ({this[:12]}...): its guesses "
                             f"would mean nothing here. Train one for it (python -m minibatch.model.train_heads), or "
                             f"draft with method 'draft' or 'ngram', which need no head")
        if (head.n_embd, head.vocab_size) != (cfg.n_embd, cfg.vocab_size):
            raise ValueError(f"the {preset} head reads width {head.n_embd} and vocabulary {head.vocab_size}; the "
                             f"target has {cfg.n_embd} and {cfg.vocab_size}: it was trained for another model")
        if max(getattr(head, "layers", (0,))) > cfg.n_layer:
            raise ValueError(f"the EAGLE-3 head reads the states after blocks {head.layers}; the target has only "
                             f"{cfg.n_layer}")
        if getattr(head, "exit_layer", 0) >= cfg.n_layer:
            raise ValueError(f"the early-exit adapter exits after {head.exit_layer} blocks; the target has only "
                             f"{cfg.n_layer}")
        if getattr(head, "n_kv_head", cfg.num_kv_heads) != cfg.num_kv_heads:
            raise ValueError(f"the EAGLE head has {head.n_kv_head} K/V heads; its K/V share the target's cache, "
                             f"which holds {cfg.num_kv_heads}")
        device, dtype = target.device, target.dtype
    check_dtype(dtype)
    head.manifest = manifest
    return head.to(device=resolve_device(device), dtype=dtype).eval()
