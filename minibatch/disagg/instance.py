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

import dataclasses
import os
import queue
import time
import traceback

import torch

from minibatch.distributed import comm
from minibatch.distributed.kv_transfer import (DECODE_RANK, PREFILL_RANK, KVSender, receive, scatter_prompt)
from minibatch.engine.sequence import Request, Sequence, SequenceStatus

INSTANCES = ("prefill", "decode")
POLL_S = 0.02


class InstanceDied(RuntimeError):
    """A prefill or decode instance stopped; the requests it held are named in the message."""


def _engine(model_cfg: dict, state: dict, engine_cfg: dict, device: str):
    from minibatch.engine.config import EngineConfig
    from minibatch.engine.engine import LLMEngine
    from minibatch.model.model import GPT, GPTConfig
    model = GPT(GPTConfig(**model_cfg))
    model.load_state_dict(state)
    model = model.to(device=device, dtype=state["wte.weight"].dtype).eval()
    return LLMEngine(model, EngineConfig(**{**engine_cfg, "disaggregated": False}))


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
    torch.set_num_threads(1)
    parent = os.getppid()
    comm.init(PREFILL_RANK, 2, addr, port, device)
    try:
        eng = _engine(model_cfg, state, engine_cfg, device)
        goes_on: dict = {}                        # request id -> its real params, for those that decode elsewhere
        sender = KVSender(eng.kv_cache, eng.config.block_size, wants=lambda seq: seq.request_id in goes_on)
        eng.scheduler.kv_connector = sender
        eng.add_hook(_trace_hook(out, "prefill", eng))        # a step's trace: a few KB through the queue
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
    except Exception:
        traceback.print_exc()
        raise SystemExit(1)
    finally:
        comm.shutdown()


def handoff_header(seq, params, tr, shape=None) -> dict:
    """What the decode side needs of a sequence whose prompt (and first token) the prefill side computed: its
    tokens, the request's real params, its timings, the seeded generator's state (so seeded sampling goes on
    where the first draw left it), the kv tensor's shape and the Transfer record."""
    g = seq.generator
    return {"request_id": seq.request_id, "prompt": seq.request.prompt, "prompt_ids": seq.token_ids[:-1],
            "first_token": seq.token_ids[-1], "params": params, "arrival_time": seq.request.metrics.arrival_time,
            "first_token_time": seq.request.metrics.first_token_time, "shape": shape,
            "generator_state": None if g is None else g.get_state(), "transfer": tr}


def admit_prefilled(eng, hdr: dict, kv: torch.Tensor) -> bool:
    """A request whose prompt was computed elsewhere joins the running batch, its K/V written into fresh (or
    prefix-cached) blocks. False: no room now (a seat or the blocks), try again after a step."""
    sched, alloc, prompt_ids = eng.scheduler, eng.allocator, hdr["prompt_ids"]
    if len(sched.running) >= eng.config.max_num_seqs or not alloc.can_allocate(prompt_ids):
        return False
    rid = hdr["request_id"]
    req = Request(rid, hdr["prompt"], list(prompt_ids), hdr["params"], arrival_time=hdr["arrival_time"],
                  arrival_order=eng._num_added)
    if hdr["generator_state"] is not None:                 # a seeded request draws on where the first draw left it
        req.generators[0].set_state(hdr["generator_state"])
    req.metrics.first_scheduled_time = req.metrics.first_token_time = hdr["first_token_time"]
    seq = Sequence(rid, req, 0, list(prompt_ids) + [hdr["first_token"]], status=SequenceStatus.RUNNING)
    cached = alloc.allocate(rid, prompt_ids)              # prefix hits hold the same K/V already: not rewritten
    table = alloc.block_table(rid)
    scatter_prompt(eng.kv_cache, table, cached, kv, eng.config.block_size)
    seq.num_computed_tokens, seq.num_cached_tokens = len(prompt_ids), cached
    alloc.mark_computed(rid, len(prompt_ids), seq.token_ids)
    req.seqs.append(seq)
    eng.requests[rid] = req
    eng._num_added += 1
    sched.running.append(seq)
    hdr["transfer"].dst_blocks = list(table)
    return True


def decode_main(addr, port, model_cfg, state, engine_cfg, device, ctl, out, from_prefill) -> None:
    torch.set_num_threads(1)
    parent = os.getppid()
    comm.init(DECODE_RANK, 2, addr, port, device)
    try:
        eng = _engine(model_cfg, state, engine_cfg, device)
        eng.add_hook(_trace_hook(out, "decode", eng))
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
                arrived.append((hdr, receive(hdr["shape"], eng.kv_cache.dtype)))
            still = []
            for hdr, kv in arrived:
                if hdr["request_id"] in aborted:
                    continue
                if admit_prefilled(eng, hdr, kv):
                    out.put(("arrived", hdr["request_id"], hdr["transfer"].dst_blocks, time.perf_counter()))
                else:
                    still.append((hdr, kv))
            arrived = still
            if eng.has_unfinished_requests():
                for o in eng.step():
                    out.put(("output", o))
    except Exception:
        traceback.print_exc()
        raise SystemExit(1)
    finally:
        comm.shutdown()
