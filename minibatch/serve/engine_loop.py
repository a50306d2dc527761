"""``--engine-core thread``: one background thread owns the engine; HTTP handlers talk to it through a queue.

(The default puts the engine in a process of its own: ``async_llm.py``, with the same surface. This mode
serves an ``LLM`` built in this process: notebooks, tests, an engine patched with a student's code.)

Why a thread: ``LLMEngine`` is not thread-safe and ``step()`` is blocking
compute (a forward pass), so it can run neither inside the event loop (which
would stall every connection for a whole step) nor from several handlers at
once. So exactly one thread calls ``add_request``, ``step`` and
``abort_request``, as vLLM's ``EngineCore`` busy loop does:

    while serving:
        take every command waiting in the queue (add, abort, call) -- block if idle
        if the engine has unfinished requests: outputs = engine.step()
        hand each RequestOutput to its request's asyncio queue (call_soon_threadsafe)

A handler submits its prompts with ``add`` and awaits the acknowledgement, so
bad input (a prompt over the context, a request that can never fit the cache)
comes back as the engine's own ValueError before any byte of the response is
sent. Whenever the engine falls idle the loop checks the allocator: its
invariants hold and every block is back in the pool; a violation marks the
server unhealthy (``/health`` then answers 503 with the reason).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

from minibatch.engine.core import idle_check

log = logging.getLogger("minibatch.serve")


class ServerOverloaded(RuntimeError):
    """The queue bound is reached: the client should retry later (HTTP 503)."""


class EngineDead(RuntimeError):
    """The engine raised during a step, or the server is shutting down (HTTP 503)."""


@dataclass
class RequestStream:
    """Where one HTTP request's outputs go: RequestOutputs (or an exception) in an asyncio queue."""
    loop: asyncio.AbstractEventLoop
    request_ids: list                                 # engine request ids, one per prompt
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item) -> None:                      # from the engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:                          # the event loop is closed: nobody is listening
            pass


_STOP = object()


class EngineLoop:
    def __init__(self, engine, max_pending_requests: int = 256, metrics=None):
        self.engine = engine
        self.max_pending_requests = max_pending_requests
        self.metrics = metrics
        self.error: Optional[str] = None              # why the server is unhealthy, else None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # unfinished engine request id -> its stream
        self._num_tokens: dict[str, int] = {}       # engine request id -> output tokens so far (all samples)
        self._thread = threading.Thread(target=self._run, name="minibatch-engine-loop", daemon=True)
        self._stopped = threading.Event()

    # -- called from the event loop (any thread) ----------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._cmds.put(_STOP)
            self._thread.join(timeout)

    def add(self, stream: RequestStream, prompts: list, params, arrival_time=None,
            priority: int = 0) -> concurrent.futures.Future:
        """Queue the prompts of one HTTP request (all or none are admitted); the future resolves
        to None once they are in the engine, or raises ValueError / TypeError / ServerOverloaded.
        ``arrival_time`` (perf_counter seconds): when the HTTP request came in, as vLLM's API server stamps it,
        so TTFT includes the wait for the engine thread (a client's load generator sees that wait too)."""
        return self._submit("add", stream, prompts, params, arrival_time, priority)

    def abort(self, request_ids: list) -> None:
        self._cmds.put(("abort", None, list(request_ids)))

    def call(self, fn: Callable) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread, between steps (tests, debugging)."""
        return self._submit("call", fn)

    def _submit(self, kind, *args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopped.is_set() or self.error:
            fut.set_exception(EngineDead(self.error or "the server is shutting down"))
        else:
            self._cmds.put((kind, fut, *args))
            if self._stopped.is_set():                # the loop stopped meanwhile: answer it here
                self._drain_after_stop()
        return fut

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    # -- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            was_busy = False
            while True:
                busy = self.engine.has_unfinished_requests()
                if was_busy and not busy:
                    self._on_idle()
                was_busy = busy
                try:
                    cmd = self._cmds.get(block=not busy)
                    while cmd is not _STOP:
                        self._handle(cmd)
                        cmd = self._cmds.get_nowait()
                    break                                         # _STOP
                except queue.Empty:
                    pass
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as e:                                # a bug in the engine: say so, stop serving
            self.error = f"engine loop failed: {type(e).__name__}: {e}"
            log.error("%s\n%s", self.error, traceback.format_exc())
        finally:
            self._stopped.set()
            for stream in {id(s): s for s in self._streams.values()}.values():
                stream.put(EngineDead(self.error or "the server is shutting down"))
            self._streams.clear()
            self._drain_after_stop()

    def _drain_after_stop(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd is not _STOP and cmd[1] is not None:
                cmd[1].set_exception(EngineDead(self.error or "the server is shutting down"))

    def _handle(self, cmd) -> None:
        kind, fut, *args = cmd
        if kind == "abort":
            self._abort(args[0])
            return
        try:
            fut.set_result(self._add(*args) if kind == "add" else args[0](self.engine))
        except Exception as e:                                    # the handler turns it into a 4xx / 5xx
            fut.set_exception(e)

    def _add(self, stream: RequestStream, prompts: list, params, arrival_time=None, priority: int = 0) -> None:
        if len(self._streams) + len(prompts) > self.max_pending_requests:
            raise ServerOverloaded(f"the server holds {len(self._streams)} unfinished requests, its bound is "
                                   f"{self.max_pending_requests} (--max-pending-requests): retry later")
        added = []
        try:
            for rid, prompt in zip(stream.request_ids, prompts):
                self.engine.add_request(rid, prompt, params, priority=priority, arrival_time=arrival_time)
                added.append(rid)
        except Exception:
            for rid in added:                                     # all or none
                self.engine.abort_request(rid)
            raise
        for rid in added:
            self._streams[rid] = stream

    def _abort(self, request_ids: list) -> None:
        for rid in request_ids:
            if self._streams.pop(rid, None) is None:
                continue                                          # finished already
            self._num_tokens.pop(rid, None)
            try:
                self.engine.abort_request(rid)
            except KeyError:
                continue
            if self.metrics:
                self.metrics.success.labels(self.metrics.model_name, "abort").inc()

    def _step(self) -> None:
        for out in self.engine.step():
            rid = out.request_id
            stream = self._streams.get(rid)
            if stream is None:
                continue
            if self.metrics:
                self._num_tokens[rid] = self.metrics.observe_output(out, self._num_tokens.get(rid))
            stream.put(out)
            if out.finished:
                del self._streams[rid]
                self._num_tokens.pop(rid, None)

    def _on_idle(self) -> None:
        """No unfinished request: every block must be back in the pool (engine/core.py's idle_check)."""
        st = idle_check(self.engine)
        if self.metrics and st["num_blocks"] is not None:
            self.metrics.observe_idle(st["num_free_blocks"], st["num_blocks"])
        if st["error"]:
            self.error = st["error"]
            log.error(self.error)
