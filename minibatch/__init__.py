"""minibatch: an educational, step-through reference implementation of LLM serving.

The public entry points mirror vLLM's: ``LLM`` and ``SamplingParams`` for whole
prompt lists, ``LLMEngine`` for one iteration at a time.
"""
from .sampler import SamplingParams


def __getattr__(name):                    # lazy: `import minibatch` stays cheap and import-cycle free
    if name == "LLM":
        from .llm import LLM
        return LLM
    if name in ("LLMEngine", "EngineConfig"):
        from . import engine
        return getattr(engine, name)
    if name == "TraceRecorder":
        from .trace import TraceRecorder
        return TraceRecorder
    raise AttributeError(f"module 'minibatch' has no attribute {name!r}")


__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "TraceRecorder"]
