"""The engine core: the scheduler and the model behind a message interface, in a process of its own (vLLM V1's).

``python -m minibatch serve`` splits like vLLM V1. The front end (``minibatch/serve/``: HTTP, detokenising,
streaming, metrics) runs in one process; this module's ``EngineCoreProc`` runs the engine in another, so the
event loop never waits for the engine's GIL, nor the engine for the event loop's:

    front end (serve/async_llm.py AsyncLLM)                 engine core (this file)
      EngineCoreClient ──input pipe──>  EngineCoreRequest  ──>  EngineCoreProc.run_busy_loop()
                       <─output pipe──  EngineCoreOutputs  <──    EngineCore.step()

Two one-way pipes (``multiprocessing``, spawn context), as vLLM's input and output ZMQ sockets. What goes in:

    ("add", call_id, [EngineCoreRequest])   the prompts of one HTTP request: all or none; a reply
    ("abort", None, [request_id])           a client went away: free its blocks at once; no reply
    ("call", call_id, fn)                   fn(engine) between steps (tests, debugging); a reply
    ("shutdown",)

What comes out:

    ("ready", {"max_model_len": ...})       once, after the engine is built (the weights load here)
    ("failed", exception, traceback text)   ... or why it could not be (a bad config): the front end raises it
    ("reply", call_id, ok, value)           the answer to an add or a call (value: the exception when not ok)
    ("outputs", EngineCoreOutputs)          after every step: what changed, and the step's trace
    ("idle", {...})                         the engine fell idle: the block pool's check and counts
    ("dead", message)                       the busy loop raised: the core stops; the front end answers 503

An ``EngineCoreOutput`` carries only what is new for a request (vLLM's ``new_token_ids``): each sample's tokens
past those already sent, from ``start`` (a stop string can cut tokens sent earlier, so ``start`` may step back),
and the request's timings. The front end keeps the rest and turns ids into text (``serve/async_llm.py``). The
busy loop is one thread: take every waiting command, step if anything is unfinished, send the outputs;
with nothing to do it blocks on the input pipe. (vLLM moves the serialisation to two I/O threads beside the
loop; at this model's size the pickling is a small part of a step.)

The core stops when told, when its input pipe closes (the front end is gone, however it went) and on an
error inside the loop, which it reports first. Ctrl-C goes to the front end, which shuts the core down.
"""
from __future__ import annotations

import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

from minibatch.engine.outputs import RequestMetrics


@dataclass
class EngineCoreRequest:
    """One prompt to add (an HTTP request with several prompts sends several, added all or none)."""
    request_id: str
    prompt: object                      # str or a list of token ids
    params: object                      # SamplingParams
    arrival_time: Optional[float] = None  # time.perf_counter() in the front end: CLOCK_MONOTONIC, one clock for
    priority: int = 0                     # every process of the machine, so TTFT counts the trip to the core


@dataclass
class SampleDelta:
    """One sample's news: its token ids are ``ids[:start] + new_token_ids`` (logprobs alike)."""
    index: int
    start: int
    new_token_ids: list
    new_logprobs: Optional[list] = None
    finish_reason: Optional[str] = None
    spec: Optional[dict] = None


@dataclass
class EngineCoreOutput:
    request_id: str
    samples: list                       # [SampleDelta]
    finished: bool
    metrics: RequestMetrics
    prompt: Optional[str] = None        # only in a request's first output (the front end keeps them)
    prompt_token_ids: Optional[list] = None
    prompt_logprobs: Optional[list] = None


@dataclass
class EngineCoreOutputs:
    outputs: list = field(default_factory=list)     # [EngineCoreOutput]
    traces: list = field(default_factory=list)      # the step's StepTraces: /metrics and the live view
    timestamp: float = 0.0


class EngineCore:
    """The engine behind requests and deltas; no process, no pipe (the thread server and tests can use it)."""

    def __init__(self, engine):
        self.engine = engine
        self._sent: dict = {}               # request id -> {sample index: tokens already sent}
        self._traces: list = []
        engine.add_hook(self._traces.append)

    def add_requests(self, requests: list) -> None:
        """All or none: one bad prompt of several leaves none of them in the engine, and raises its error."""
        added = []
        try:
            for r in requests:
                self.engine.add_request(r.request_id, r.prompt, r.params, priority=r.priority,
                                        arrival_time=r.arrival_time)
                added.append(r.request_id)
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        for rid in added:
            self._sent[rid] = None          # None: nothing sent yet, the first output carries the prompt

    def abort_requests(self, request_ids: list) -> None:
        for rid in request_ids:
            if self._sent.pop(rid, False) is False:
                continue                    # finished (or aborted) already
            try:
                self.engine.abort_request(rid)
            except KeyError:
                pass

    def step(self) -> EngineCoreOutputs:
        outs = EngineCoreOutputs()
        for out in self.engine.step():
            rid = out.request_id
            if rid not in self._sent:
                continue
            sent, first = self._sent[rid] or {}, self._sent[rid] is None
            samples = []
            for o in out.outputs:
                start = min(sent.get(o.index, 0), len(o.token_ids))
                samples.append(SampleDelta(o.index, start, o.token_ids[start:],
                                           None if o.logprobs is None else o.logprobs[start:], o.finish_reason,
                                           o.spec))
                sent[o.index] = len(o.token_ids)
            outs.outputs.append(EngineCoreOutput(rid, samples, out.finished, out.metrics,
                                                 *((out.prompt, out.prompt_token_ids, out.prompt_logprobs)
                                                   if first else ())))
            if out.finished:
                del self._sent[rid]
            else:
                self._sent[rid] = sent
        outs.traces, self._traces[:] = list(self._traces), []
        outs.timestamp = time.perf_counter()
        return outs

    def idle_check(self) -> dict:
        return idle_check(self.engine)


