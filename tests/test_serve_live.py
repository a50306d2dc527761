"""The live page at /, rendered by headless Chromium while requests run: the timeline and the pool are drawn.

To catch a busy moment rather than the end, the test freezes the engine
mid-run (a call on the engine thread that waits), renders the page, then lets
it go. Set MINIBATCH_LIVE_SCREENSHOT=path.png to keep the screenshot.
"""
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections import Counter

import httpx
import pytest

from minibatch import LLM
from minibatch.serve import ServerThread
from minibatch.viz.common import PHASE_COLORS
from minibatch.viz.palette import SEQ_PALETTE

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = [pytest.mark.serve,
              pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium to render the live page "
                                 "(on Debian: apt-get install chromium)")]


def chromium(url, *args) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--timeout=5000", *args, url], capture_output=True, text=True, timeout=90)


def rgb(hex_color: str) -> tuple:
    return tuple(int(hex_color[i:i + 2], 16) for i in (1, 3, 5))


def svg(dom: str, name: str) -> str:
    m = re.search(rf'<svg id="{name}".*?</svg>', dom, re.S)
    assert m, f"no <svg id={name}> in the page"
    return m.group(0)


def test_the_live_page_draws_the_timeline_and_the_pool(tmp_path):
    llm = LLM("target", device="cpu", num_gpu_blocks=48, max_num_seqs=8)
    with ServerThread(llm) as srv:
        empty = chromium(srv.url + "/", "--dump-dom").stdout
        assert "no requests yet" in svg(empty, "timeline")

        done = []

        def send(i):
            r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "prompt": "import os\nimport sys\n\ndef main%d(argv):\n" % i, "max_tokens": 10 + 12 * i,
                "temperature": 0})
            done.append(r.status_code)
        threads = [threading.Thread(target=send, args=(i,)) for i in range(12)]
        for t in threads:                       # 12 requests for an 8-sequence batch: some wait their turn
            t.start()
            time.sleep(0.05)
        deadline = time.monotonic() + 60
        while len(done) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        gate = threading.Event()
        frozen = srv.engine_loop.call(lambda engine: gate.wait(60))      # the engine stops between two steps
        try:
            png = tmp_path / "live.png"
            shot = chromium(srv.url + "/", "--window-size=1400,800", f"--screenshot={png}")
            dom = chromium(srv.url + "/", "--dump-dom").stdout
        finally:
            gate.set()
        frozen.result(10)
        for t in threads:
            t.join(120)
        assert done == [200] * 12
    assert png.exists(), shot.stderr[-2000:]
    if os.environ.get("MINIBATCH_LIVE_SCREENSHOT"):
        shutil.copy(png, os.environ["MINIBATCH_LIVE_SCREENSHOT"])

    cells = Counter(re.findall(r'class="cell (\w+)"', svg(dom, "timeline")))
    assert cells["decode"] > 100 and cells["prefill"] >= 1 and cells["finished"] >= 1, cells
    blocks = Counter(re.findall(r'class="block (\w+)"', svg(dom, "pool")))
    assert blocks["used"] >= 5, f"the running requests hold blocks: {blocks}"
    assert re.search(r'id="step">\d+<', dom) and "KV block pool:" in dom

    from PIL import Image
    pixels = Counter({color: n for n, color in Image.open(png).convert("RGB").getcolors(maxcolors=1 << 24)})
    assert pixels[rgb(PHASE_COLORS["decode"])] > 3000, "decode cells, in the matplotlib views' green"
    assert pixels[rgb(PHASE_COLORS["prefill"])] > 30, "a prefill cell, in their blue"
    assert sum(pixels[rgb(c)] > 100 for c in SEQ_PALETTE) >= 3, "rows and blocks in the sequences' colours"


def test_the_live_page_draws_the_radix_tree():
    """serve --prefix-cache radix: the page draws the tree the last step recorded, a box per node, the locked
    ones (running requests' paths) framed, the evictable leaves (a finished request's tail) hatched."""
    stem = "import os\nimport sys\n# a shared header\n"                  # 38 bytes: 4 full blocks of 8
    llm = LLM("target", device="cpu", block_size=8, num_gpu_blocks=64, max_num_seqs=4, prefix_cache="radix")
    with ServerThread(llm) as srv:
        post = lambda prompt, n: httpx.post(srv.url + "/v1/completions", timeout=120, json={  # noqa: E731
            "prompt": prompt, "max_tokens": n, "temperature": 0})
        assert post("print('no shared prefix here')\n", 2).status_code == 200    # done: its leaf is evictable
        done = []
        threads = [threading.Thread(target=lambda i=i: done.append(post(stem + f"def f{i}(x):\n", 200).status_code))
                   for i in range(3)]
        for t in threads:
            t.start()
        feed, deadline = srv.app.state.feed, time.monotonic() + 60
        while time.monotonic() < deadline:                                # until all three run on the stem
            last = json.loads(feed.backlog()[-1])
            if len(last["running"]) == 3 and not last["waiting"]:
                break
            time.sleep(0.01)
        gate, stopped = threading.Event(), threading.Event()
        frozen = srv.engine_loop.call(lambda engine: (stopped.set(), gate.wait(60)))   # stops between two steps
        try:
            assert stopped.wait(30)                                       # now the last step fed stays the last
            frozen_at = json.loads(feed.backlog()[-1])
            dom = chromium(srv.url + "/", "--dump-dom").stdout
        finally:
            gate.set()
        frozen.result(10)
        for t in threads:
            t.join(120)
        assert done == [200] * 3
    rows = frozen_at["radix_nodes"][1:]
    assert len(frozen_at["running"]) == 3 and rows, frozen_at["running"]
    tree = svg(dom, "radix")
    nodes = re.findall(r'<rect class="node([\w ]*)"', tree)
    assert len(nodes) == len(rows) + 1                                    # a box a node, and the root
    locked, evictable = sum("locked" in c for c in nodes), sum("evictable" in c for c in nodes)
    assert locked == sum(r[5] > 0 for r in rows) >= 1 and evictable == sum(r[6] for r in rows) >= 1
    for n in {r[5] for r in rows}:
        assert tree.count(f">lock_ref {n}<") == sum(r[5] == n for r in rows)
    assert f"radix tree: {len(rows)} node" in dom
