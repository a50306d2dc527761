"""``python -m minibatch demo structured``: one batch mixing a JSON schema, a regex, a choice and a free row,
and each row's mask beside it, step by step (out/demo/structured.png; ``--text`` prints the steps instead).

``record`` drives the real engine and writes down plain data for the renderer (minibatch/viz/structured.py):
before each step, each sequence's mask (its matcher's ``allowed()``, the mask the model runner will apply to
its row), and after it, the byte the row drew.
"""
from __future__ import annotations

import pathlib

from minibatch.engine.config import EngineConfig
from minibatch.engine.engine import LLMEngine
from minibatch.sampling.sampler import SamplingParams

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
          "ok": {"type": "boolean"}}, "required": ["id", "ok"], "additionalProperties": False}
SHOWN_STEPS = 6
WORKLOAD = [  # (request id, prompt, label, structured_outputs or None)
    ("json", "record = ", "json {id: int, ok: bool}", {"json": SCHEMA, "disable_any_whitespace": True}),
    ("regex", "version = ", r"regex [0-9]{1,2}\.[0-9]{1,2}", {"regex": r"[0-9]{1,2}\.[0-9]{1,2}"}),
    ("choice", "colour = ", "choice red|green|blue", {"choice": ["red", "green", "blue"]}),
    ("free", "def main():\n", "unconstrained", None),
]


def record(model, small: bool = False) -> list:
    """[{"step", "rows": [{"seq_id", "label", "text", "allowed", "token"}]}], one dict per engine step."""
    engine = LLMEngine(model, EngineConfig(block_size=8, max_num_seqs=4, max_num_batched_tokens=64))
    labels = {}
    for i, (rid, prompt, label, so) in enumerate(WORKLOAD):
        engine.add_request(rid, prompt, SamplingParams(temperature=0.8, seed=i, max_tokens=12 if small else 24,
                                                       structured_outputs=so))
        labels[rid] = label
    steps = []
    while engine.has_unfinished_requests():
        seqs = {s.seq_id: s for r in engine.requests.values() for s in r.seqs}
        before = {sid: (None if s.grammar is None else s.grammar.allowed().tolist(), bytes(s.output_token_ids))
                  for sid, s in seqs.items()}
        rows = []
        engine.add_hook(lambda t: rows.extend(
            {"seq_id": x.seq_id, "label": labels[x.request_id], "allowed": before[x.seq_id][0],
             "text": before[x.seq_id][1].decode("utf-8", "replace"), "token": x.new_token_ids[0]}
            for x in t.scheduled if x.new_token_ids))
        engine.step()
        engine.hooks.pop()
        steps.append({"step": len(steps), "rows": rows})
    engine.allocator.check_invariants(live_seq_ids=[])
    return steps


def byte_class(allowed) -> str:
    """[256] bools -> a compact class, e.g. [0-9.] (or 'any byte' for an unconstrained row)."""
    if allowed is None:
        return "any byte"
    on = [b for b in range(256) if allowed[b]]
    parts, i = [], 0
    while i < len(on):
        j = i
        while j + 1 < len(on) and on[j + 1] == on[j] + 1:
            j += 1
        lo, hi = (repr(chr(on[k]))[1:-1] if 32 <= on[k] < 127 else f"\\x{on[k]:02x}" for k in (i, j))
        parts.append(lo if i == j else f"{lo}{'' if j == i + 1 else '-'}{hi}")
        i = j + 1
    return f"[{''.join(parts)}] ({len(on)} bytes)"


def lines(steps: list) -> list:
    out = []
    for st in steps:
        for row in st["rows"]:
            out.append(f"step {st['step']:2d}  {row['seq_id']:<6} {byte_class(row['allowed']):<40} drew "
                       f"{bytes([row['token']])!r:<7} after {row['text']!r}")
    return out


def run_structured_demo(model, path: pathlib.Path, text_only: bool = False, small: bool = False) -> int:
    steps = record(model, small)
    if text_only:
        print("\n".join(lines(steps)))
        return 0
    from minibatch.viz.anim import new_figure
    from minibatch.viz.structured import draw_structured_steps
    fig = new_figure(dpi=40 if small else None, preset="slide")
    fig.set_layout_engine("constrained")
    shown = steps[:SHOWN_STEPS]
    draw_structured_steps(shown, {rid: label for rid, _, label, _ in WORKLOAD}, fig=fig, preset="slide")
    path = path.with_suffix(".png")
    fig.savefig(path)
    print(f"structured outputs: {len(steps)} steps, {sum(len(s['rows']) for s in steps)} bytes drawn under "
          f"masks; steps 0-{len(shown) - 1} drawn")
    print(f"wrote {path}")
    return 0
