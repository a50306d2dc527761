"""``EngineCoreClient``: the front end's handle on the engine-core process (vLLM V1's ``AsyncMPClient``).

It spawns ``EngineCoreProc`` (``minibatch/engine/core.py``) with two one-way pipes, waits until the engine is
built there (or raises the error that stopped it: a bad config fails ``serve`` at start-up, as in the thread
mode). From ``start(loop)`` on, the server's event loop watches the output pipe and takes everything the core
sends:

    ("reply", id, ok, value)   resolves the Future that ``request`` returned
    ("outputs", ...)           on_outputs(EngineCoreOutputs)       (AsyncLLM: to the streams, metrics, live view)
    ("idle", {...})            on_idle(the block pool's check)
    ("dead", why)  or EOF      on_dead(why): the core is gone

A core that dies however it dies (an exception, SIGKILL, the OOM killer) closes the pipe, and the reader
names it at once: "the engine core process (pid N) died (killed by SIGKILL)".
Every Future still waiting then fails with EngineDead, and so does every later request: nothing hangs.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import multiprocessing
import multiprocessing.util                  # noqa: F401  (its exit hook is registered before ours: ours runs first)
import signal
import threading
from typing import Callable

from minibatch.engine.core import EngineCoreProc
from minibatch.serve.engine_loop import EngineDead

log = logging.getLogger("minibatch.serve")


def describe_exit(pid: int, exitcode) -> str:
    if exitcode is None:
        how = "closed its pipe"
    elif exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with status {exitcode}"
    return f"the engine core process (pid {pid}) {how}"


DEAD = "; this server can serve no request until it is restarted"


class EngineCoreClient:
    def __init__(self, make_engine: Callable, on_outputs: Callable, on_idle: Callable, on_dead: Callable):
        """Spawn the core and wait for it to be ready. ``make_engine`` must pickle (a module-level function or
        a functools.partial of one): the spawned process imports it by name and calls it."""
        self.on_outputs, self.on_idle, self.on_dead = on_outputs, on_idle, on_dead
        ctx = multiprocessing.get_context("spawn")       # a fresh interpreter: no forked torch or event-loop state
        core_in, self._input = ctx.Pipe(duplex=False)    # (receiving end, sending end)
        self._output, core_out = ctx.Pipe(duplex=False)
        # Not a daemon: the core may start processes of its own (tensor-parallel workers, a disaggregated pair).
        self.process = ctx.Process(target=EngineCoreProc.run_engine_core, args=(core_in, core_out, make_engine),
                                   name="minibatch-engine-core")
        self.process.start()
        core_in.close()                                  # ours closed, the core's are its only copies: its
        core_out.close()                                 # death closes the output pipe and wakes the reader
        self._ids = itertools.count()
        self._pending: dict = {}                         # call id -> Future
        self._lock = threading.Lock()                    # one writer at a time; _pending
        self._closing = False
        self.dead = None                                 # why the core is gone, once it is
        self.loop = None                                 # the event loop that reads the core's messages
        self._why = None                                 # the core's last word ("dead"), if it said one
        self._reading = False
        atexit.register(self.shutdown)
        try:
            msg = self._output.recv()
        except EOFError:
            self.process.join(5)
            self.shutdown()
            raise RuntimeError(describe_exit(self.process.pid, self.process.exitcode) + " while it started (its "
                               "error is printed above)") from None
        if msg[0] == "failed":
            _, exc, tb = msg
            log.debug("the engine core could not start:\n%s", tb)
            self.shutdown()
            raise exc
        self.info = msg[1]                               # {"max_model_len": ...}

    def start(self, loop=None) -> None:
        """Read the core's messages from now on: in ``loop`` (the server's event loop watches the pipe, as vLLM's
        output_handler task awaits its socket: one thread does all the front end's work, so no GIL passes between
        two of them), else, or where the loop cannot watch a pipe, in a thread of their own."""
        if self._reading:
            return
        self._reading = True
        if loop is not None:
            try:
                loop.add_reader(self._output.fileno(), self._on_readable)
                self.loop = loop
                return
            except NotImplementedError:                  # Windows' proactor loop
                pass
        threading.Thread(target=self._read_loop, name="minibatch-engine-core-output", daemon=True).start()

    # -- the front end's side ------------------------------------------------------------
    def request(self, kind: str, payload) -> concurrent.futures.Future:
        """("add", [EngineCoreRequest]) or ("call", fn): a Future of the core's reply."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.dead or self._closing:
                fut.set_exception(EngineDead(self.dead or "the server is shutting down"))
                return fut
            call_id = next(self._ids)
            self._pending[call_id] = fut
            try:
                self._input.send((kind, call_id, payload))
            except (BrokenPipeError, ConnectionError, OSError):
                self._pending.pop(call_id, None)          # the reader is about to report the death
                fut.set_exception(EngineDead(self.dead or describe_exit(self.process.pid, self.process.exitcode) + DEAD))
            except Exception as e:                        # it does not pickle (a lambda for a call): say so
                self._pending.pop(call_id, None)
                fut.set_exception(TypeError(f"cannot send {kind!r} to the engine core process: {e}"))
        return fut

    def abort(self, request_ids: list) -> None:
        with self._lock:
            if self.dead or self._closing:
                return
            try:
                self._input.send(("abort", None, list(request_ids)))
            except (BrokenPipeError, ConnectionError, OSError):
                pass

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, then make sure it has (terminate, then kill)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            try:
                self._input.send(("shutdown",))
            except Exception:
                pass
        if self.loop is not None and not self.loop.is_closed():
            try:
                if asyncio.get_running_loop() is self.loop:      # the server's lifespan: stop watching the pipe
                    self.loop.remove_reader(self._output.fileno())
            except (RuntimeError, ValueError, OSError):
                pass
        p = self.process
        p.join(timeout)
        if p.is_alive():
            log.warning("the engine core did not stop in %.0f s: terminating it", timeout)
            p.terminate()
            p.join(3)
            if p.is_alive():
                p.kill()
                p.join(3)
        self._input.close()
        atexit.unregister(self.shutdown)

    @property
    def closing(self) -> bool:
        """True once shutdown() began: the end of the core is then no death."""
        return self._closing

    # -- the reader thread ---------------------------------------------------------------
    def _dispatch(self, msg) -> None:
        kind = msg[0]
        if kind == "reply":
            _, call_id, ok, value = msg
            with self._lock:
                fut = self._pending.pop(call_id, None)
            if fut is not None:
                fut.set_result(value) if ok else fut.set_exception(value)
        elif kind == "outputs":
            self.on_outputs(msg[1])
        elif kind == "idle":
            self.on_idle(msg[1])
        elif kind == "dead":
            self._why = msg[1]

    def _on_readable(self) -> None:                      # in the event loop: every message that has come
        try:
            while self._output.poll():
                self._dispatch(self._output.recv())
        except (EOFError, OSError):
            self.loop.remove_reader(self._output.fileno())
            self._gone(None)
        except BaseException as e:                       # a bug on this side: the streams must still end
            log.exception("the front end's reader of the engine core failed")
            self.loop.remove_reader(self._output.fileno())
            self._gone(f"the front end's reader of the engine core failed: {type(e).__name__}: {e}")

    def _read_loop(self) -> None:                        # in a thread of its own
        why = None
        try:
            while True:
                self._dispatch(self._output.recv())
        except (EOFError, OSError):
            pass
        except BaseException as e:
            log.exception("the front end's reader of the engine core failed")
            why = f"the front end's reader of the engine core failed: {type(e).__name__}: {e}"
        self._gone(why)

    def _gone(self, why) -> None:
        """The output pipe closed: the core exited (asked to, or not). Fail everything waiting; tell on_dead."""
        self.process.join(1)                             # it closed the pipe by exiting: the exit code is near
        with self._lock:
            why = why or self._why
            if why is None:
                why = "the server is shutting down" if self._closing else \
                    describe_exit(self.process.pid, self.process.exitcode) + DEAD
            self.dead = why
            pending, self._pending = list(self._pending.values()), {}
        for fut in pending:
            fut.set_exception(EngineDead(why))
        if not self._closing:
            log.error(why)
        self.on_dead(why)
