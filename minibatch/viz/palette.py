"""Sequence colours: who owns a block, told apart at a glance.

A sequence keeps one colour in every view (block pool, block tables, the
timeline's row labels) and every frame of a run. Colours are *assigned*, not
hashed or cycled: two sequences alive at the same time never share one, so
when r1 and r10 run together their blocks cannot be confused. Alive means
admitted and not yet finished: scheduled, running, holding blocks, or
preempted and waiting to recompute. A colour is reused only after its
previous owner has left.

Lifetimes in one run are intervals, so colouring them greedily in order of
admission needs exactly as many colours as the most sequences ever alive at
once (the interval-graph colouring theorem). Up to 9 use Paul Tol's *muted*
scheme, built to stay distinct under the common colour-vision deficiencies;
up to 14 use Tol's discrete rainbow, his scheme for more classes; beyond 14
the rainbow repeats (raise ``max_num_seqs`` that far and the block tables'
written ids are what tells sequences apart).

Pure Python except ``seq_color`` (which returns matplotlib's RGBA): the text
view and the demo summary import this without matplotlib.
"""
from __future__ import annotations

from minibatch.viz.common import as_traces

# Paul Tol's "muted" qualitative scheme: 9 colours distinguishable under the common colour-vision deficiencies.
SEQ_PALETTE = ["#CC6677", "#332288", "#DDCC77", "#117733", "#88CCEE",
               "#882255", "#44AA99", "#999933", "#AA4499"]
# Tol's discrete rainbow, 14 colours: for runs with more than 9 sequences alive at once.
SEQ_PALETTE_LARGE = ["#882E72", "#1965B0", "#F7F056", "#4EB265", "#DC050C", "#7BAFDE", "#AE76A3",
                     "#F1932D", "#90C987", "#5289C7", "#E8601C", "#CAE0AB", "#D1BBD7", "#F6C141"]


class SeqOrder(dict):
    """seq id -> row index, by first appearance; ``.colors``: seq id -> hex colour, concurrent ones distinct."""
    colors: dict


def _runs(traces):
    """Split a list of traces where the step number stops increasing (two runs side by side)."""
    run, last = [], None
    for t in traces:
        if last is not None and t.step <= last:
            yield run
            run = []
        run.append(t)
        last = t.step
    if run:
        yield run


def alive_sets(traces) -> list:
    """Per trace, the set of sequences alive in it (see the module doc)."""
    out = []
    for run in _runs(as_traces(traces)):
        admitted = set()
        for t in run:
            active = ({s.seq_id for s in t.scheduled} | set(t.running) | set(t.block_tables)
                      | set(t.preempted))
            admitted |= active
            out.append(active | (set(t.waiting) & admitted))    # preempted, waiting to recompute
    return out


def assign_colors(traces, order: dict) -> dict:
    """seq id -> palette index: greedy in order of admission, the lowest index no live neighbour holds."""
    conflicts, first = {sid: set() for sid in order}, {}
    for i, alive in enumerate(alive_sets(traces)):
        for sid in alive:
            first.setdefault(sid, i)
            conflicts.setdefault(sid, set()).update(alive - {sid})
    index = {}
    for sid in sorted(conflicts, key=lambda s: (first.get(s, float("inf")), order.get(s, 0))):
        taken = {index[n] for n in conflicts[sid] if n in index}
        index[sid] = next(i for i in range(len(taken) + 1) if i not in taken)
    return index


def palette_for(num_colors: int) -> list:
    return SEQ_PALETTE if num_colors <= len(SEQ_PALETTE) else SEQ_PALETTE_LARGE


def seq_order(traces) -> SeqOrder:
    """seq id -> 0, 1, 2, ... in order of first appearance (batch order, then running, then waiting within a
    step): the row order of the timeline and block tables. Its ``.colors`` are what ``seq_color`` returns."""
    order = SeqOrder()
    traces = as_traces(traces)
    for t in traces:
        for sid in ([s.seq_id for s in t.scheduled] + list(t.preempted) + list(t.running)
                    + list(t.block_tables) + list(t.waiting) + list(t.finished)):
            order.setdefault(sid, len(order))
    index = assign_colors(traces, order)
    palette = palette_for(max(index.values(), default=0) + 1)
    order.colors = {sid: palette[i % len(palette)] for sid, i in index.items()}
    return order


def seq_color(seq_id: str, order) -> tuple:
    """The RGBA colour of a sequence in every view. ``order`` is seq_order(...) or the traces themselves
    (a plain {seq id: index} dict cycles through the muted palette by index)."""
    from matplotlib.colors import to_rgba               # here, so text-only users never load matplotlib
    if not isinstance(order, dict):
        order = seq_order(order)
    if seq_id not in order:
        raise KeyError(f"sequence {seq_id!r} never appears in the trace")
    colors = getattr(order, "colors", None)
    return to_rgba(colors[seq_id] if colors else SEQ_PALETTE[order[seq_id] % len(SEQ_PALETTE)])
