"""step_through inside a real Jupyter kernel, driven over the comm channel the way a front end drives it.

Under load one redraw took longer than Play's tick, the slider's updates
queued up, and the picture fell steps behind and kept moving after a pause
(issue 15). A front end sends each Play tick as a comm "update" message; here
eight arrive while each frame takes 0.4 s to draw. The widget must draw far
fewer frames than it was asked for, end on the newest step, and serve a step
it has drawn before from its cache. No browser is needed: ipykernel handles
the messages exactly as it does for JupyterLab.
"""
import os
import pathlib
import time

import pytest

jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

ROOT = pathlib.Path(__file__).resolve().parents[1]

SETUP = f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
import matplotlib; matplotlib.use("Agg")
from minibatch.viz import widget as W
from minibatch.trace import TraceRecorder
rec = TraceRecorder.load({str(ROOT / "tests/fixtures/engine_continuous.json")!r})
original, rendered = W._png, []
def slow_png(traces, step, fig, *a, **k):      # a busy CPU: a frame takes longer than a Play tick
    rendered.append(step)
    time.sleep(0.4)
    return original(traces, step, fig, *a, **k)
W._png = slow_png
w = W.step_through(rec, dpi=30)
print(w.slider.model_id)
"""


@pytest.fixture
def kernel():
    km, kc = jupyter_client.manager.start_new_kernel(
        kernel_name="python3", env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    try:
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def run(kc, code, timeout=120) -> str:
    msg_id, out = kc.execute(code), []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        if msg["msg_type"] == "error":
            raise AssertionError("\n".join(msg["content"]["traceback"]))
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return "".join(out)


def test_play_ticks_that_pile_up_cost_one_frame_of_the_newest_step(kernel):
    model_id = run(kernel, SETUP).split()[-1]
    for value in range(1, 9):                              # what the front end's Play sends, 50 ms apart
        kernel.session.send(kernel.shell_channel.socket, kernel.session.msg("comm_msg", {
            "comm_id": model_id, "data": {"method": "update", "state": {"value": value}, "buffer_paths": []}}))
        time.sleep(0.05)
    deadline = time.time() + 60
    while True:                                            # until the widget has settled on the newest step
        state = eval(run(kernel, "print((rendered, w.current_step, w.redraws))"))
        if state[1] == 8 or time.time() > deadline:
            break
        time.sleep(0.3)
    rendered, current, redraws = state
    assert current == 8 and rendered[-1] == 8, rendered
    assert len(rendered) <= 4, f"drew {rendered} for 8 requests: stale frames were not skipped"
    assert rendered == sorted(rendered)                    # never back to an older request
    cached = eval(run(kernel, "w.step(rendered[1]); print((w.current_step, w.redraws))"))
    assert cached == (rendered[1], redraws)                # a step drawn before: from the cache
