"""minibatch: an educational, step-through reference implementation of LLM serving.

The public entry points mirror vLLM's: ``LLM`` and ``SamplingParams`` for whole
prompt lists, ``LLMEngine`` for one iteration at a time. The rooms:
``engine/`` (scheduling and the step loop), ``kv/`` (the paged KV cache),
``spec_decode/`` (speculative decoding), ``model/`` (the tiny GPT and its weights),
``viz/`` (drawing the step traces), ``bench/`` (workloads, benchmarks, demos).
"""
from minibatch.engine.sampler import SamplingParams


def __getattr__(name):                    # lazy: `import minibatch` stays cheap and import-cycle free
    if name == "LLM":
        from minibatch.engine.llm import LLM
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
