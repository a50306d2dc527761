"""A machine without Triton (macOS, Windows), simulated: ``import triton`` fails.

tests/conftest.py runs this file when MINIBATCH_NO_TRITON=1 and puts this folder first on PYTHONPATH, so every
Python the tests start (a notebook, the grader's parts, a command) imports it at start-up as ``sitecustomize``
and fails the same way. It shadows any other ``sitecustomize`` of that environment: use it for tests only.
"""
import os
import sys

# Only this environment's Pythons are "the machine without Triton". A peer started from a venv of its own (vLLM's
# CPU build, for notebook 08 and bench vllm) is another program on that machine, whose own probing of triton
# (vLLM asks importlib.util.find_spec) must see its own packages: the tests set the prefix they mean.
_BLOCKED_HERE = os.environ.get("MINIBATCH_NO_TRITON_PREFIX", sys.prefix) == sys.prefix


class NoTriton:
    """A meta-path finder asked before the others: ``triton`` and its submodules are not found."""

    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by MINIBATCH_NO_TRITON=1, as on a "
                                      "machine where Triton does not install)", name=name)
        return None


if _BLOCKED_HERE and "triton" in sys.modules:
    raise RuntimeError("MINIBATCH_NO_TRITON=1, but triton was imported before the blocker was installed")
if _BLOCKED_HERE and not any(type(f).__name__ == "NoTriton" for f in sys.meta_path):
    sys.meta_path.insert(0, NoTriton())
