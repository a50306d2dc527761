"""The tiny GPT: GPT-2's architecture exactly, over a flat batch of tokens.

GPT-2 (Radford et al., 2019) is: learned token and position embeddings,
``n_layer`` pre-LayerNorm blocks (LayerNorm -> attention -> residual,
LayerNorm -> MLP with tanh-GELU -> residual), a final LayerNorm, and an output
head tied to the token embedding. Every Linear and LayerNorm has a bias.

What is *not* GPT-2 here is the calling convention. A serving engine does not
run a padded ``[batch, time]`` rectangle; it runs one **flat batch**: the new
tokens of many sequences concatenated, each with its own position, some of
them a prefill chunk and some a single decode token. So ``forward`` takes
``input_ids[T]`` and ``positions[T]`` and hands every layer's q, k, v to a
pluggable **attention function** that knows how the T tokens split into
sequences and where their earlier keys and values live (no cache, a
contiguous cache, or a paged cache). The model never sees a cache itself.

Shapes: T = tokens in the flat batch, C = n_embd, H = n_head, D = C // H,
V = vocab_size (256 bytes).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, ClassVar, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

# attn(layer_idx, q[T, H, D], k[T, H, D], v[T, H, D]) -> out[T, H, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class GPTConfig:
    name: str = "target"
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    n_ctx: int = 512          # context length: the most positions a sequence may have
    vocab_size: int = 256     # bytes
    architecture: ClassVar[str] = "GPT2LMHeadModel"     # Hugging Face's and vLLM's name: the registry's key

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def num_kv_heads(self) -> int:
        return self.n_head    # GPT-2 is multi-head attention: one K/V head per query head

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    # ~3.3M parameters; the model that is served.
    "target": GPTConfig("target", n_layer=4, n_head=4, n_embd=256),
    # The speculative-decoding draft: same vocabulary and context, about 1/13 of the
    # target's matmul FLOPs per token (2 x 12 x 96^2 vs 4 x 12 x 256^2), distilled from it.
    "draft": GPTConfig("draft", n_layer=2, n_head=3, n_embd=96),
}


def get_config(preset: str) -> GPTConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[preset]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)   # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, layer_idx: int, attn: AttentionFn) -> torch.Tensor:
        T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=1)                  # 3 x [T, C]
        q = q.view(T, self.n_head, self.head_dim)                 # [T, H, D]
        k = k.view(T, self.n_head, self.head_dim)
        v = v.view(T, self.n_head, self.head_dim)
        y = attn(layer_idx, q, k, v)                              # [T, H, D]
        return self.c_proj(y.reshape(T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x, layer_idx, attn):
        x = x + self.attn(self.ln_1(x), layer_idx, attn)          # pre-LN: normalise, then attend
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)      # token embedding [V, C]
        self.wpe = nn.Embedding(cfg.n_ctx, cfg.n_embd)           # learned positions [n_ctx, C]
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():                  # GPT-2: scale residual writes
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def device(self) -> torch.device:
        return self.wte.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.wte.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn,
                logits_indices: Optional[torch.Tensor] = None, hidden_states: Sequence = (),
                exit_layer: Optional[int] = None, all_hidden: bool = False, start_layer: int = 0,
                start_hidden: Optional[torch.Tensor] = None):
        """input_ids[T], positions[T] -> logits[N, V] for the rows ``logits_indices`` (all T if None).

        An engine needs logits only at each sequence's last new token (or at the
        k+1 verified positions under speculation), so it passes those indices and
        the output head, the biggest matmul here, runs on N rows instead of T.

        Two options serve speculative decoding, and leave the default call as it was:
        * ``hidden_states``: also return ``{i: [N, C]}`` at the same rows, where i counts blocks run
          (0 = the embeddings, i = the output of block i - 1, as Hugging Face numbers them) or is
          ``"final"``, the normalised state that feeds the LM head (what Medusa heads and EAGLE read).
          With ``all_hidden``, they are returned at all T rows instead (EAGLE reads every token's feature).
        * ``exit_layer`` = E: run only the first E blocks, then ln_f and the shared LM head (the
          early-exit draft of LayerSkip, Elhoushi et al. 2024, §3). Their K/V are the target's own.
        * ``start_layer`` = E with ``start_hidden`` [T, C]: start mid-stack, at block E, from the residual
          stream entering it (what ``hidden_states=(E,)`` returns: the output of block E - 1), instead of the
          embeddings; blocks 0 .. E-1 are not run, so they store no K/V ``attn`` (whatever is in the cache at
          those layers is read as it is). ``input_ids`` then only gives T. LayerSkip's KV reuse (§4.2): the
          verify of early-exit drafts starts here for the rows the drafter already ran through E blocks
          (``ModelRunner._forward``). ``hidden_states`` may then name only i >= E.
        Returns logits, or (logits, hidden dict) when ``hidden_states`` is given.
        """
        return run_decoder(self, input_ids, positions, attn, logits_indices, hidden_states, exit_layer, all_hidden,
                           start_layer, start_hidden)

    # The parts run_decoder asks every decoder for (llama.py's Llama answers the same):
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids) + self.wpe(positions)        # [T, C]: learned positions, added once

    def blocks(self, positions: torch.Tensor):
        """The blocks, each called as block(x, layer_idx, attn); GPT-2's need no positions past the embedding."""
        return self.h

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.wte.weight.t()                            # tied to the token embedding -> [N, V]


def run_decoder(model, input_ids, positions, attn, logits_indices=None, hidden_states=(), exit_layer=None,
                all_hidden=False, start_layer=0, start_hidden=None):
    """The forward every decoder here shares (GPT, Llama): embed, run the blocks, normalise, the head, with
    the speculative options documented at ``GPT.forward``. ``model`` supplies ``embed``, ``blocks``,
    ``final_norm`` and ``lm_head``."""
    # Positions are checked against n_ctx by the caller, on host values (ModelRunner._check_context,
    # forward_sequences): reading a device tensor back here would sync every step, and on CUDA a position
    # past the context is a device-side assert (a position embedding, a rotary table), not an error.
    cfg = model.config
    if input_ids.dim() != 1 or positions.shape != input_ids.shape:
        raise ValueError(f"expected flat input_ids[T] and positions[T]; got {tuple(input_ids.shape)} "
                         f"and {tuple(positions.shape)}")
    n_run = cfg.n_layer if exit_layer is None else exit_layer
    if not 0 <= n_run <= cfg.n_layer:
        raise ValueError(f"exit_layer must lie in 0..{cfg.n_layer}, got {exit_layer!r}")
    want, kept = set(hidden_states), {}
    if start_layer:
        if not (isinstance(start_layer, int) and 0 < start_layer <= n_run) or start_hidden is None \
                or tuple(start_hidden.shape) != (input_ids.shape[0], cfg.n_embd):
            raise ValueError(f"start_layer must lie in 1..{n_run} (the exit layer) with start_hidden "
                             f"[T={input_ids.shape[0]}, C={cfg.n_embd}]; got {start_layer!r} and "
                             f"{None if start_hidden is None else tuple(start_hidden.shape)}")
        if any(isinstance(i, int) and i < start_layer for i in want):
            raise ValueError(f"hidden_states {sorted(want, key=str)}: a call that starts at block {start_layer} "
                             f"has no hidden state before it")
        x = start_hidden                                          # [T, C], entering block start_layer
    elif start_hidden is not None:
        raise ValueError(f"start_hidden is the input of block start_layer, which must be >= 1 (block 0's input is "
                         f"the embeddings); got start_layer={start_layer!r}")
    else:
        x = model.embed(input_ids, positions)                     # [T, C]
    blocks = model.blocks(positions)
    for i in range(start_layer, n_run):
        if i in want:
            kept[i] = x
        x = blocks[i](x, i, attn)
    if n_run in want:
        kept[n_run] = x
    x_all = x
    if logits_indices is not None:
        x = x[logits_indices]                                     # [N, C]
        if not all_hidden:
            kept = {i: h[logits_indices] for i, h in kept.items()}
    x = model.final_norm(x)                                       # [N, C]
    logits = model.lm_head(x)                                     # [N, V]
    if not hidden_states:
        return logits
    if "final" in want:
        kept["final"] = model.final_norm(x_all) if all_hidden and logits_indices is not None else x
    return logits, kept


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           query_start_loc: torch.Tensor) -> torch.Tensor:
    """The reference attention: each sequence in the flat batch is *complete* (no cache).

    q: [T, H, D], k, v: [T, Hkv, D] (Hkv divides H); query_start_loc: [B+1], sequence b owns rows
    query_start_loc[b]:query_start_loc[b+1]. Plain softmax(q k^T / sqrt(D)) v with
    a causal mask inside each sequence; nothing crosses a sequence boundary.
    """
    if k.shape[1] != q.shape[1]:                                  # grouped-query: each K/V head serves H / Hkv
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)      # [T, H, D]
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    starts = query_start_loc.tolist()
    for s, e in zip(starts[:-1], starts[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        scores = (qs @ ks.transpose(1, 2)) * scale                # [H, n, n]
        n = e - s
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out[s:e] = (scores.softmax(dim=-1) @ vs).transpose(0, 1)  # [n, H, D]
    return out


class DenseAttention:
    """Backend object for the reference path: complete sequences, no KV cache."""

    def __init__(self, seq_lens, device=None):
        lens = torch.as_tensor(list(seq_lens), dtype=torch.long)
        self.query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])

    def __call__(self, layer_idx, q, k, v):
        return dense_causal_attention(q, k, v, self.query_start_loc)


@torch.no_grad()
def forward_sequences(model: GPT, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Convenience: logits[len(s), V] for each complete token list, in one flat batch (inference only)."""
    dev = model.device
    if max((len(s) for s in seqs), default=0) > model.config.n_ctx:
        raise ValueError(f"position {max(len(s) for s in seqs) - 1} is past the context length {model.config.n_ctx}")
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=dev)
    pos = torch.tensor([p for s in seqs for p in range(len(s))], dtype=torch.long, device=dev)
    logits = model(ids, pos, DenseAttention([len(s) for s in seqs]))
    return list(logits.split([len(s) for s in seqs]))
