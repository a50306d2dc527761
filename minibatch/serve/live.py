"""The live view's data: every ``StepTrace``, as JSON, to every open page (server-sent events).

The page at ``/`` draws the batch timeline, the block pool and, for a radix
cache (``serve --prefix-cache radix``), the radix tree from the same trace data
the matplotlib views read (``trace.to_dict()``), with the same colours
(``minibatch.viz.common``, written into the page when it is served), so what
the lecturer projects is the lecture's figures, live.

The feed is a hook on the engine thread (or, with the engine core in its own
process, on the thread that receives the core's outputs): it serialises the
trace once and hands it to each subscriber's asyncio queue. It keeps the last
``history`` steps, which the page is served with (written into it), so it draws
the recent past the moment it loads, before any event arrives (a projector that
reloads, a headless browser taking a screenshot); its event stream then
starts after the last of those steps. A slow page loses steps rather than
slowing the engine: its queue is bounded and drops.

A step of 32 sequences over 1,024 blocks is a long trace (every block's ref
count, every block table): ``dataclasses.asdict`` deep-copies all of it before
``json.dumps`` reads it once, 10 to 30 ms a step on a shared 2-core CPU, held
under the GIL that the event loop needs. So ``trace_json`` writes the same text
from the trace's own lists (a tenth of the time), and a step nobody watches is
kept as the trace and serialised only if a page asks for it.
"""
from __future__ import annotations

import asyncio
import json
import pathlib
import threading
from collections import deque

from minibatch.viz.common import CACHED_FREE_COLOR, EDGE_COLOR, FREE_COLOR, PHASE_COLORS, PHASE_LABELS, SPEC_REJECTED_COLOR
from minibatch.viz.palette import SEQ_PALETTE, SEQ_PALETTE_LARGE
from minibatch.viz.radix_tree import radix_boxes, radix_title

STATIC = pathlib.Path(__file__).parent / "static"
_CLOSE = None


def trace_json(trace) -> str:
    """``json.dumps(trace.to_dict())``, the same text, without asdict's deep copy (its lists are read in place);
    a radix run's trace also carries ``radix_boxes`` and ``radix_title``, the tree laid out and named as the
    matplotlib view does it (viz/radix_tree.py: depth, row, label), so the page draws boxes, never places them."""
    d = dict(vars(trace))
    d["scheduled"] = [vars(s) for s in trace.scheduled]
    if trace.radix_nodes:
        d["radix_boxes"] = radix_boxes(trace, trace.step)
        d["radix_title"] = radix_title(d["radix_boxes"])
    return json.dumps(d, separators=(",", ":"))


class LiveFeed:
    def __init__(self, history: int = 120, max_queue: int = 2000):
        self._ring: deque = deque(maxlen=history)       # [step, trace, its JSON or None until asked]
        self._subs: set = set()                          # (loop, asyncio.Queue)
        self._lock = threading.Lock()
        self._max_queue = max_queue

    def __call__(self, trace) -> None:                   # engine.add_hook(feed): on the engine thread
        item = [trace.step, trace, None]
        with self._lock:                                 # a page that subscribes after this finds it in the ring
            self._ring.append(item)
            subs = list(self._subs)
        if not subs:
            return                                       # nobody watching: serialised if a page asks for it
        data = item[2] = trace_json(trace)
        for loop, q in subs:
            loop.call_soon_threadsafe(_offer, q, data)

    def _kept(self, after: int) -> list:
        """The kept steps after ``after``, as JSON strings (serialising those nobody asked for yet); under the lock."""
        out = []
        for item in self._ring:
            if item[0] > after:
                if item[2] is None:
                    item[2] = trace_json(item[1])
                out.append(item[2])
        return out

    def backlog(self, after: int = -1) -> list:
        """The kept steps after step ``after``, as JSON strings."""
        with self._lock:
            return self._kept(after)

    async def events(self, after: int = -1):
        """Async iterator of JSON strings: the kept steps after ``after``, then each new step; ends on close()."""
        loop, q = asyncio.get_running_loop(), asyncio.Queue(self._max_queue)
        with self._lock:
            backlog = self._kept(after)
            self._subs.add((loop, q))
        try:
            for data in backlog:
                yield data
            while True:
                data = await q.get()
                if data is _CLOSE:
                    return
                yield data
        finally:
            with self._lock:
                self._subs.discard((loop, q))

    def close(self) -> None:
        """End every open stream (server shutdown: an endless response would hold it up)."""
        with self._lock:
            subs = list(self._subs)
        for loop, q in subs:
            loop.call_soon_threadsafe(_force, q)


def _offer(q: asyncio.Queue, data) -> None:
    try:
        q.put_nowait(data)
    except asyncio.QueueFull:                            # a page that cannot keep up skips steps
        pass


def _force(q: asyncio.Queue) -> None:
    while q.full():
        q.get_nowait()
    q.put_nowait(_CLOSE)


def page_config(model_name: str) -> dict:
    """What the page needs besides the traces (which carry the pool size, budget and batch bound):
    the matplotlib views' colours and labels."""
    from minibatch.viz.timeline import SPEC_TARGET_COLOR     # loads matplotlib: once, on the first page
    return {"model": model_name, "phase_colors": PHASE_COLORS, "phase_labels": PHASE_LABELS,
            "spec_target_color": SPEC_TARGET_COLOR, "seq_palette": SEQ_PALETTE,
            "seq_palette_large": SEQ_PALETTE_LARGE, "free_color": FREE_COLOR,
            "cached_free_color": CACHED_FREE_COLOR,
            "edge_color": EDGE_COLOR, "spec_rejected_color": SPEC_REJECTED_COLOR}


def live_page(model_name: str, backlog: list) -> str:
    """The page, with the colours and the recent steps written in (``</`` escaped: it sits in a <script>)."""
    html = (STATIC / "live.html").read_text(encoding="utf-8")
    steps = ("[" + ",".join(backlog) + "]").replace("</", "<\\/")
    return html.replace("/*CONFIG*/{}", json.dumps(page_config(model_name))).replace("/*BACKLOG*/[]", steps)
