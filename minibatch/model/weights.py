"""Shipped checkpoints: save and load them without pickle, and check them on load.

Each preset has two files in ``minibatch/model/checkpoints/``:
  ``<preset>.safetensors``  the tensors, float16 (half the bytes; float32 on load)
  ``<preset>.json``         the config, the SHA-256 of the tensor file, and how it was trained
The model presets (``target``, ``draft``: GPTs; ``llama``) load as the class their config's architecture names
(``load_model``, through ``registry.py``); the speculative heads
(``medusa``, ``eagle``, ``early_exit``, and the Llama's ``llama_medusa``, ..., ``llama_eagle3``:
``minibatch/model/heads.py``; ``head_preset`` names them) as their own modules through ``load_tensors``, the same
two files and the same checks.
safetensors holds raw tensors and a JSON header only, so loading cannot run code
(unlike ``pickle``). The checksum catches a truncated or swapped file.
"""
from __future__ import annotations

import hashlib
import json
import pathlib

import torch
from safetensors.torch import load_file, save_file

from minibatch.model import registry
from minibatch.model.registry import PRESETS

WEIGHTS_DIR = pathlib.Path(__file__).parent / "checkpoints"
HEAD_KINDS = ("medusa", "eagle", "early_exit", "eagle3")   # modules on top of the frozen target (heads.py)
HEADS_OF = {"target": HEAD_KINDS[:3], "llama": HEAD_KINDS}     # which heads ship for which model


def head_preset(kind: str, model: str = "target") -> str:
    """The checkpoint name of the ``kind`` head trained on ``model``: the GPT target's heads keep their first
    names (``medusa``), every other model's carry its name in front (``llama_medusa``), so none clash."""
    return kind if model == "target" else f"{model}_{kind}"


HEAD_PRESETS = tuple(head_preset(k, m) for m, kinds in HEADS_OF.items() for k in kinds)


class ChecksumError(RuntimeError):
    """The weights file does not match the SHA-256 recorded beside it."""


def sha256_of(path: pathlib.Path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def save_tensors(name: str, tensors: dict, manifest: dict, directory: pathlib.Path = WEIGHTS_DIR,
                 dtype: torch.dtype = torch.float16) -> pathlib.Path:
    """Write ``<name>.safetensors`` (tensors cast to ``dtype``) and ``<name>.json`` (manifest + SHA-256)."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in tensors.items()}
    path = directory / f"{name}.safetensors"
    save_file(tensors, str(path))
    manifest = dict(manifest)
    manifest = {"config": manifest.pop("config", {}), "sha256": sha256_of(path), **manifest}
    (directory / f"{name}.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def save_checkpoint(model, info: dict, directory: pathlib.Path = WEIGHTS_DIR) -> pathlib.Path:
    return save_tensors(model.config.name, model.state_dict(),
                        {"config": registry.config_to_dict(model.config), **info}, directory)


def read_manifest(preset: str, directory: pathlib.Path = WEIGHTS_DIR) -> dict:
    if preset not in HEAD_PRESETS and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS) + list(HEAD_PRESETS)}")
    path = pathlib.Path(directory) / f"{preset}.json"
    if not path.exists():
        raise FileNotFoundError(f"no shipped weights for preset {preset!r} at {path}; "
                                f"train them with `python -m minibatch.model.train --preset {preset}`")
    return json.loads(path.read_text())


def load_tensors(preset: str, directory: pathlib.Path = WEIGHTS_DIR) -> tuple[dict, dict]:
    """(float32 tensors, manifest) of a shipped checkpoint; its SHA-256 checked first, nothing unpickled."""
    manifest = read_manifest(preset, directory)
    path = pathlib.Path(directory) / f"{preset}.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing (its manifest {path.with_suffix('.json').name} is there)")
    digest = sha256_of(path)
    if digest != manifest["sha256"]:
        raise ChecksumError(f"{path.name}: SHA-256 {digest[:16]}... does not match the recorded "
                            f"{manifest['sha256'][:16]}...; the file is corrupt or not the shipped one")
    return {k: v.float() for k, v in load_file(str(path)).items()}, manifest


def check_dtype(dtype) -> None:
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be a floating type (float32, float16, bfloat16), not {dtype}")


def load_model(preset: str = "target", device=None, dtype=torch.float32,
               directory: pathlib.Path = WEIGHTS_DIR):
    """Build the preset's model (the class its config's architecture names) and load its shipped weights
    (checksum verified), in eval mode."""
    if preset in HEAD_PRESETS:
        raise ValueError(f"{preset!r} is a speculative head, not a model: load it with minibatch.model.heads.load_head")
    tensors, manifest = load_tensors(preset, directory)
    check_dtype(dtype)
    model = registry.build(registry.config_from_dict(manifest["config"], str(pathlib.Path(directory) / f"{preset}.json")))
    model.load_state_dict(tensors)
    model.manifest = manifest                   # which checkpoint it is: a head checks it was trained on this one
    return model.to(device=resolve_device(device), dtype=dtype).eval()


def resolve_device(device=None) -> torch.device:
    """None -> CUDA when present, else CPU; a CUDA request without CUDA is a clear error."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for, but torch sees no CUDA GPU")
    return device
