"""``AsyncLLM``: the front end's side of the split (vLLM V1's ``AsyncLLM`` with its ``OutputProcessor``).

    HTTP handler ──add(stream, prompts)──> AsyncLLM ──EngineCoreClient──> engine-core process (engine/core.py)
    HTTP handler <──RequestOutput (queue)── AsyncLLM <──EngineCoreOutputs── (new tokens, the step's trace)

It has the surface of the thread mode's ``EngineLoop`` (``add``, ``abort``, ``call``, ``error``, ``start``,
``stop``), so the routes (``app.py``) serve either. What it does in this process:

* admission: past ``max_pending_requests`` unfinished requests, ServerOverloaded (503) without asking the core;
* output processing: each ``EngineCoreOutput`` carries a sample's new token ids; this side keeps the ids so far,
  turns them into text and hands a ``RequestOutput`` (the one the thread mode hands) to the request's queue;
* statistics: the step's ``StepTrace`` goes to the hooks (``/metrics``' gauges, the live view), each output to
  the per-request histograms (TTFT, TPOT, ...): every step the core takes is seen here;
* faults: a dead core ends every open stream with EngineDead (503, naming the engine core), and fails every
  later request the same way, at once.

All of it runs in the server's event loop, which watches the core's output pipe (``EngineCoreClient.start``):
one thread does the front end's work, so no GIL passes between two of its threads (the thread mode's trouble,
on a smaller scale). Each piece is short: a step's outputs for 32 requests are a few hundred microseconds.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Callable, Optional

from minibatch.engine.core import EngineCoreRequest
from minibatch.engine.outputs import CompletionOutput, RequestOutput
from minibatch.model.tokenizer import decode
from minibatch.serve.core_client import EngineCoreClient
from minibatch.serve.engine_loop import EngineDead, RequestStream, ServerOverloaded

log = logging.getLogger("minibatch.serve")


class RequestState:
    """One engine request as the front end holds it: the prompt, and each sample's ids (and logprobs) so far."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.prompt, self.prompt_token_ids, self.prompt_logprobs = None, None, None
        self.samples: dict = {}             # index -> [token ids, logprobs or None, finish reason, spec]
        self.num_counted: Optional[int] = None  # output tokens counted in /metrics (None: no output yet)

    def update(self, o) -> RequestOutput:
        """Apply one EngineCoreOutput; the RequestOutput as it stands (fresh lists: the handler reads it later)."""
        if o.prompt_token_ids is not None:
            self.prompt, self.prompt_token_ids, self.prompt_logprobs = o.prompt, o.prompt_token_ids, o.prompt_logprobs
        for d in o.samples:
            s = self.samples.setdefault(d.index, [[], None if d.new_logprobs is None else [], None, None])
            del s[0][d.start:]
            s[0].extend(d.new_token_ids)
            if d.new_logprobs is not None:
                del s[1][d.start:]
                s[1].extend(d.new_logprobs)
            s[2], s[3] = d.finish_reason, d.spec
        outs = [CompletionOutput(i, decode(ids), list(ids), reason, spec, None if lps is None else list(lps))
                for i, (ids, lps, reason, spec) in sorted(self.samples.items())]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, o.finished, o.metrics,
                             self.prompt_logprobs)


