"""Shipped checkpoints: save and load them without pickle, and check them on load.

Each preset has two files in ``minibatch/model/checkpoints/``:
  ``<preset>.safetensors``  the tensors, float16 (half the bytes; float32 on load)
  ``<preset>.json``         the config, the SHA-256 of the tensor file, and how it was trained
safetensors holds raw tensors and a JSON header only, so loading cannot run code
(unlike ``pickle``). The checksum catches a truncated or swapped file.
"""
from __future__ import annotations

import hashlib
import json
import pathlib

import torch
from safetensors.torch import load_file, save_file

from minibatch.model.model import GPT, GPTConfig, get_config

WEIGHTS_DIR = pathlib.Path(__file__).parent / "checkpoints"


class ChecksumError(RuntimeError):
    """The weights file does not match the SHA-256 recorded beside it."""


def sha256_of(path: pathlib.Path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def save_checkpoint(model: GPT, info: dict, directory: pathlib.Path = WEIGHTS_DIR) -> pathlib.Path:
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = model.config.name
    tensors = {k: v.detach().to(torch.float16).contiguous().cpu() for k, v in model.state_dict().items()}
    path = directory / f"{name}.safetensors"
    save_file(tensors, str(path))
    manifest = {"config": model.config.to_dict(), "sha256": sha256_of(path), **info}
    (directory / f"{name}.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def read_manifest(preset: str, directory: pathlib.Path = WEIGHTS_DIR) -> dict:
    get_config(preset)                                         # unknown preset -> clear error
    path = pathlib.Path(directory) / f"{preset}.json"
    if not path.exists():
        raise FileNotFoundError(f"no shipped weights for preset {preset!r} at {path}; "
                                f"train them with `python -m minibatch.model.train --preset {preset}`")
    return json.loads(path.read_text())


def load_model(preset: str = "target", device=None, dtype=torch.float32,
               directory: pathlib.Path = WEIGHTS_DIR) -> GPT:
    """Build the preset's GPT and load its shipped weights (checksum verified), in eval mode."""
    manifest = read_manifest(preset, directory)
    path = pathlib.Path(directory) / f"{preset}.safetensors"
    digest = sha256_of(path)
    if digest != manifest["sha256"]:
        raise ChecksumError(f"{path.name}: SHA-256 {digest[:16]}... does not match the recorded "
                            f"{manifest['sha256'][:16]}...; the file is corrupt or not the shipped one")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be a floating type (float32, float16, bfloat16), not {dtype}")
    model = GPT(GPTConfig(**manifest["config"]))
    model.load_state_dict({k: v.float() for k, v in load_file(str(path)).items()})
    return model.to(device=resolve_device(device), dtype=dtype).eval()


def resolve_device(device=None) -> torch.device:
    """None -> CUDA when present, else CPU; a CUDA request without CUDA is a clear error."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for, but torch sees no CUDA GPU")
    return device
