"""Disaggregated serving drawn: the prefill instance's pool and the decode instance's, side by side, and the
blocks whose K/V crossed between them (``minibatch/distributed/``). Plain data in, a figure out: the traces
(each ``StepTrace.instance`` says whose step it is, ``time`` on the router's clock) and the transfers
(``kv_transfer.Transfer``: source and destination blocks, bytes, when).

A frame is a moment: each pool as its instance's last step before it left it, and the transfers since the
previous frame as arrows from their source blocks (outlined, left) to their destination blocks (right).
"""
from __future__ import annotations

import pathlib

from matplotlib import animation
from matplotlib.figure import Figure
from matplotlib.patches import ConnectionPatch

from minibatch.viz.blocks import draw_blocks
from minibatch.viz.common import get_preset, styled
from minibatch.viz.palette import seq_order

INSTANCES = ("prefill", "decode")


def split_instances(traces) -> dict:
    """{"prefill": [StepTrace], "decode": [StepTrace]}, each in step order."""
    out = {name: [t for t in traces if t.instance == name] for name in INSTANCES}
    if not all(out.values()):
        raise ValueError("these traces are not of a disaggregated run: need steps of both the prefill and the "
                         "decode instance (StepTrace.instance)")
    return out


def frames(traces, transfers, max_frames: int = 40) -> list:
    """[(time, prefill step or None, decode step or None, [transfers since the last frame])], evenly sampled."""
    by = split_instances(traces)
    times = sorted({t.time + t.duration for t in traces} | {tr.t_start + tr.duration for tr in transfers})
    if len(times) > max_frames:
        times = [times[round(i * (len(times) - 1) / (max_frames - 1))] for i in range(max_frames)]
    out, prev = [], float("-inf")
    for now in times:
        last = {n: max((t.step for t in ts if t.time + t.duration <= now), default=None) for n, ts in by.items()}
        moved = [tr for tr in transfers if prev < tr.t_start + tr.duration <= now]
        out.append((now, last["prefill"], last["decode"], moved))
        prev = now
    return out


@styled
def draw_frame(traces, transfers, frame, fig=None) -> dict:
    """Both pools at ``frame`` (one of ``frames(...)``) and its transfers as arrows; returns the axes and arrows."""
    fig = fig or Figure(figsize=(13, 5.5), layout="constrained")
    fig.clf()
    axes = fig.subplots(1, 2)
    by, order = split_instances(traces), seq_order(traces)
    now, steps, moved = frame[0], {"prefill": frame[1], "decode": frame[2]}, frame[3]
    cells = {}
    for ax, name in zip(axes, INSTANCES):
        if steps[name] is None:
            ax.set_axis_off()
            ax.set_title(f"{name} instance: no step yet")
            continue
        drawn = draw_blocks(by[name], steps[name], ax=ax, order=order, legend=False)
        cells[name] = {c["block"]: c["patches"][0] for c in drawn["cells"] if c["patches"]}
        ax.set_title(f"{name} instance, after its step {steps[name]}\n" + ax.get_title(loc="left"), loc="left")
    arrows = []
    for tr in moved:
        for src, dst in zip(tr.src_blocks, tr.dst_blocks):
            a, b = cells.get("prefill", {}).get(src), cells.get("decode", {}).get(dst)
            if a is None or b is None:
                continue
            arrow = ConnectionPatch(_center(a), _center(b),
                                    "data", "data", axesA=axes[0], axesB=axes[1], arrowstyle="->", color="black",
                                    linewidth=1.5, connectionstyle="arc3,rad=-0.15")
            fig.add_artist(arrow)
            arrows.append(arrow)
    kib = sum(tr.nbytes for tr in moved) / 1024
    fig.suptitle(f"t = {now:.3f} s · {len(moved)} KV transfer(s), {kib:.0f} KiB" if moved else f"t = {now:.3f} s")
    return {"axes": axes, "arrows": arrows, "transfers": moved}


def _center(patch):
    x, y = patch.get_xy()
    return (x + patch.get_width() / 2, y + patch.get_height() / 2)


def save(traces, transfers, path, max_frames: int = 40, interval: int = 600, preset="default") -> pathlib.Path:
    """A GIF (or a .png of the busiest transfer frame) of the run."""
    path, p = pathlib.Path(path), get_preset(preset)
    chosen = frames(traces, transfers, max_frames)
    fig = Figure(figsize=(19.2, 10.8) if p.name == "slide" else (13, 5.5), layout="constrained")
    if path.suffix.lower() == ".png":
        draw_frame(traces, transfers, max(chosen, key=lambda f: len(f[3])), fig=fig, preset=preset)
        fig.savefig(path, dpi=p.dpi if p.name == "slide" else 80)
        return path
    if path.suffix.lower() != ".gif":
        raise ValueError(f"cannot save {path.name!r}: a disaggregated run saves as .gif or .png")
    anim = animation.FuncAnimation(fig, lambda f: draw_frame(traces, transfers, f, fig=fig, preset=preset)["axes"],
                                   frames=chosen, interval=interval, cache_frame_data=False)
    anim.save(str(path), writer=animation.PillowWriter(fps=max(1.0, 1000.0 / interval)),
              dpi=p.dpi if p.name == "slide" else 80)
    return path
