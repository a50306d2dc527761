"""minibatch: an educational, step-through reference implementation of LLM serving.

The public entry points mirror vLLM's: ``LLM`` and ``SamplingParams`` for whole
prompt lists, ``LLMEngine`` for one iteration at a time. The rooms, bottom to top (each imports only
the rooms below it; README.md, "Read the code"): ``model/`` (the tiny GPT and its weights), ``kv/`` (the paged
KV cache and attention), ``sampling/``, ``spec_decode/`` (speculative decoding), ``engine/``
(scheduling and the step loop), ``llm.py``, then what drives and draws it: ``serve/``, ``viz/``,
``bench/`` (workloads, benchmarks, demos).
"""
import importlib.machinery
import sys
import warnings
from pathlib import Path

# `import kernels` must find this repository's Triton package (kernels/, beside minibatch/). Hugging Face
# transformers depends on a package of the same import name (its kernel hub), and `pip install transformers` puts
# it in site-packages, where Python looks *before* it asks setuptools' editable-install finder: the repo's own
# kernels/ would be shadowed. So when minibatch/ and kernels/ sit side by side (a checkout, an editable install, a
# student release), a finder asked first maps the top-level name `kernels` to that folder; its submodules follow
# the package's __path__. transformers runs without its `kernels` (it imports it only for hub kernels).
_ROOT = Path(__file__).resolve().parent.parent


class _RepoKernels:
    """The meta-path finder for the name ``kernels`` alone: the repository's package, whatever else is installed."""

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.PathFinder.find_spec(name, [str(_ROOT)]) if name == "kernels" else None


if (_ROOT / "kernels" / "__init__.py").exists():
    if not any(type(f).__name__ == "_RepoKernels" for f in sys.meta_path):
        sys.meta_path.insert(0, _RepoKernels())
    _k = sys.modules.get("kernels")
    if _k is not None and Path(getattr(_k, "__file__", None) or "/").resolve().parent.parent != _ROOT:
        warnings.warn(f"a foreign `kernels` package ({getattr(_k, '__file__', _k)}) was imported before minibatch; "
                      f"import minibatch first to get this repository's kernels/ ({_ROOT / 'kernels'})", stacklevel=2)

from minibatch.sampling.sampler import SamplingParams  # noqa: E402


def __getattr__(name):                    # lazy: `import minibatch` stays cheap and import-cycle free
    if name == "LLM":
        from minibatch.llm import LLM
        return LLM
    if name == "LLMEngine":
        from minibatch.engine.engine import LLMEngine
        return LLMEngine
    if name == "EngineConfig":
        from minibatch.engine.config import EngineConfig
        return EngineConfig
    if name == "TraceRecorder":
        from minibatch.trace import TraceRecorder
        return TraceRecorder
    raise AttributeError(f"module 'minibatch' has no attribute {name!r}")


__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "TraceRecorder"]
