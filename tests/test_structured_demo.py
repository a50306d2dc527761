"""The structured-outputs demo: every drawn byte lies inside its row's mask, and the still is written."""
import pytest

from minibatch.bench.demo import run_demo
from minibatch.bench.structured_demo import WORKLOAD, record
from minibatch.viz.structured import mask_image

pytestmark = pytest.mark.usefixtures("one_thread")


def test_recorded_rows_draw_inside_their_masks(target_model):
    steps = record(target_model, small=True)
    rows = [r for s in steps for r in s["rows"]]
    assert {r["seq_id"] for r in rows} == {rid for rid, *_ in WORKLOAD}
    assert all(r["allowed"] is None or r["allowed"][r["token"]] for r in rows), "a byte drawn outside its mask"
    assert any(r["allowed"] is not None and sum(r["allowed"]) == 1 for r in rows), "JSON has forced bytes"
    img = mask_image(steps[0]["rows"])
    assert img.shape == (len(WORKLOAD), 256) and set(img[-1]) == {0.35}, "the free row is drawn pale all through"


def test_demo_writes_the_still_and_prints_the_steps(tmp_path, capsys):
    out = tmp_path / "structured.gif"
    assert run_demo("structured", out=str(out), small=True) == 0
    assert (tmp_path / "structured.png").stat().st_size > 0
    assert run_demo("structured", text_only=True, small=True) == 0
    text = capsys.readouterr().out
    assert "[0-9] (10 bytes)" in text and "any byte" in text and "wrote" in text
