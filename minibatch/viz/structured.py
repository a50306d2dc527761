"""Structured outputs, drawn: a few steps' batches (left) beside each row's 256-wide mask (right).

Reads plain data, one dict a step (what ``minibatch.bench.structured_demo.record`` makes; no engine state):

    {"step": int, "rows": [{"seq_id": str, "label": str ("regex [0-9]{1,3}", "unconstrained", ...),
                           "text": str (the output before this step), "allowed": [256] bools or None
                           (no constraint), "token": int or None (the byte drawn this step)}]}

Right panel: row r, column b is lit when the row's grammar allows byte b next (an unconstrained row is lit all
through, paler); the byte the row drew is ringed. Columns are bytes 0..255, with ticks at the printable ASCII
landmarks, so a digit class is a short bar at 48..57 and a JSON string's body is nearly the whole printable block.
"""
from __future__ import annotations

import numpy as np

from minibatch.viz.common import figsize_for, style, styled

LANDMARKS = {0x20: "' '", 0x30: "'0'", 0x41: "'A'", 0x61: "'a'", 0x7F: "127", 0xFF: "255"}


def mask_image(rows: list) -> np.ndarray:
    """[R, 256] floats: 1 allowed by a grammar, 0.35 an unconstrained row's byte, 0 refused."""
    img = np.zeros((len(rows), 256))
    for r, row in enumerate(rows):
        img[r] = 0.35 if row["allowed"] is None else np.asarray(row["allowed"], dtype=float)
    return img


def _shown(text: str, width: int = 28) -> str:
    text = text.replace("\n", "\u21b5")
    return text if len(text) <= width else "\u2026" + text[-width + 1:]


@styled
def draw_structured_steps(steps: list, labels: dict = None, fig=None):
    """Consecutive steps' rows, stacked (step 0's rows on top): the batch (left) and the masks (right), on
    ``fig`` (a new one if None); ``labels``: seq id -> its constraint, for the legend. Returns the figure."""
    from minibatch.viz.anim import new_figure
    p = style()
    fig = fig or new_figure(figsize_for((14, 6)))
    rows = [dict(row, step=st["step"]) for st in steps for row in st["rows"]]
    if not rows:
        raise ValueError("no rows to draw: pass steps whose rows sampled a byte")
    left, right = fig.subplots(1, 2, width_ratios=[1, 1.5])
    left.set_axis_off()
    left.set_ylim(len(rows) - 0.5, -0.5)
    left.set_xlim(0, 1)
    for r, row in enumerate(rows):
        drew = "" if row["token"] is None else repr(bytes([row["token"]]).decode("latin-1"))
        left.text(0, r, f"{row['step']:>2} {row['seq_id']:<6} {_shown(row['text'], 18)} + {drew}",
                  fontsize=p.small, va="center", family="monospace")
    left.set_title("step, sequence: output so far + the byte drawn", fontsize=p.font, loc="left")
    if labels:
        left.text(0, len(rows) - 0.5, "\n".join(f"{k}: {v}" for k, v in labels.items()), fontsize=p.small,
                  va="top", family="monospace", color="#555555")
    right.imshow(mask_image(rows), aspect="auto", cmap="Greens", vmin=0, vmax=1, interpolation="nearest")
    for r, row in enumerate(rows):
        if row["token"] is not None:
            right.scatter([row["token"]], [r], s=p.px(p.small) * 4, facecolors="none", edgecolors="#CC3311",
                          linewidths=2)
    for r in range(1, len(rows)):               # a rule between steps
        if rows[r]["step"] != rows[r - 1]["step"]:
            right.axhline(r - 0.5, color="#999999", lw=1)
    right.set_yticks(range(len(rows)), [row["seq_id"] for row in rows], fontsize=p.small)
    right.set_xticks(list(LANDMARKS), list(LANDMARKS.values()), fontsize=p.small)
    right.set_xlim(-0.5, 255.5)
    right.set_title("each row's mask: allowed next byte (lit), drawn (ringed)", fontsize=p.font, loc="left")
    right.set_xlabel("byte", fontsize=p.font)
    return fig
