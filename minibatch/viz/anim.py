"""Animations and files: the dashboard, one frame per engine step.

``animate`` returns a matplotlib ``FuncAnimation`` whose frame n redraws
``draw_step`` for the n-th chosen step. ``save`` writes it by file suffix:

    .gif   PillowWriter (pillow ships with matplotlib's usual installs)
    .html  one self-contained page: ``to_jshtml()`` with every frame embedded as a
           base64 PNG, and the player's icon font (fetched from a CDN by
           matplotlib's template) replaced by plain Unicode, so it opens offline
    .mp4   only where matplotlib finds ffmpeg; else WriterUnavailableError says so
    .png   one dashboard (``step=``; default the step with the most blocks in use),
           or a contact sheet of ``steps=[...]`` two per row

Everything renders on a plain ``Figure`` with the Agg canvas: headless, and
nothing pops up twice in a notebook. Long traces are sub-sampled to
``max_frames`` evenly spaced steps (first and last kept) so saving stays fast.
``preset="slide"`` draws 1920×1080 frames with text of 18 px and more, for a
projector (``python -m minibatch demo`` uses it); ``dpi`` overrides the
preset's pixels per inch (smaller files, smaller text).
"""
from __future__ import annotations

import pathlib
import re

import numpy as np
from matplotlib import animation
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from minibatch.trace import TraceRecorder
from minibatch.viz.common import as_traces, dashboard_size, find_step, get_preset
from minibatch.viz.dashboard import draw_step
from minibatch.viz.usage import kv_usage

SUFFIXES = (".gif", ".html", ".mp4", ".png")


class WriterUnavailableError(RuntimeError):
    """The file format needs a tool (ffmpeg) that this machine does not have."""


def check_writer(suffix: str) -> None:
    """Raise WriterUnavailableError now if this machine cannot write ``suffix`` (.mp4 needs ffmpeg)."""
    if suffix.lower() == ".mp4" and not animation.writers.is_available("ffmpeg"):
        raise WriterUnavailableError("saving .mp4 needs ffmpeg, which matplotlib cannot find on this machine; "
                                     "install ffmpeg, or save as .gif or .html instead")


def frame_steps(traces, steps=None, max_frames: int = 60) -> list:
    """The step numbers to draw: ``steps`` (checked) or all, thinned to ``max_frames``."""
    traces = as_traces(traces)
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    if steps is None:
        steps = [t.step for t in traces]
    else:
        steps = list(steps)
        for s in steps:
            find_step(traces, s)                      # a clear error for a step not in the trace
        if not steps:
            raise ValueError("steps is empty: choose at least one step to draw")
    if len(steps) > max_frames:
        keep = np.unique(np.linspace(0, len(steps) - 1, max_frames).round().astype(int))
        steps = [steps[i] for i in keep]
    return steps


def new_figure(figsize=None, dpi: int = None, preset="default", traces=None) -> Figure:
    """A figure outside pyplot (no window, no double display), drawn by Agg; size and dpi by default
    from ``preset`` (the dashboard's size at "default", wider when ``traces`` hold token trees)."""
    p = get_preset(preset)
    fig = Figure(figsize=figsize or p.figsize or dashboard_size(traces), dpi=dpi or p.dpi)
    FigureCanvasAgg(fig)
    return fig


def _meta(traces):
    return traces.meta if isinstance(traces, TraceRecorder) else None


def animate(traces, interval: int = 700, steps=None, max_frames: int = 60, dpi: int = None,
            figsize=None, preset="default") -> animation.FuncAnimation:
    """The dashboard across steps, ``interval`` ms per frame."""
    meta, traces = _meta(traces), as_traces(traces)
    chosen = frame_steps(traces, steps, max_frames)
    fig = new_figure(figsize, dpi, preset, traces)

    def update(step):
        draw_step(traces, step, fig=fig, meta=meta, preset=preset)
        return fig.axes

    return animation.FuncAnimation(fig, update, frames=chosen, interval=interval, repeat=True,
                                   cache_frame_data=False)


