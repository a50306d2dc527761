"""The HTTP layer: OpenAI's completions API (as ``vllm serve`` offers it) over one ``LLMEngine``.

    POST /v1/completions   streaming (server-sent events, OpenAI chunks, then [DONE]) or one JSON body
    GET  /v1/models        the one served model
    GET  /health           200 while the engine loop is sound, 503 with the reason once it is not
    GET  /metrics          Prometheus text, vLLM's metric names (minibatch.serve.metrics)
    POST /tokenize         vLLM's: {"prompt"} -> {"tokens", "count", "max_model_len"} (bytes: a token per byte)
    POST /detokenize       vLLM's: {"tokens"} -> {"prompt"}
    GET  /tokenizer_info   vLLM's: the special tokens (a byte model has none); lm-eval's "remote" tokenizer
    GET  /                 the live view: batch timeline, block pool (and radix tree), drawn from StepTraces
    GET  /live/events      those StepTraces, as server-sent events (?after=STEP: only later steps)

Handlers never touch the engine: they hand prompts to the engine core, in a
process of its own (``async_llm.py``, the default) or in a thread of this one
(``engine_loop.py``), and read their outputs from an asyncio queue. Every error
is an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``:
400 for bad input (bad JSON, unknown fields, bad values, a prompt over the
context, a request that can never fit the cache), 404 for an unknown model,
503 when the queue bound is reached or the engine core is gone (the message
names it). A client that goes away (a closed stream, a timed-out request) has
its requests aborted, so their blocks return to the pool at the next step.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from minibatch.model.tokenizer import decode, encode
from minibatch.serve import protocol as P
from minibatch.serve.engine_loop import EngineDead, EngineLoop, RequestStream, ServerOverloaded
from minibatch.serve.live import LiveFeed, live_page
from minibatch.serve.metrics import ServerMetrics

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                503: "server_overloaded"}


def error(status: int, message: str, param=None, type_=None) -> JSONResponse:
    return JSONResponse(P.error_body(message, type_ or _ERROR_TYPES.get(status, "server_error"), param, status),
                        status_code=status)


class _AbortOnClose(StreamingResponse):
    """A streaming response that aborts its engine requests however it ends (done, client gone, error).
    Aborting a finished request is a no-op, so this is safe on every path."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


ENGINE_CORES = ("process", "thread")