class AsyncLLM:
    def __init__(self, make_engine: Callable, max_pending_requests: int = 256, metrics=None, hooks=()):
        """Start the engine core (``make_engine()`` runs there and returns an LLM or an LLMEngine); returns when
        it is ready, or raises what stopped it."""
        self.max_pending_requests = max_pending_requests
        self.metrics = metrics
        self.hooks = list(hooks)                     # fn(StepTrace) for every step of the core
        self.on_dead: list = []                      # fn(why) once the core is gone (serve: exit after a grace)
        self.error: Optional[str] = None             # why the server is unhealthy, else None
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}  # unfinished engine request id -> its stream
        self._states: dict[str, RequestState] = {}
        self.client = EngineCoreClient(make_engine, self._on_outputs, self._on_idle, self._on_dead)
        self.max_model_len = self.client.info["max_model_len"]

    @property
    def process(self):
        """The engine core's ``multiprocessing.Process`` (its pid, whether it lives)."""
        return self.client.process

    # -- called from the event loop (any thread) ----------------------------------------
    def start(self) -> None:
        """In the server's event loop (its lifespan): read the core's outputs there from now on."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None                               # no loop: a thread reads them
        self.client.start(loop)

    def stop(self, timeout: float = 10.0) -> None:
        self.client.shutdown(timeout)

    def add(self, stream: RequestStream, prompts: list, params, arrival_time=None,
            priority: int = 0) -> concurrent.futures.Future:
        """As ``EngineLoop.add``: a Future that resolves to None once every prompt is in the engine, or raises
        ValueError / TypeError (the engine's own message), ServerOverloaded or EngineDead."""
        with self._lock:
            if self.error:
                return _failed(EngineDead(self.error))
            if len(self._streams) + len(prompts) > self.max_pending_requests:
                return _failed(ServerOverloaded(
                    f"the server holds {len(self._streams)} unfinished requests, its bound is "
                    f"{self.max_pending_requests} (--max-pending-requests): retry later"))
            for rid in stream.request_ids:           # before the core can answer: no output finds no stream
                self._streams[rid], self._states[rid] = stream, RequestState(rid)
        fut = self.client.request("add", [EngineCoreRequest(rid, p, params, arrival_time, priority)
                                          for rid, p in zip(stream.request_ids, prompts)])
        fut.add_done_callback(lambda f: f.exception() is not None and self._forget(stream.request_ids))
        return fut

    def abort(self, request_ids: list) -> None:
        """Abort the unfinished ones among ``request_ids`` (finished ones cost nothing: no message goes)."""
        unfinished = self._forget(request_ids)
        if unfinished:
            self.client.abort(unfinished)
            if self.metrics:
                self.metrics.success.labels(self.metrics.model_name, "abort").inc(len(unfinished))

    def call(self, fn: Callable) -> concurrent.futures.Future:
        """Run ``fn(engine)`` in the core, between steps; ``fn`` must pickle (a module-level function)."""
        return self.client.request("call", fn)

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    def _forget(self, request_ids) -> list:
        with self._lock:
            gone = [rid for rid in request_ids if self._streams.pop(rid, None) is not None]
            for rid in gone:
                self._states.pop(rid, None)
        return gone

    # -- the client's reader thread ------------------------------------------------------
    def _on_outputs(self, outs) -> None:
        for trace in outs.traces:
            for hook in self.hooks:
                hook(trace)
        for o in outs.outputs:
            with self._lock:
                stream, state = self._streams.get(o.request_id), self._states.get(o.request_id)
                if stream is None:
                    continue                          # aborted meanwhile
                if o.finished:
                    del self._streams[o.request_id], self._states[o.request_id]
            out = state.update(o)
            if self.metrics:
                state.num_counted = self.metrics.observe_output(out, state.num_counted)
            if self.client.loop is stream.loop:
                stream.queue.put_nowait(out)          # we are on its loop already
            else:
                stream.put(out)

    def _on_idle(self, st: dict) -> None:
        if self.metrics and st["num_blocks"] is not None:
            self.metrics.observe_idle(st["num_free_blocks"], st["num_blocks"])
        if st["error"]:
            self.error = st["error"]
            log.error(self.error)

    def _on_dead(self, why: str) -> None:
        with self._lock:
            self.error = self.error or why
            streams = {id(s): s for s in self._streams.values()}.values()
            self._streams.clear()
            self._states.clear()
        for s in streams:
            s.put(EngineDead(why))
        if not self.client.closing:                  # a death, not a shutdown
            for fn in self.on_dead:
                fn(why)


def _failed(exc) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_exception(exc)
    return fut
