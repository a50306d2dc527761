"""The engine room: requests in, one iteration per ``step()``, outputs back.

Follow one request: ``minibatch/llm.py`` (LLM.generate, one room above) -> ``engine.py`` (LLMEngine.add_request / step) ->
``scheduler.py`` (schedule, update_from_output; the queue in ``request_queue.py``, the state in
``sequence.py``) -> ``model_runner.py`` (the flat batch, the forward, ``sampler.py``) -> ``outputs.py``.
"""


def __getattr__(name):                 # lazy, so that importing one module of the room loads only what it needs
    if name in ("LLMEngine",):
        from minibatch.engine.engine import LLMEngine
        return LLMEngine
    if name == "EngineConfig":
        from minibatch.engine.config import EngineConfig
        return EngineConfig
    raise AttributeError(f"module 'minibatch.engine' has no attribute {name!r}")
