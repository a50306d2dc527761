"""Disaggregation on the simulated clock: a prefill engine and a decode engine in this process, each timed by
``minibatch.perf`` as its own device (DistServe's comparison, OSDI'24 §6, in this project's numbers).

The real pair (``disagg.py``) runs on this CPU's clock, where two processes share two cores. To ask what the
split buys on GPUs, the same two engines run here as a discrete-event simulation: each has its own simulated
clock (``LLMEngine.simulated_time``), and the next step taken is always the one that starts first.

* the prefill engine takes requests as their arrival times pass on its clock (jumping to the next arrival when
  idle), runs them with max_tokens = 1, and its KV connector gathers each prompt's K/V as the real one does;
* a transfer is ready on the decode side ``bytes / interconnect bandwidth`` after the prefill step that made
  it, the bytes being the *simulated* model's K/V (``ModelProfile.kv_bytes_per_token`` x prompt tokens);
* the decode engine admits ready transfers (``LLMEngine.admit_prefilled``, by way of ``admit_handoff``: the real
  pair's code) and decodes; idle, its clock jumps to the next ready transfer.
Tokens still come from the tiny model, so outputs equal colocated ones; only the clock is simulated.
"""
from __future__ import annotations

import dataclasses

from minibatch.disagg.instance import admit_handoff, handoff_header
from minibatch.distributed.kv_transfer import KVSender


def run_disaggregated_simulated(model, workload, simulate: str, temperature: float = 0.0, **engine_kwargs):
    """(traces of both engines on one simulated clock, each tagged with its instance; arrivals {id: s})."""
    from minibatch.engine.config import EngineConfig
    from minibatch.engine.engine import LLMEngine
    from minibatch.trace import TraceRecorder
    engines = {name: LLMEngine(model, EngineConfig(simulate=simulate, **engine_kwargs)) for name in ("prefill",
                                                                                                    "decode")}
    pre, dec = engines["prefill"], engines["decode"]
    cost = pre.cost_model
    link = cost.hw.interconnect_bandwidth
    if link <= 0:
        raise ValueError(f"simulate={simulate!r}: the hardware profile has no interconnect bandwidth to move K/V")
    recs = {}
    for name, eng in engines.items():
        recs[name] = TraceRecorder()
        eng.add_hook(recs[name])
    params = {r.request_id: r.sampling_params(temperature=temperature) for r in workload}
    sender = KVSender(pre.kv_cache, pre.config.block_size, wants=lambda seq: params[seq.request_id].max_tokens > 1)
    pre.scheduler.kv_connector = sender
    pending = sorted(workload, key=lambda r: r.arrival_time)
    in_flight = []                                           # (ready at, header, kv)
    while pending or in_flight or pre.has_unfinished_requests() or dec.has_unfinished_requests():
        p_next = pre.simulated_time if pre.has_unfinished_requests() else \
            max(pre.simulated_time, pending[0].arrival_time) if pending else float("inf")
        d_next = dec.simulated_time if dec.has_unfinished_requests() else \
            max(dec.simulated_time, min(r for r, _, _ in in_flight)) if in_flight else float("inf")
        if p_next <= d_next:
            pre.simulated_time = p_next
            while pending and pending[0].arrival_time <= pre.simulated_time:
                r = pending.pop(0)
                pre.add_request(r.request_id, r.prompt, dataclasses.replace(params[r.request_id], max_tokens=1),
                                priority=r.priority)
            pre.step()
            for seq, kv, tr in sender.pending:
                nbytes = cost.model.kv_bytes_per_token * tr.num_tokens
                in_flight.append((pre.simulated_time + nbytes / link, handoff_header(seq, params[seq.request_id], tr), kv))
            sender.pending = []
        else:
            dec.simulated_time = d_next
            waiting = []
            for ready, hdr, kv in sorted(in_flight, key=lambda x: x[0]):
                if ready > dec.simulated_time or not admit_handoff(dec, hdr, kv):
                    waiting.append((ready, hdr, kv))
            in_flight = waiting
            if dec.has_unfinished_requests():
                dec.step()
            elif in_flight:                                  # everything ready is waiting for room: impossible
                raise RuntimeError("the decode instance cannot admit a transferred request into an empty pool")
    traces = []
    for name, rec in recs.items():
        for t in rec.traces:
            t.instance = name
            traces.append(t)
    traces.sort(key=lambda t: (t.simulated_time, t.instance))
    return traces, {r.request_id: r.arrival_time for r in workload}

