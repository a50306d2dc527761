"""Which model class a checkpoint builds: keyed by the config's architecture name, as vLLM's ``ModelRegistry``.

A shipped checkpoint's ``<preset>.json`` holds its config with an ``"architecture"`` field, Hugging Face's name for
the class (``"GPT2LMHeadModel"``, ``"LlamaForCausalLM"``); a manifest without one is a GPT (the checkpoints from
before the Llama). Every entry point loads through here (``weights.load_model``), so ``LLM("llama")`` and
``--model llama`` serve whichever architecture the file names, and a file that names an unknown one, or whose
heads do not divide, is refused naming the file and the field.
"""
from __future__ import annotations

import dataclasses

from minibatch.model.llama import Llama, LlamaConfig
from minibatch.model.model import GPT, PRESETS as GPT_PRESETS, GPTConfig

ARCHITECTURES = {                       # architecture name -> (config class, model class)
    GPTConfig.architecture: (GPTConfig, GPT),
    LlamaConfig.architecture: (LlamaConfig, Llama),
}

PRESETS = {
    **GPT_PRESETS,
    # ~3.2M parameters, the GPT target's width and depth: 4 query heads sharing 2 K/V heads (half the KV bytes)
    "llama": LlamaConfig("llama", n_layer=4, n_head=4, n_kv_head=2, n_embd=256, intermediate_size=768),
}


def get_config(preset: str):
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[preset]


def config_to_dict(cfg) -> dict:
    """What a manifest stores: the architecture's name, then the config's fields."""
    return {"architecture": cfg.architecture, **dataclasses.asdict(cfg)}


def config_from_dict(fields: dict, source: str = "the config"):
    """A manifest's config -> its config object; a clear error naming ``source`` and the field otherwise."""
    fields = dict(fields)
    arch = fields.pop("architecture", GPTConfig.architecture)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{source}: field 'architecture' is {arch!r}, which this engine cannot build; "
                         f"known: {sorted(ARCHITECTURES)}")
    cls = ARCHITECTURES[arch][0]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{source}: unknown field(s) {unknown} for {arch}; its fields: {sorted(known)}")
    try:
        cfg = cls(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None
    if cfg.n_embd % cfg.n_head or cfg.n_head % cfg.num_kv_heads:
        raise ValueError(f"{source}: field 'n_head' ({cfg.n_head}) must divide n_embd ({cfg.n_embd}) and be a "
                         f"multiple of the K/V heads ({cfg.num_kv_heads})")
    return cfg


def build(cfg):
    """The model of ``cfg``'s architecture, freshly initialised."""
    return ARCHITECTURES[cfg.architecture][1](cfg)