class ArrivalStamp:
    """Pure ASGI middleware, outermost: a request's arrival is stamped when its first bytes reach the app, before
    its body is read, routed and validated, so the server's own TTFT (vllm:time_to_first_token_seconds) covers
    the time the server spends on it (issue: a client's TTFT exceeded the server's by the parsing it skipped)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival"] = time.perf_counter()
        await self.app(scope, receive, send)


def build_app(llm, served_model_name: str = "target", max_pending_requests: int = 256,
              engine_core: Optional[str] = None) -> FastAPI:
    """A FastAPI app serving an engine; the engine runs while the app is up.

    ``engine_core="process"`` (the default when ``llm`` is a function): ``llm`` is a picklable function that makes
    a ``minibatch.LLM`` (``functools.partial(LLM, "target", device="cpu")``), called in the engine-core process
    (``async_llm.py``); this returns once the engine is built there, or raises what stopped it.
    ``engine_core="thread"`` (the default when ``llm`` is an ``LLM``): the engine runs in a thread of this process
    (``engine_loop.py``), as notebooks and most tests use it; a function is called here."""
    built = hasattr(llm, "llm_engine")
    engine_core = engine_core or ("thread" if built else "process")
    if engine_core not in ENGINE_CORES:
        raise ValueError(f"engine_core must be one of {list(ENGINE_CORES)}, got {engine_core!r}")
    metrics = ServerMetrics(served_model_name)
    feed = LiveFeed()
    if engine_core == "thread":
        llm = llm if built else llm()
        engine = llm.llm_engine
        max_model_len = llm.model.config.n_ctx
        engine.add_hook(metrics.observe_step)
        engine.add_hook(feed)
        loop_ = EngineLoop(engine, max_pending_requests, metrics)
    else:
        if built:
            raise ValueError("engine_core='process' builds the engine in a process of its own: pass a picklable "
                             "function that makes the LLM (functools.partial(LLM, 'target', ...)), not an LLM")
        from minibatch.serve.async_llm import AsyncLLM
        loop_ = AsyncLLM(llm, max_pending_requests, metrics, hooks=[metrics.observe_step, feed])
        max_model_len = loop_.max_model_len
    counter = itertools.count()

    @asynccontextmanager
    async def lifespan(app):
        loop_.start()
        try:
            yield
        finally:
            feed.close()
            loop_.stop()

    app = FastAPI(title="minibatch", lifespan=lifespan)
    app.state.engine_loop, app.state.metrics, app.state.feed = loop_, metrics, feed
    app.add_middleware(ArrivalStamp)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        message, param = P.validation_message(exc.errors())
        return error(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health():
        if loop_.error:
            return error(503, loop_.error, type_="server_error")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": P.now(),
                                            "owned_by": "minibatch", "root": served_model_name,
                                            "max_model_len": max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: P.TokenizeRequest):
        tokens = encode(body.prompt)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: P.DetokenizeRequest):
        return {"prompt": decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {"tokenizer_class": "minibatch.model.tokenizer (bytes)", "vocab_size": 256, "eos_token": None,
                "bos_token": None, "pad_token": None, "model_max_length": max_model_len}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def live():
        return live_page(served_model_name, feed.backlog())

    @app.get("/live/events")
    async def live_events(after: int = -1):
        async def sse():
            yield ": minibatch live view\n\n"
            async for data in feed.events(after):
                yield f"data: {data}\n\n"
        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        arrival = getattr(request.state, "arrival", None) or time.perf_counter()   # stamped at the ASGI entry
        if body.model is not None and body.model != served_model_name:
            return error(404, f"The model `{body.model}` does not exist; this server serves "
                              f"`{served_model_name}`.", "model", "not_found_error")
        prompts = body.prompts()
        max_tokens = body.max_tokens
        if max_tokens is None:                     # OpenAI's null: as many as the context leaves
            longest = max(len(encode(p)) if isinstance(p, str) else len(p) for p in prompts)
            max_tokens = max(1, max_model_len - longest)
        try:
            params = body.sampling_params(max_tokens)
        except ValueError as e:
            return error(400, str(e), str(e).split(" ", 1)[0])
        k = next(counter)
        cmpl_id = f"cmpl-{k}"
        rids = [cmpl_id] if len(prompts) == 1 else [f"{cmpl_id}-{i}" for i in range(len(prompts))]
        stream = RequestStream(asyncio.get_running_loop(), rids)
        try:
            await asyncio.wrap_future(loop_.add(stream, prompts, params, arrival))
        except (ValueError, TypeError) as e:
            return error(400, str(e))
        except (ServerOverloaded, EngineDead) as e:
            return error(503, str(e), type_="server_overloaded" if isinstance(e, ServerOverloaded) else
                         "server_error")
        job = _Job(cmpl_id, served_model_name, rids, params, body)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            continuous = bool(usage and body.stream_options.continuous_usage_stats)
            return _AbortOnClose(job.sse(stream, usage, continuous), lambda: loop_.abort(rids))
        collect = asyncio.ensure_future(job.collect(stream))
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not collect.done():
                collect.cancel()
            gone.cancel()
            loop_.abort(rids)                      # a no-op for finished requests
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)       # nginx's "client closed request"; nobody reads it
        if collect.exception() is not None:
            return error(503, str(collect.exception()), type_="server_error")
        return collect.result()

    return app


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body is read already, so receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Job:
    """One completions request in flight: its engine requests and how their outputs become choices."""

    def __init__(self, cmpl_id, model, rids, params, body: P.CompletionRequest):
        self.id, self.model, self.params, self.ret_ids = cmpl_id, model, params, body.return_token_ids
        self.index = {rid: i for i, rid in enumerate(rids)}     # engine request id -> prompt index
        self.echo, self.num_logprobs, self.score_only = body.echo, body.logprobs, body.max_tokens == 0
        self.num_prompt_logprobs = body.prompt_logprobs           # may be fewer than echo's logprobs asked the engine

    def _final_choice(self, rid, out, o) -> dict:
        """One finished choice: its text (after the prompt, with echo), and its logprobs when asked."""
        ids, entries = ([], []) if self.score_only else (list(o.token_ids), o.logprobs or [])
        reason = "length" if self.score_only else o.finish_reason
        if self.echo:
            prompt = list(out.prompt_token_ids)
            ids, entries = prompt + ids, (out.prompt_logprobs or [None] * len(prompt)) + entries
        lp = None if self.num_logprobs is None else P.completion_logprobs(ids, entries, self.num_logprobs)
        c = P.choice(self._choice_index(rid, o), decode(ids), reason, ids if self.ret_ids else None, lp)
        if self.num_prompt_logprobs is not None:   # vLLM's extension: {token id: {logprob, rank, decoded_token}}
            n = self.num_prompt_logprobs
            c["prompt_logprobs"] = [None if e is None else {str(t): vars(v) for t, v in e.items()
                                                            if v.rank <= n or t == tok}
                                    for e, tok in zip(out.prompt_logprobs, out.prompt_token_ids)]
        return c

    def _choice_index(self, rid, output) -> int:
        return self.index[rid] * self.params.n + output.index

    async def collect(self, stream: RequestStream) -> dict:
        final = {}
        while len(final) < len(self.index):
            out = await stream.queue.get()
            if isinstance(out, BaseException):
                raise out
            if out.finished:
                final[out.request_id] = out
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for rid, out in sorted(final.items(), key=lambda kv: self.index[kv[0]]):
            prompt_tokens += len(out.prompt_token_ids)
            for o in out.outputs:
                completion_tokens += 0 if self.score_only else len(o.token_ids)
                choices.append(self._final_choice(rid, out, o))
        return P.completion_body(self.id, self.model, choices, P.usage(prompt_tokens, completion_tokens))

    async def sse(self, stream: RequestStream, include_usage: bool, continuous: bool = False):
        deltas, done_choices, finished, prompt_tokens, completion_tokens = {}, set(), set(), 0, 0
        while len(finished) < len(self.index):
            out = await stream.queue.get()
            if isinstance(out, BaseException):
                yield _event(P.error_body(str(out), "server_error", None, 503))
                return
            for o in out.outputs:
                key = self._choice_index(out.request_id, o)
                if key in done_choices:
                    continue
                delta = deltas.setdefault(key, P.TextDelta(self.params.stop))
                done = o.finish_reason is not None
                start, offset = delta.sent, len(decode(o.token_ids[:delta.sent]))
                text, ids = delta.update(o.token_ids, done)
                if done:
                    done_choices.add(key)
                if text or ids or done:
                    lp = None if self.num_logprobs is None else P.completion_logprobs(
                        ids, (o.logprobs or [])[start:start + len(ids)], self.num_logprobs, offset)
                    c = P.choice(key, text, o.finish_reason, ids if self.ret_ids else None, lp)
                    body = P.completion_body(self.id, self.model, [c], None)
                    if include_usage:
                        body["usage"] = P.usage(len(out.prompt_token_ids), len(o.token_ids)) if continuous else None
                    yield _event(body)
            if out.finished:
                finished.add(out.request_id)
                prompt_tokens += len(out.prompt_token_ids)
                completion_tokens += sum(len(o.token_ids) for o in out.outputs)
        if include_usage:
            yield _event(P.completion_body(self.id, self.model, [], P.usage(prompt_tokens, completion_tokens)))
        yield "data: [DONE]\n\n"


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"