_ICONS = {"fa fa-minus": "&minus;", "fa fa-plus": "+", "fa fa-fast-backward": "&#8676;",
          "fa fa-step-backward": "&#9664;", "fa fa-play fa-flip-horizontal": "&#9665;",
          "fa fa-pause": "&#10074;&#10074;", "fa fa-play": "&#9655;", "fa fa-step-forward": "&#9654;",
          "fa fa-fast-forward": "&#8677;"}


def self_contained(html: str) -> str:
    """Drop external stylesheets and swap icon-font glyphs for Unicode."""
    html = re.sub(r"<link[^>]*href=\"https?://[^>]*>", "", html)
    html = re.sub(r'<i class="([^"]*)"></i>', lambda m: _ICONS.get(m.group(1), m.group(1)), html)
    return html


def to_html(traces, title: str = "minibatch trace", **kw) -> str:
    """A whole HTML page with the animation player and every frame embedded."""
    body = self_contained(animate(traces, **kw).to_jshtml())
    return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{title}</title></head>\n'
            f"<body>\n<h3>{title}</h3>\n{body}\n</body></html>\n")


def busiest_step(traces) -> int:
    """The step with the most KV blocks in use (the earliest on a tie): a good still."""
    kv = kv_usage(traces)
    return int(kv["steps"][int(np.argmax(kv["used"]))])


def _contact_sheet(traces, steps, path, dpi, preset, meta):
    from PIL import Image
    tiles = []
    for s in steps:
        fig = new_figure(dpi=dpi, preset=preset, traces=traces)
        draw_step(traces, s, fig=fig, meta=meta, preset=preset)
        fig.canvas.draw()
        tiles.append(np.asarray(fig.canvas.buffer_rgba())[..., :3])
    h, w = tiles[0].shape[:2]
    cols = min(2, len(tiles))
    rows = -(-len(tiles) // cols)
    sheet = np.full((rows * h, cols * w, 3), 255, np.uint8)
    for i, tile in enumerate(tiles):
        r, c = divmod(i, cols)
        sheet[r * h:(r + 1) * h, c * w:(c + 1) * w] = tile
    Image.fromarray(sheet).save(path)


def save(traces, path, steps=None, max_frames: int = 40, interval: int = 700, dpi: int = None,
         step=None, preset="default") -> pathlib.Path:
    """Write the animation (or a still, for .png) to ``path`` at ``preset`` ("default" or "slide");
    returns the path. ``dpi`` None: the preset's (slide: 1920x1080 px), 80 at the default preset."""
    meta, traces = _meta(traces), as_traces(traces)
    if dpi is None:
        dpi = 80 if get_preset(preset).name == "default" else get_preset(preset).dpi
    path = pathlib.Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"cannot save {path.name!r}: choose a file ending in one of {', '.join(SUFFIXES)}")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot save {path}: the directory {path.parent} does not exist")
    check_writer(suffix)
    if suffix == ".png":
        if steps is None:
            fig = new_figure(dpi=dpi, preset=preset, traces=traces)
            draw_step(traces, busiest_step(traces) if step is None else step, fig=fig, meta=meta, preset=preset)
            fig.savefig(path)
        else:
            _contact_sheet(traces, frame_steps(traces, steps, max_frames), path, dpi, preset, meta)
        return path
    recorded = TraceRecorder(traces, meta)
    if suffix == ".html":
        path.write_text(to_html(recorded, steps=steps, max_frames=max_frames, interval=interval, dpi=dpi,
                                preset=preset), encoding="utf-8")
        return path
    anim = animate(recorded, interval=interval, steps=steps, max_frames=max_frames, dpi=dpi, preset=preset)
    fps = max(1.0, 1000.0 / interval)
    writer = animation.PillowWriter(fps=fps) if suffix == ".gif" else animation.FFMpegWriter(fps=fps)
    anim.save(str(path), writer=writer, dpi=dpi)
    return path
