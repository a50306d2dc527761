"""The hierarchy demo (``python -m minibatch demo hierarchy``): the KV cache's second tier, animated.

A multi-turn chat on a device pool too small for it: running requests are swapped out to host memory and back
in, and a turn whose earlier prefix left the device pool loads it back from the prefix cache's host tier. The
dashboard draws the host pool beside the device pool (``minibatch/viz/host_pool.py``); the text view prints the
swaps and the host tier's hits.
"""
from __future__ import annotations

from minibatch.bench.workload import multi_turn_chat
from minibatch.engine.config import EngineConfig
from minibatch.engine.engine import LLMEngine
from minibatch.trace import TraceRecorder


def scenario_hierarchy(model, small: bool) -> dict:
    """A multi-turn chat (each turn's prompt the conversation so far, sent once the previous turn is back) on a
    device pool too small for it: running requests are swapped out to host memory and back in
    (``preemption_mode="swap"``), and a turn whose earlier prefix left the device pool loads it back from the
    prefix cache's host tier (``kv_offload_space``, write-through) instead of prefilling it again."""
    turns = multi_turn_chat(3 if small else 4, 2 if small else 3, seed=1, user_len=(8, 16), reply_len=(16, 24),
                            max_tokens=24)
    engine = LLMEngine(model, EngineConfig(block_size=8, num_gpu_blocks=24 if small else 36, max_num_seqs=3,
                                           max_num_batched_tokens=64, preemption_mode="swap",
                                           kv_offload_space=0.004))
    rec = TraceRecorder(meta={"scenario": "hierarchy"})
    engine.add_hook(rec)
    pending, done = list(turns), set()
    while pending or engine.has_unfinished_requests():
        for r in [r for r in pending if r.after is None or r.after in done]:    # a user answers at once
            pending.remove(r)
            engine.add_request(r.request_id, r.prompt, r.sampling_params())
        done.update(o.request_id for o in engine.step() if o.finished)
    engine.allocator.check_invariants(live_seq_ids=[])
    engine.host_pool.check_invariants()
    engine.host_pool.check_idle()
    return {"hierarchy": (rec, None)}


def hierarchy_lines(traces: list) -> list:
    """What the memory hierarchy did: swaps each way, recomputations instead, host-tier hits, blocks copied."""
    if not any(getattr(t, "num_host_blocks", 0) for t in traces):
        return []
    out, back = sum(len(t.swapped_out) for t in traces), sum(len(t.swapped_in) for t in traces)
    instead, last = sum(len(t.recomputed_instead) for t in traces), traces[-1]
    return [f"  memory hierarchy ({last.num_host_blocks} host blocks): {out} sequences swapped out, {back} swapped "
            f"back in" + (f", {instead} recomputed instead (swap space full)" if instead else ""),
            f"    host tier: {last.offload_hits} of {last.offload_queries} blocks that missed the device pool "
            f"loaded back; {sum(t.blocks_to_host for t in traces)} blocks copied to host, "
            f"{sum(t.blocks_to_device for t in traces)} to the device"]