def idle_check(engine) -> dict:
    """No unfinished request: every block must be back in the pool (cached-free counts as free).
    {"error": why not or None, "num_free_blocks", "num_blocks"}: the thread server and the core both ask this."""
    if hasattr(engine, "pool_stats"):       # disaggregated: each instance checks its own pool
        for name, st in engine.pool_stats().items():
            if st["num_free_blocks"] != st["num_blocks"]:
                return {"error": f"the {name} instance holds {st['num_blocks'] - st['num_free_blocks']} blocks "
                                 f"with no request left", "num_free_blocks": None, "num_blocks": None}
        return {"error": None, "num_free_blocks": None, "num_blocks": None}
    a = engine.allocator
    out = {"error": None, "num_free_blocks": a.num_free_blocks, "num_blocks": a.num_blocks}
    try:
        a.check_invariants()
        if a.num_free_blocks != a.num_blocks:
            raise AssertionError(f"{a.num_blocks - a.num_free_blocks} blocks still in use with no request left")
    except AssertionError as e:
        out["error"] = f"block allocator check failed while idle: {e}"
    return out


def engine_state(engine) -> dict:
    """What a test asks the core between steps (``client.call(engine_state)``): requests and blocks."""
    st = {"num_unfinished_requests": len(engine.requests), "has_unfinished": engine.has_unfinished_requests()}
    if hasattr(engine, "allocator"):
        engine.allocator.check_invariants()
        st |= {"num_free_blocks": engine.allocator.num_free_blocks, "num_blocks": engine.allocator.num_blocks}
    return st


class EngineCoreProc(EngineCore):
    """The engine core as a process: a busy loop over two pipes. Start it with ``run_engine_core``."""

    def __init__(self, engine, input_conn, output_conn):
        super().__init__(engine)
        self.input, self.output = input_conn, output_conn

    @staticmethod
    def run_engine_core(input_conn, output_conn, make_engine: Callable) -> None:
        """The process's target: build the engine here (the weights load in this process), say ready or why
        not, then serve until shut down. ``make_engine()`` returns an LLMEngine or an LLM (``.llm_engine``)."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)        # Ctrl-C is the front end's: it shuts us down
        try:
            made = make_engine()
            engine = getattr(made, "llm_engine", made)
            core = EngineCoreProc(engine, input_conn, output_conn)
        except BaseException as e:
            tb = traceback.format_exc()
            try:
                output_conn.send(("failed", e, tb))
            except Exception:                               # an exception that does not pickle: its text
                output_conn.send(("failed", RuntimeError(f"{type(e).__name__}: {e}"), tb))
            return
        output_conn.send(("ready", {"max_model_len": engine.model.config.n_ctx}))
        try:
            core.run_busy_loop()
        finally:
            if hasattr(engine, "shutdown"):
                engine.shutdown()

    def run_busy_loop(self) -> None:
        try:
            busy = False
            while True:
                # Nothing unfinished: block until a command comes. Otherwise take the waiting ones, then step.
                while not self.engine.has_unfinished_requests() or self.input.poll(0):
                    try:
                        msg = self.input.recv()
                    except EOFError:                        # the front end is gone, however it went
                        return
                    if msg[0] == "shutdown":
                        return
                    self._handle(*msg)
                    busy = self._report_idle(busy)
                self.output.send(("outputs", self.step()))
                busy = self._report_idle(True)
        except (BrokenPipeError, EOFError):                 # the front end is gone: nobody to tell
            return
        except BaseException as e:                          # a bug in the engine: say so, stop serving
            msg = f"the engine core failed: {type(e).__name__}: {e}"
            traceback.print_exc()
            try:
                self.output.send(("dead", msg))
            except Exception:
                pass
            raise SystemExit(1)

    def _report_idle(self, was_busy: bool) -> bool:
        """Whenever the engine falls idle (its last request finished or aborted), check the block pool."""
        busy = self.engine.has_unfinished_requests()
        if was_busy and not busy:
            self.output.send(("idle", self.idle_check()))
        return busy

    def _handle(self, kind, call_id, arg) -> None:
        if kind == "abort":
            self.abort_requests(arg)
            return
        try:
            value = self.add_requests(arg) if kind == "add" else arg(self.engine)
            reply = ("reply", call_id, True, value)
        except Exception as e:                              # the front end turns it into a 4xx / 5xx
            reply = ("reply", call_id, False, e)
        try:
            self.output.send(reply)
        except (BrokenPipeError, EOFError):
            raise
        except Exception as e:                              # a value or an exception that does not pickle
            self.output.send(("reply", call_id, False, RuntimeError(f"unpicklable reply: {type(e).__name__}: {e}")))
