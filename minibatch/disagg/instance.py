"""Disaggregated prefill and decode: two engines, two processes, two KV pools, one router (DistServe,
Zhong et al. OSDI'24 §3-4; Splitwise, Patel et al. ISCA'24; vLLM's disaggregated prefill).

    client -> router --add--> prefill instance: the prompt (chunked if long) + the first token
                                   |  K/V of the prompt: header on a queue, tensor by dist.send
                                   v
                              decode instance: blocks allocated, K/V written, decodes to the end -> router

Why split them: a prompt of P tokens is one compute-bound step, a decode step is memory-bound and short.
In one engine a long prompt stalls every running decode for its whole step (the TPOT spike chunked prefill
softens); two instances never interfere, and each can be sized and batched for its own phase, at the cost
of moving the K/V (``kv_transfer.py``). Each instance is a full ``LLMEngine`` in its own process, with its own
scheduler, allocator and pool; the prefill instance runs each request with max_tokens = 1.

The router (``DisaggregatedEngine``) has ``LLMEngine``'s surface (add_request, step, abort_request,
has_unfinished_requests, add_hook), so ``LLM("target", disaggregated=True)`` and the server use it unchanged.
Control messages go over multiprocessing queues; only K/V go over ``torch.distributed`` (world of 2: the
prefill instance rank 0, the decode instance rank 1), under the group's timeout.

Faults: an instance that dies is seen by the router (its process has exited) and every request it held is
reported failed (an error naming them); the prefill instance has freed its blocks already (it frees as it
gathers), so a transfer in flight loses nothing but the request; the decode instance's pool dies with it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import time
import traceback

import torch

from minibatch.distributed import comm
from minibatch.distributed.kv_transfer import (DECODE_RANK, PREFILL_RANK, KVPayload, KVSender, receive)

INSTANCES = ("prefill", "decode")
POLL_S = 0.02


class InstanceDied(RuntimeError):
    """A prefill or decode instance stopped; the requests it held are named in the message."""


@contextlib.contextmanager
def _instance(rank: int, name: str, addr, port, model_cfg: dict, state: dict, engine_cfg: dict, device: str, out):
    """What both instances do around their loop, in their own process: one thread, the process group joined (as
    ``rank``), the model rebuilt from its config and weights, a colocated ``LLMEngine`` on it whose every step's
    trace goes to the router; at the end, the group left (an error is printed and the process exits with 1).
    Yields (the engine, the router's process id: when ``os.getppid()`` differs, the router is gone)."""
    from minibatch.engine.config import EngineConfig
    from minibatch.engine.engine import LLMEngine
    from minibatch.model.registry import build, config_from_dict
    torch.set_num_threads(1)
    parent = os.getppid()
    comm.init(rank, 2, addr, port, device)
    try:
        model = build(config_from_dict(model_cfg))
        model.load_state_dict(state)
        model = model.to(device=device, dtype=next(iter(state.values())).dtype).eval()
        eng = LLMEngine(model, EngineConfig(**{**engine_cfg, "disaggregated": False}))
        eng.add_hook(_trace_hook(out, name, eng))            # a step's trace: a few KB through the queue
        yield eng, parent
    except Exception:
        traceback.print_exc()
        raise SystemExit(1)
    finally:
        comm.shutdown()


def _drain(q, block: bool):
    """Every message waiting on q (after waiting up to POLL_S for the first when ``block``)."""
    out = []
    try:
        out.append(q.get(timeout=POLL_S) if block else q.get_nowait())
        while True:
            out.append(q.get_nowait())
    except queue.Empty:
        return out


def _stats(eng) -> dict:
    a = eng.allocator
    a.check_invariants(eng.scheduler.live_seq_ids())
    return {"num_free_blocks": a.num_free_blocks, "num_blocks": a.num_blocks,
            "live": len(eng.scheduler.live_seq_ids()), "prefix_cache_hits": a.hits}


def _trace_hook(out, name, eng):
    def hook(trace):
        trace.instance = name
        trace.time += eng.t0          # time.perf_counter: one clock for every process of the machine
        out.put(("trace", trace.to_dict()))
    return hook


def prefill_main(addr, port, model_cfg, state, engine_cfg, device, ctl, out, to_decode) -> None:
    with _instance(PREFILL_RANK, "prefill", addr, port, model_cfg, state, engine_cfg, device, out) as (eng, parent):
        goes_on: dict = {}                        # request id -> its real params, for those that decode elsewhere
        sender = KVSender(eng.kv_cache, eng.config.block_size, wants=lambda seq: seq.request_id in goes_on)
        eng.scheduler.kv_connector = sender
        out.put(("ready",))

        def header(seq, shape, tr):
            return handoff_header(seq, goes_on.pop(seq.request_id), tr, shape)
        while True:
            if os.getppid() != parent:            # the router is gone (killed): so is every request
                return
            for msg in _drain(ctl, block=not eng.has_unfinished_requests()):
                if msg[0] == "shutdown":
                    return
                if msg[0] == "add":
                    _, rid, prompt_ids, params, priority, arrival = msg
                    if params.max_tokens > 1:            # else the first token is the whole answer
                        goes_on[rid] = params
                    eng.add_request(rid, prompt_ids, dataclasses.replace(params, max_tokens=1), priority, arrival)
                elif msg[0] == "abort" and msg[1] in eng.requests:
                    goes_on.pop(msg[1], None)
                    eng.abort_request(msg[1])
                elif msg[0] == "stats":
                    out.put(("stats", "prefill", _stats(eng)))
            if not eng.has_unfinished_requests():
                continue
            for o in eng.step():
                if o.request_id in goes_on and o.outputs[0].finish_reason == "length":
                    o.finished, o.outputs[0].finish_reason = False, None       # the first token; decoding goes on
                else:
                    goes_on.pop(o.request_id, None)
                out.put(("output", o))
            try:
                for tr in sender.send_all(to_decode, header):
                    out.put(("transfer", tr))
            except RuntimeError as e:         # the decode instance is gone: its blocks here are free already
                out.put(("decode_lost", str(e)))
                sender.pending.clear()


def handoff_header(seq, params, tr, shape=None) -> dict:
    """What the decode side needs of a sequence whose prompt (and first token) the prefill side computed: its
    tokens, the request's real params, its timings, the seeded generator's state (so seeded sampling goes on
    where the first draw left it), the shapes of what follows (``KVPayload.shapes``) and the Transfer record."""
    g = seq.generator
    return {"request_id": seq.request_id, "prompt": seq.request.prompt, "prompt_ids": seq.token_ids[:-1],
            "first_token": seq.token_ids[-1], "params": params, "arrival_time": seq.request.metrics.arrival_time,
            "first_token_time": seq.request.metrics.first_token_time, "shape": shape,
            "generator_state": None if g is None else g.get_state(), "transfer": tr}


def admit_handoff(eng, hdr: dict, kv: KVPayload) -> bool:
    """``LLMEngine.admit_prefilled`` for a request that arrived with ``handoff_header``'s header (this unpacks
    what that packs), the blocks its K/V went to recorded on its Transfer. False: no room now, try again after a
    step."""
    table = eng.admit_prefilled(hdr["request_id"], hdr["prompt"], hdr["prompt_ids"], hdr["first_token"],
                                hdr["params"], kv, arrival_time=hdr["arrival_time"],
                                first_token_time=hdr["first_token_time"], generator_state=hdr["generator_state"])
    if table is None:
        return False
    hdr["transfer"].dst_blocks = table
    return True


def decode_main(addr, port, model_cfg, state, engine_cfg, device, ctl, out, from_prefill) -> None:
    with _instance(DECODE_RANK, "decode", addr, port, model_cfg, state, engine_cfg, device, out) as (eng, parent):
        out.put(("ready",))
        arrived, aborted = [], set()                       # (header, kv) received, not yet admitted
        while True:
            if os.getppid() != parent:            # the router is gone (killed): so is every request
                return
            idle = not eng.has_unfinished_requests() and not arrived
            for msg in _drain(ctl, block=False):
                if msg[0] == "shutdown":
                    return
                if msg[0] == "abort":
                    aborted.add(msg[1])
                    if msg[1] in eng.requests:
                        eng.abort_request(msg[1])
                elif msg[0] == "stats":
                    out.put(("stats", "decode", _stats(eng)))
            for hdr in _drain(from_prefill, block=idle):
                arrived.append((hdr, receive(hdr["shape"], eng.kv_cache)))
            still = []
            for hdr, kv in arrived:
                if hdr["request_id"] in aborted:
                    continue
                if admit_handoff(eng, hdr, kv):
                    out.put(("arrived", hdr["request_id"], hdr["transfer"].dst_blocks, time.perf_counter()))
                else:
                    still.append((hdr, kv))
            arrived = still
            if eng.has_unfinished_requests():
                for o in eng.step():
                    out.put(("output", o))
