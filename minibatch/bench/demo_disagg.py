"""``python -m minibatch demo disaggregated``: a prefill instance and a decode instance, blocks crossing.

Requests arrive in two waves; the prefill instance computes each prompt (a long one in chunks) and its first
token, the prompt's K/V crosses to the decode instance (``minibatch/distributed/kv_transfer.py``), which decodes
to the end. Writes ``out/demo/disaggregated.gif`` (both pools side by side, an arrow per block moved) and
``disaggregated.json`` (the traces, the transfers in its meta: ``python -m minibatch demo
out/demo/disaggregated.json`` replays it without a model).
"""
from __future__ import annotations

import dataclasses
import pathlib

from minibatch.bench.workload import PROMPTS
from minibatch.sampling.sampler import SamplingParams
from minibatch.trace import TraceRecorder


def record(model, small: bool) -> TraceRecorder:
    from minibatch.llm import LLM
    llm = LLM(model, disaggregated=True, max_num_seqs=4, block_size=8, num_gpu_blocks=48,
              max_num_batched_tokens=32)
    rec = TraceRecorder(meta={"scenario": "disaggregated"})
    eng = llm.llm_engine
    eng.add_hook(rec)
    n = 4 if small else 8
    try:
        for wave in range(2):
            for i in range(n // 2):
                j = wave * (n // 2) + i
                eng.add_request(f"r{j}", PROMPTS[j % len(PROMPTS)] * (3 if j == 1 else 1),
                                SamplingParams(temperature=0, max_tokens=8 + 6 * (j % 3)))
            while eng.has_unfinished_requests():
                eng.step()
        pools = eng.pool_stats()
    finally:
        eng.shutdown()
    for name, st in pools.items():
        if st["num_free_blocks"] != st["num_blocks"]:
            raise AssertionError(f"the {name} instance leaked {st['num_blocks'] - st['num_free_blocks']} blocks")
    rec.meta["transfers"] = [dataclasses.asdict(t) for t in eng.transfers]
    return rec


def transfers_of(rec: TraceRecorder) -> list:
    from minibatch.distributed.kv_transfer import Transfer
    return [Transfer(**t) for t in rec.meta.get("transfers", [])]


def summary(rec: TraceRecorder) -> list:
    trs = transfers_of(rec)
    steps = {n: sum(t.instance == n for t in rec.traces) for n in ("prefill", "decode")}
    kib = sum(t.nbytes for t in trs) / 1024
    ms = sum(t.duration for t in trs) * 1e3
    return [f"disaggregated: {steps['prefill']} prefill-instance steps, {steps['decode']} decode-instance steps",
            f"  {len(trs)} KV transfers: {kib:.0f} KiB in {ms:.1f} ms of sending "
            f"({kib / 1024 / max(ms / 1e3, 1e-9):.0f} MiB/s over gloo on loopback)"]


def write(rec: TraceRecorder, path: pathlib.Path, small: bool) -> list:
    from minibatch.viz.disagg import save
    save(rec.traces, transfers_of(rec), path, max_frames=6 if small else 40, preset="slide")
    written = [path]
    if path.suffix.lower() != ".json":
        rec.save(path.with_suffix(".json"))
        written.append(path.with_suffix(".json"))
    return written
