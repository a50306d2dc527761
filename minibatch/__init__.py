"""minibatch: an educational, step-through reference implementation of LLM serving.

The public entry points mirror vLLM's: ``LLM`` and ``SamplingParams`` for whole
prompt lists, ``LLMEngine`` for one iteration at a time.
"""
from minibatch.engine.sampler import SamplingParams


def __getattr__(name):                    # lazy: `import minibatch` stays cheap and import-cycle free
    if name == "LLM":
        from minibatch.engine.llm import LLM
        return LLM
    if name in ("LLMEngine", "EngineConfig"):
        from . import engine
        return getattr(engine, name)
    if name == "TraceRecorder":
        from minibatch.trace import TraceRecorder
        return TraceRecorder
    raise AttributeError(f"module 'minibatch' has no attribute {name!r}")


__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "TraceRecorder"]
