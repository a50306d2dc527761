"""Model profiles: the shapes a cost model needs, numbers only, from the published configs.

A decoder-only transformer's cost is fixed by a handful of numbers: layers, hidden size, query heads,
K/V heads (fewer than query heads: grouped-query attention), head dim, the MLP's intermediate size
and whether it is gated (SwiGLU: three matrices, gate, up, down; GPT-2's GELU MLP: two), the
vocabulary, and the bytes of one weight (2 for bf16 serving, 4 for the shipped fp32 model).

``target`` and ``draft`` are read from the shipped checkpoints' configs (``minibatch/model/checkpoints``),
so they follow the weights. The others are typed in from their Hugging Face ``config.json`` (the source
string names the repository).

Parameters, per layer:  attention  H (n_heads + 2 n_kv) d  +  n_heads d H   (q, k, v, o)
                         MLP        3 H I (gated)  or  2 H I
and the embedding V x H, counted twice when the output head is not tied to it.
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field

CHECKPOINTS = pathlib.Path(__file__).resolve().parent.parent / "model" / "checkpoints"


@dataclass(frozen=True)
class ModelProfile:
    name: str
    n_layer: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2                # bf16
    gated_mlp: bool = True              # SwiGLU (Llama, Mistral); False: GPT-2's GELU MLP
    tied_embeddings: bool = False
    source: str = ""

    def __post_init__(self):
        for k in ("n_layer", "hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab", "dtype_bytes"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"model {self.name}: {k} must be an int >= 1, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model {self.name}: n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                             f"({self.n_kv_heads})")

    @property
    def dtype(self) -> str:
        return {4: "fp32", 2: "bf16"}.get(self.dtype_bytes, "bf16")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def attn_params(self) -> int:          # per layer: q, k, v, o
        return self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden

    @property
    def mlp_params(self) -> int:           # per layer
        return (3 if self.gated_mlp else 2) * self.hidden * self.intermediate

    @property
    def layer_params(self) -> int:
        return self.attn_params + self.mlp_params

    @property
    def num_params(self) -> int:
        return self.n_layer * self.layer_params + self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every layer: 2 x layers x kv heads x head dim x bytes."""
        return 2 * self.n_layer * self.kv_dim * self.dtype_bytes

    def to_dict(self) -> dict:
        from dataclasses import asdict
        return asdict(self)


SHIPPED = ("target", "draft", "llama")


def _shipped(name: str) -> ModelProfile:
    """A shipped model from its checkpoint's config, fp32, tied head: a GPT-2 (``target``, ``draft``: multi-head,
    GELU MLP 4 x C) or the Llama (``llama``: grouped-query, SwiGLU of its intermediate size)."""
    path = CHECKPOINTS / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"no shipped checkpoint {path}: train it with python -m minibatch.model.train "
                                f"--preset {name}")
    c = json.loads(path.read_text())["config"]
    src = f"minibatch/model/checkpoints/{name}.json (the shipped weights, fp32)"
    if c.get("architecture") == "LlamaForCausalLM":
        return ModelProfile(name, c["n_layer"], c["n_embd"], c["n_head"], c["n_kv_head"], c["n_embd"] // c["n_head"],
                            c["intermediate_size"], c["vocab_size"], 4, gated_mlp=True, tied_embeddings=True,
                            source=src)
    return ModelProfile(name, c["n_layer"], c["n_embd"], c["n_head"], c["n_head"], c["n_embd"] // c["n_head"],
                        4 * c["n_embd"], c["vocab_size"], 4, gated_mlp=False, tied_embeddings=True, source=src)


_HF = "Hugging Face config.json of "
PUBLISHED = {
    "gpt2": ModelProfile("gpt2", 12, 768, 12, 12, 64, 3072, 50257, 2, gated_mlp=False, tied_embeddings=True,
                         source=_HF + "openai-community/gpt2 (n_layer 12, n_embd 768, n_head 12, n_inner 4 x 768, "
                                      "vocab 50257), served in fp16"),
    "llama-3-8b": ModelProfile("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256,
                               source=_HF + "meta-llama/Meta-Llama-3-8B (bf16)"),
    "llama-3-70b": ModelProfile("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256,
                                source=_HF + "meta-llama/Meta-Llama-3-70B (bf16)"),
    "mistral-7b": ModelProfile("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32000,
                               source=_HF + "mistralai/Mistral-7B-v0.1 (bf16)"),
    "llama-2-13b": ModelProfile("llama-2-13b", 40, 5120, 40, 40, 128, 13824, 32000,
                                source=_HF + "meta-llama/Llama-2-13b-hf (bf16; multi-head attention, no GQA)"),
    # The draft for the Llama 3 family: same tokenizer (128,256 ids), 1.24 B parameters.
    "llama-3.2-1b": ModelProfile("llama-3.2-1b", 16, 2048, 32, 8, 64, 8192, 128256, tied_embeddings=True,
                                 source=_HF + "meta-llama/Llama-3.2-1B (bf16, tied embeddings)"),
}

# The draft model a simulated target is paired with, when ``simulate`` names none: a small model of the same
# family and tokenizer (speculation needs the same vocabulary).
DEFAULT_DRAFT = {"target": "draft", "llama": "draft", "llama-3-8b": "llama-3.2-1b", "llama-3-70b": "llama-3.2-1b",
                 "gpt2": "draft", "mistral-7b": "llama-3.2-1b", "llama-2-13b": "llama-3.2-1b"}


def model_names() -> list:
    return sorted([*SHIPPED, *PUBLISHED])


def get_model(name: str) -> ModelProfile:
    if name in SHIPPED:
        return _shipped(name)
    if name not in PUBLISHED:
        raise ValueError(f"unknown model profile {name!r}; choose one of {model_names()}")
    return PUBLISHED[name]
