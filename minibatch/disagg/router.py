"""The router in front of a disaggregated pair: ``LLMEngine``'s surface over two instance processes.

``add_request`` checks a request as an engine would (once, here, at the boundary) and sends it to the
prefill instance; ``step`` collects what the instances report (first tokens from the prefill instance, the
rest from the decode instance, their step traces and the KV transfers) and returns the ``RequestOutput``s
that changed, as ``LLMEngine.step`` does. ``disagg.py`` holds the instances.
"""
from __future__ import annotations

import time
import weakref
from typing import Callable, Optional

from minibatch.distributed import comm
from minibatch.disagg.instance import INSTANCES, POLL_S, InstanceDied, _drain, decode_main, prefill_main
from minibatch.engine.engine import check_prompt
from minibatch.model.registry import config_to_dict
from minibatch.sampling.sampler import SamplingParams
from minibatch.trace import StepTrace


class DisaggregatedEngine:
    """One prefill instance and one decode instance behind a router (vLLM's ``kv_transfer_config`` roles:
    the prefill instance is the ``kv_producer``, the decode instance the ``kv_consumer``)."""

    def __init__(self, model, config, draft_model=None):
        if config.speculative_config is not None or draft_model is not None:
            raise ValueError("disaggregated=True does not speculate: the decode instance's proposer would need the "
                             "drafter's state for a prompt it never saw (its cache, its features)")
        if config.tensor_parallel_size != 1 or config.scheduling != "continuous":
            raise ValueError("disaggregated=True runs two continuous-batching engines of one process each: "
                             "tensor_parallel_size must be 1 and scheduling 'continuous'")
        self.model, self.config = model, config
        self.kv_transfer_config = {"prefill": {"kv_role": "kv_producer", "kv_rank": 0},
                                   "decode": {"kv_role": "kv_consumer", "kv_rank": 1}, "kv_parallel_size": 2}
        self.num_blocks = config.num_blocks_for(model.config.n_ctx)
        self.hooks: list[Callable] = []
        self.transfers: list = []                # kv_transfer.Transfer, in the order they were sent
        self.requests: dict = {}                 # unfinished request id -> "prefill" | "decode"
        self.step_count, self.t0 = 0, time.perf_counter()
        self._procs = None
        self._dead, self._failed = {}, []
        self._transfer, self._arrived = {}, {}   # request id -> its Transfer; blocks reported before it
        self._start()

    def _start(self) -> None:
        """Both instances started, their engines built (each says "ready"), before the first request."""
        ctx = comm.spawn_context()
        self._ctl = {name: ctx.Queue() for name in INSTANCES}
        self._out = {name: ctx.Queue() for name in INSTANCES}
        handoff = self._handoff = ctx.Queue()     # kept: a queue must outlive the spawn that unpickles it
        addr, port = "127.0.0.1", comm.free_port()
        m = self.model
        state = {k: v.detach().cpu() for k, v in m.state_dict().items()}
        cfg = {f: getattr(self.config, f) for f in self.config.__dataclass_fields__}
        dev = str(m.device)
        self._procs = {
            "prefill": ctx.Process(target=prefill_main, daemon=True, name="minibatch-prefill",
                                   args=(addr, port, config_to_dict(m.config), state, cfg, dev, self._ctl["prefill"],
                                         self._out["prefill"], handoff)),
            "decode": ctx.Process(target=decode_main, daemon=True, name="minibatch-decode",
                                  args=(addr, port, config_to_dict(m.config), state, cfg, dev, self._ctl["decode"],
                                        self._out["decode"], handoff))}
        for p in self._procs.values():
            p.start()
        weakref.finalize(self, _stop, self._procs, self._ctl)
        waiting, deadline = set(INSTANCES), time.perf_counter() + 120
        while waiting:
            dead = [f"the {n} instance (exit code {p.exitcode})" for n, p in self._procs.items() if not p.is_alive()]
            if dead:
                _stop(self._procs, self._ctl)
                raise InstanceDied(f"{', '.join(dead)} exited before it was ready: {comm.SPAWN_HINT}")
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the {' and '.join(sorted(waiting))} instance(s) did not start within 120 s")
            for name in list(waiting):
                if any(msg[0] == "ready" for msg in _drain(self._out[name], block=False)):
                    waiting.discard(name)
            time.sleep(POLL_S)

    # -- LLMEngine's surface -------------------------------------------------------------------------------
    def add_hook(self, fn: Callable) -> None:
        """fn(StepTrace) for every step of either instance (``trace.instance`` says whose), on the router's clock."""
        self.hooks.append(fn)

    def add_request(self, request_id: str, prompt, params: Optional[SamplingParams] = None, priority: int = 0,
                    arrival_time: Optional[float] = None) -> None:
        params, request_id = params or SamplingParams(), str(request_id)
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        _, prompt_ids = check_prompt(request_id, prompt, params, self.model.config.n_ctx)    # as an engine would
        bs = self.config.block_size
        if -(-(len(prompt_ids) + params.max_tokens) // bs) > self.num_blocks:
            raise ValueError(f"request {request_id!r} needs more blocks than an instance's cache has "
                             f"({self.num_blocks}): it could never finish")
        if params.n != 1:
            raise ValueError("disaggregated=True serves n = 1 (a fork would have to cross the instances)")
        self._alive()
        self._ctl["prefill"].put(("add", request_id, prompt_ids, params, priority,
                                  time.perf_counter() if arrival_time is None else arrival_time))
        self.requests[request_id] = "prefill"

    def abort_request(self, request_id: str) -> None:
        if self.requests.pop(str(request_id), None) is None:
            raise KeyError(f"no unfinished request with id {request_id!r}")
        for name in INSTANCES:
            self._ctl[name].put(("abort", str(request_id)))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list:
        """What the instances reported since the last call (waiting a little for something, if nothing)."""
        outputs, deadline = {}, time.perf_counter() + 0.05   # short: a server's loop has commands to take
        while not outputs and time.perf_counter() < deadline and self.requests:
            self._alive()
            for name in INSTANCES:
                for msg in _drain(self._out[name], block=False):
                    self._handle(msg, outputs)
            if not outputs:
                time.sleep(POLL_S)
        self.step_count += 1
        return list(outputs.values())

    def _handle(self, msg, outputs: dict) -> None:
        kind = msg[0]
        if kind == "output":
            o = msg[1]
            if o.request_id not in self.requests:            # aborted meanwhile
                return
            outputs[o.request_id] = o
            if o.finished:
                del self.requests[o.request_id]
        elif kind == "transfer":                 # the two ends report on two queues, in either order
            tr = self._transfer[msg[1].request_id] = msg[1]
            tr.t_start -= self.t0                # the router's clock, as its traces
            self.transfers.append(tr)
            tr.dst_blocks = self._arrived.pop(tr.request_id, tr.dst_blocks)
            if tr.request_id in self.requests:
                self.requests[tr.request_id] = "decode"
        elif kind == "arrived":
            if msg[1] in self._transfer:
                self._transfer[msg[1]].dst_blocks = msg[2]
            else:
                self._arrived[msg[1]] = msg[2]
        elif kind == "trace" and self.hooks:
            trace = StepTrace.from_dict(msg[1])
            trace.time -= self.t0
            for fn in self.hooks:
                fn(trace)

    def pool_stats(self) -> dict:
        """Each live instance's pool, its invariant checker run there: {instance: {num_free_blocks, ...}}."""
        live = [n for n in INSTANCES if self._procs and self._procs[n].is_alive()]
        for name in live:
            self._ctl[name].put(("stats",))
        got, deadline = {}, time.perf_counter() + 30
        while len(got) < len(live) and time.perf_counter() < deadline:
            for name in live:
                for msg in _drain(self._out[name], block=False):
                    if msg[0] == "stats":
                        got[msg[1]] = msg[2]
                    elif not self._dead:
                        self._handle(msg, {})
            time.sleep(POLL_S)
        return got

    def _alive(self) -> None:
        """Raise, naming the requests that failed, once an instance has died (its process exited)."""
        dead = {n: p.exitcode for n, p in (self._procs or {}).items() if not p.is_alive()}
        if dead and not self._dead:
            # the decode instance held everything past its first token; a dead prefill instance, the rest
            self._dead = dead
            self._failed = sorted(r for r, where in self.requests.items() if where in dead or where == "prefill")
            self.requests.clear()
        if self._dead:
            who = ", ".join(f"the {n} instance (exit code {c})" for n, c in self._dead.items())
            raise InstanceDied(f"{who} died; requests reported failed: {self._failed}")

    def shutdown(self) -> None:
        if self._procs is not None:
            _stop(self._procs, self._ctl)


def _stop(procs, ctl) -> None:
    for name, p in procs.items():
        if p.is_alive():
            ctl[name].put(("shutdown",))
    for p in procs.values():
        p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
