"""``python -m minibatch serve``: an OpenAI-compatible server on the engine, and a live view of its batch.

Continuous batching exists for one situation: many clients sending requests
at times nobody chooses. This package puts the engine behind the same HTTP
API as ``vllm serve`` so a class can point the official ``openai`` client at
it from several terminals and watch, on the page at ``/``, their requests join
and leave the batch and take and return KV blocks.

The scheduler and the model run in an engine-core process of their own
(``minibatch/engine/core.py``), as in vLLM V1; README.md here tells the split.

    app.py          the FastAPI routes, errors as OpenAI error bodies
    async_llm.py    the front end of the split (vLLM V1's AsyncLLM): streams, detokenising, stats
    core_client.py  the engine-core process's handle: spawn, pipes, a reader thread, death -> 503
    engine_loop.py  --engine-core thread: one thread of this process calls the engine; per-request queues
    protocol.py     request validation (pydantic), response bodies, streamed text deltas
    metrics.py      Prometheus metrics under vLLM's names
    live.py         StepTraces to the live page, as server-sent events
    server.py       the command line, and ServerThread for tests and notebooks
    static/         the live page (SVG, no external resources)
"""


def __getattr__(name):                # lazy: `python -m minibatch generate` never loads FastAPI
    if name == "build_app":
        from minibatch.serve.app import build_app
        return build_app
    if name == "ServerThread":
        from minibatch.serve.server import ServerThread
        return ServerThread
    raise AttributeError(f"module 'minibatch.serve' has no attribute {name!r}")


__all__ = ["build_app", "ServerThread"]
