"""The training corpus: the Python standard library's own ``.py`` sources.

Every machine with Python has them, so the weights can be reproduced with no
download. Files are read from the running interpreter in sorted order (so the
corpus is deterministic for a given Python version), test suites and
site-packages are left out, and about 1 file in 20, chosen by a hash of its
relative path, is held out for validation: the split is by *file*, so held-out
code is code the model has never seen, not a shuffled neighbour of it.
"""
from __future__ import annotations

import pathlib
import sysconfig
import zlib

import numpy as np

_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(split: str) -> list[pathlib.Path]:
    """The sorted list of stdlib .py files in ``split`` ("train" or "val")."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")
    root = stdlib_root()
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if _SKIP_DIRS & set(rel.parts[:-1]):
            continue
        held_out = zlib.crc32(rel.as_posix().encode()) % 20 == 0
        if held_out == (split == "val"):
            out.append(f)
    return out


def load_corpus(split: str) -> np.ndarray:
    """All files of a split as one uint8 array of bytes, files separated by a blank line."""
    parts = [f.read_bytes() + b"\n\n" for f in stdlib_files(split)]
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


def val_documents(n: int = 64, min_len: int = 200, seed: int = 0) -> list[bytes]:
    """Held-out source snippets, seeded: the prompts for tests, workloads and benchmarks."""
    rng = np.random.default_rng(seed)
    files = [f for f in stdlib_files("val") if f.stat().st_size >= min_len]
    picks = rng.choice(len(files), size=min(n, len(files)), replace=False)
    return [files[i].read_bytes() for i in sorted(picks)]
