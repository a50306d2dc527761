"""The terminal view: one step as a few lines of text, for SSH sessions and CI logs.

    step 2 · continuous · 12/12 tokens · 4/5 seqs · blocks: 9 used, 0 cached-free, 1 free of 10 (x4 tokens)
      A    decode     4 tok  kv 7->10   out 5   spec 2/3 accepted
      B    decode     1 tok  kv 9->10   out 2
      ...
      admitted: D.0 · preempted: - · finished: -
      waiting: E · running, not scheduled: D.1

With a host pool (swapping, the prefix cache's host tier), two more lines say who was swapped out and in,
what the host pool holds, how many blocks the host tier gave back, and the blocks copied each way.

"kv a->b" is the sequence's cached tokens before and after the step (rejected
draft tokens rolled back); "out" counts its generated tokens so far; under
speculation, "drafts 'kept'|'rejected'" shows what the proposer guessed. A
token tree prints as an outline under its sequence (``tree_outline``): one
node a line, children in the drafter's order, the accepted path marked ●,
rejected nodes ○, and the target's own token after the path:

      A    decode    17 tok  kv 21->24  out 9   tree 2/16 accepted + bonus  path 'cl' + 'a'
        ● 0 '_'  root, position 21
        ├─● 1 'c'
        │ ├─○ 7 'o'
        │ └─● 10 'l'
        │   └─▶ 'a'  bonus (the target's token)
        └─○ 2 'n'

No matplotlib here: this module works wherever Python does.
"""
from __future__ import annotations

import sys

from minibatch.model.tokenizer import decode
from minibatch.trace import StepTrace
from minibatch.viz.common import as_traces
from minibatch.viz.tree_data import step_tree


def _names(ids) -> str:
    return ", ".join(ids) if ids else "-"


def tree_outline(traces, step: int, seq_id=None, indent: str = "") -> str:
    """One sequence's token tree in ``step`` as an indented outline (see the module doc); ``seq_id`` None:
    the first that verified a tree. Raises TraceError on a step without one."""
    v = step_tree(traces, step, seq_id)
    kids, path, labels = v["children"], v["accepted"], v["labels"]
    on_path = set(path)
    where = f"position {v['context_len']}" if v["context_len"] else "depth 0"
    lines = [f"{indent}\u25cf 0 {labels[0]}  root, {where}"]

    def walk(node, prefix):
        below = kids[node] + (["target"] if node == path[-1] and v["target_label"] is not None else [])
        for n, child in enumerate(below):
            last = n == len(below) - 1
            branch, more = ("\u2514\u2500", "  ") if last else ("\u251c\u2500", "\u2502 ")
            if child == "target":
                lines.append(f"{indent}{prefix}{branch}\u25b6 {v['target_label']}  {v['target_kind']} "
                             f"(the target's token)")
                continue
            mark = "\u25cf" if child in on_path else "\u25cb"
            lines.append(f"{indent}{prefix}{branch}{mark} {child} {labels[child]}")
            walk(child, prefix + more)

    walk(0, "")
    return "\n".join(lines)


def text_view(trace: StepTrace) -> str:
    """A compact text rendering of one StepTrace."""
    if not isinstance(trace, StepTrace):
        raise TypeError(f"text_view takes one StepTrace, got {type(trace).__name__}; "
                        "use print_trace(traces) for a whole run")
    t = trace
    cached_free = sum(t.ref_counts[b] == 0 for b in t.cached_blocks)
    used = t.num_blocks - t.num_free_blocks
    lines = [f"step {t.step} · {t.scheduling} · {t.num_batched_tokens}/{t.token_budget} tokens · "
             f"{len(t.scheduled)}/{t.max_num_seqs} seqs · blocks: {used} used, {cached_free} cached-free, "
             f"{t.num_free_blocks - cached_free} free of {t.num_blocks} (x{t.block_size} tokens)"]
    width = max([len(s.seq_id) for s in t.scheduled] + [3])
    for s in t.scheduled:
        after = s.num_computed_before + s.num_tokens - (s.proposed - s.accepted)
        kv = f"{s.num_computed_before}->{after}"
        line = f"  {s.seq_id:<{width}} {s.phase:<8} {s.num_tokens:>4} tok  kv {kv:<9} out {s.num_output_tokens}"
        tree = bool(s.draft_parents) and len(s.accepted_path) == s.accepted + 1
        if tree:                           # the path's drafts, then the target's token: 'cl' + 'a'
            d = s.draft_token_ids
            line += (f"   tree {s.accepted}/{s.proposed} accepted" + (" + bonus" if s.bonus else "")
                     + f"  path {decode([d[i - 1] for i in s.accepted_path[1:]])!r}"
                     + (f" + {decode(s.new_token_ids[s.accepted:s.accepted + 1])!r}"
                        if len(s.new_token_ids) > s.accepted else ""))
        elif s.proposed:
            line += f"   spec {s.accepted}/{s.proposed} accepted" + (" + bonus" if s.bonus else "")
            if s.draft_token_ids:          # the drafts, the kept ones before the bar: 'def|ault'
                d = s.draft_token_ids
                line += f"  drafts {decode(d[:s.accepted])!r}|{decode(d[s.accepted:])!r}"
        if s.seq_id in t.finished:
            line += "   finished"
        lines.append(line.rstrip())
        if tree:
            lines.append(tree_outline([t], t.step, s.seq_id, indent=" " * 4))
    lines.append(f"  admitted: {_names(t.admitted)} · preempted: {_names(t.preempted)} · "
                 f"finished: {_names(t.finished)}")
    scheduled = {s.seq_id for s in t.scheduled}
    idle = [sid for sid in t.running if sid not in scheduled]
    tail = f"  waiting: {_names(t.waiting)}"
    if idle:
        tail += f" · running, not scheduled: {_names(idle)}"
    if t.num_padding_slots:
        tail += f" · padding slots: {t.num_padding_slots}"
    if t.prefix_cache_queries:
        tail += f" · prefix cache: {t.prefix_cache_hits}/{t.prefix_cache_queries} blocks hit"
    lines.append(tail)
    if getattr(t, "num_host_blocks", 0):
        lines.append(host_line(t))
    if t.note:
        lines.append(f"  note: {t.note}")
    return "\n".join(lines)


def host_line(t: StepTrace) -> str:
    """The memory hierarchy's step: who was swapped out and in, the host pool, the host tier's hits, the copies."""
    swapped = len({b for tb in t.host_block_tables.values() for b in tb})
    line = (f"  swapped out: {_names(t.swapped_out)} · swapped in: {_names(t.swapped_in)}"
            + (f" · recomputed instead (swap space full): {_names(t.recomputed_instead)}" if t.recomputed_instead
               else "")
            + f"\n  host pool: {swapped} swapped, {len(t.offloaded_blocks)} host tier, {t.num_free_host_blocks} free "
            f"of {t.num_host_blocks}")
    if t.offload_queries:
        line += f" · host tier: {t.offload_hits}/{t.offload_queries} blocks loaded back"
    if t.blocks_to_host or t.blocks_to_device:
        line += f" · copied: {t.blocks_to_host} blocks to host, {t.blocks_to_device} to device"
    return line


def print_trace(traces, file=None) -> None:
    """Print text_view of every step (``traces``: a list, a TraceRecorder or a saved file)."""
    file = file or sys.stdout
    for t in as_traces(traces):
        print(text_view(t), file=file)
        print(file=file)
