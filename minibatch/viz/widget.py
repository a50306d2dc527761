"""Jupyter widgets: step through a recorded run, or drive an engine live.

    step_through(traces)   Play + slider + Prev / Next over a recorded trace
    live(engine)           a "Step" button that calls engine.step() once per click

Both redraw the ``draw_step`` dashboard into an ``ipywidgets.Image`` as PNG
bytes, so they show what it shows for the run: the timeline, the block pool and
tables, and the panels the run has (``draw_step`` decides from the traces: the
host pool beside the device's, the token tree of a tree-verifying run, the radix
tree of a ``prefix_cache="radix"`` run beside the block tables, the CPU and model
lanes of an asynchronous one). An Image (rather than ``display(fig)`` inside an Output) works with any
matplotlib backend, does not flicker, and can be checked without a browser:
the returned VBox carries ``.slider``, ``.image``, ``.step(n)``, ``.next()``,
``.prev()``, ``.current_step`` and ``.redraws``, so a test (or a lecture
script) can drive it exactly as the buttons do.

Redraws cost 0.5-3 s each, slower than Play's 700 ms tick on a busy CPU, so:

* requests are **coalesced**: a slider change only records the step wanted and
  schedules one render on the kernel's event loop; changes that arrive before
  it runs replace the wanted step, so a backlog of Play ticks costs one render
  of the newest step, not one render each (and the picture stops when Play does);
* rendered frames are **cached** by step: stepping back, or a second Play
  through the run, shows stored PNGs (``.redraws`` counts real renders).

A static render (nbconvert, GitHub) has no widget front end, so for it the
widget's display data can carry an HTML player of a few frames. Building it
costs seconds, and a live JupyterLab never shows it, so it is built only where
no widget front end is attached (see ``widget_frontend``) or on request
(``static_html=True``).

ipywidgets is imported inside the functions: ``import minibatch`` must work
where Jupyter is not installed.
"""
from __future__ import annotations

import io

from minibatch.trace import TraceRecorder
from minibatch.viz.anim import new_figure, to_html
from minibatch.viz.common import as_traces
from minibatch.viz.dashboard import draw_step, step_title


def _png(traces, step, fig, preset="default", meta=None) -> bytes:
    draw_step(traces, step, fig=fig, preset=preset, meta=meta)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _fallback(traces, reason):
    """No ipywidgets: the self-contained HTML player, if IPython can show it."""
    try:
        from IPython.display import HTML
    except ImportError:
        raise ImportError(f"step_through needs ipywidgets ({reason}), or at least IPython for the HTML "
                          "fallback; without either use save(traces, 'run.html') or print_trace(traces)") from None
    return HTML(to_html(traces, max_frames=40, dpi=70))


def _shown_step(traces, value):
    """The step to draw for slider value ``value``: itself, or the last recorded step before it."""
    earlier = [t.step for t in traces if t.step <= value]
    return earlier[-1] if earlier else traces[0].step


def widget_frontend() -> bool:
    """Is a front end that shows widgets attached to this kernel? Either sign suffices:

    * the kernel was started by a Jupyter server for a notebook session: jupyter_server 2 sets
      ``JPY_SESSION_NAME`` for every session kernel, that is for JupyterLab and Notebook in a browser;
    * ipywidgets' control comm is open (``Widget._control_comm``): a widget manager that connected after
      ipywidgets was imported asked it for the widgets' state (on a page reload, say). Checked in JupyterLab:
      at page load ipywidgets is not imported yet, so this alone misses the usual case.

    nbconvert, nbclient and papermill start kernels without a session, and plain Python has no kernel."""
    import os
    if os.environ.get("JPY_SESSION_NAME"):
        return True
    try:
        from ipywidgets import Widget
    except ImportError:
        return False
    return getattr(Widget, "_control_comm", None) is not None


SETTLE_S = 0.05     # how long a scheduled render waits for newer requests already on their way


def _event_loop_soon():
    """A scheduler on the running event loop (a kernel handling a comm message): it runs work ``SETTLE_S``
    later, after the messages already waiting have been handled; None outside an event loop (plain Python:
    render at once). ``call_soon`` would not do: the kernel runs ready callbacks between two messages."""
    import asyncio
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return lambda fn: loop.call_later(SETTLE_S, fn)


class Coalescer:
    """Run ``render(value)`` for the newest requested value only. ``request(v)`` records v and, unless a
    render is already scheduled, schedules one with ``soon`` (None: render now)."""

    def __init__(self, render, soon=_event_loop_soon):
        self.render, self.soon = render, soon
        self.wanted, self.scheduled, self.skipped = None, False, 0

    def request(self, value):
        if self.scheduled:
            self.skipped += 1                                # a newer request replaces the waiting one
        self.wanted = value
        if self.scheduled:
            return
        schedule = self.soon() if callable(self.soon) else None
        if schedule is None:
            self.flush()
        else:
            self.scheduled = True
            schedule(self.flush)

    def flush(self):
        self.scheduled = False
        self.render(self.wanted)


class FrameCache(dict):
    """step -> PNG bytes, the oldest dropped past ``limit`` frames."""

    def __init__(self, limit: int = 256):
        super().__init__()
        self.limit = limit

    def put(self, key, png):
        self[key] = png
        while len(self) > self.limit:
            del self[next(iter(self))]


def step_through(traces, interval: int = 700, dpi: int = 90, static_frames: int = 8, static_html=None,
                 preset: str = "default"):
    """A widget to step through ``traces`` (VBox; see the module doc for its handles).

    ``static_html``: None (default) puts an HTML player of ``static_frames`` steps into the widget's display
    data only where no widget front end is attached (an nbconvert or GitHub render shows it); True always;
    False (or ``static_frames=0``) never. Extra handles: ``.frames`` (the cache), ``.coalescer``."""
    meta = traces.meta if isinstance(traces, TraceRecorder) else None
    traces = as_traces(traces)
    try:
        import ipywidgets as W
    except ImportError as e:
        return _fallback(traces, str(e))
    steps = [t.step for t in traces]
    fig = new_figure(dpi=dpi, preset=preset, traces=traces)
    slider = W.IntSlider(value=steps[0], min=steps[0], max=steps[-1], description="step",
                         continuous_update=False, layout=W.Layout(width="60%"))
    play = W.Play(value=steps[0], min=steps[0], max=steps[-1], step=1, interval=interval)
    W.link((play, "value"), (slider, "value"))          # kernel-side link: works without a front end
    prev_button, next_button = W.Button(description="◀ Prev"), W.Button(description="Next ▶")
    image, caption = W.Image(format="png"), W.HTML()
    box = W.VBox([W.HBox([play, prev_button, next_button, slider]), caption, image])
    box.slider, box.play, box.image, box.caption, box.figure = slider, play, image, caption, fig
    box.prev_button, box.next_button = prev_button, next_button
    box.redraws, box.current_step, box.frames = 0, None, FrameCache()

    def show(value):
        step = _shown_step(traces, value)
        if step not in box.frames:
            box.frames.put(step, _png(traces, step, fig, preset, meta))
            box.redraws += 1
        image.value = box.frames[step]
        caption.value = f"<code>{step_title(next(t for t in traces if t.step == step))}</code>"
        box.current_step = step

    box.coalescer, now = Coalescer(show), [False]

    def changed(change):
        if now[0]:
            show(change["new"])                           # a call from code: its caller reads the result next
        else:
            box.coalescer.request(change["new"])          # Play, the slider, the buttons: only the newest counts

    def go(n, at_once=True):
        if not steps[0] <= n <= steps[-1]:
            raise ValueError(f"step {n} is outside the trace (steps {steps[0]}..{steps[-1]})")
        now[0] = at_once
        try:
            slider.value = n                              # the observer redraws
        finally:
            now[0] = False

    slider.observe(changed, names="value")
    prev_button.on_click(lambda _: go(max(steps[0], slider.value - 1), at_once=False))
    next_button.on_click(lambda _: go(min(steps[-1], slider.value + 1), at_once=False))
    box.step = go
    box.next = lambda: go(min(steps[-1], slider.value + 1))
    box.prev = lambda: go(max(steps[0], slider.value - 1))
    show(steps[0])
    if static_frames and static_html is not False:
        widget_bundle, cache = box._repr_mimebundle_, {}

        def bundle(**kwargs):                              # front ends pick the widget view, static ones the HTML
            data = widget_bundle(**kwargs)
            if static_html is None and widget_frontend():
                return data                                # JupyterLab shows the widget: no HTML to build
            if "html" not in cache:
                cache["html"] = _static_html(traces, static_frames)
            return {**data, "text/html": cache["html"]}
        box._repr_mimebundle_ = bundle
    return box


def _static_html(traces, frames: int) -> str:
    """The HTML player (an HTML fragment, frames embedded) that stands in for the widget in a static render."""
    from minibatch.viz.anim import animate, self_contained
    return self_contained(animate(traces, max_frames=frames, dpi=60).to_jshtml())


def live(engine, recorder: TraceRecorder = None, dpi: int = 90, run_limit: int = 1000):
    """A widget that advances ``engine`` one step per click of "Step" and redraws.

    It registers ``recorder`` (a new TraceRecorder if None) with
    ``engine.add_hook`` and draws from the traces it collects; the slider scrubs
    back through the history. "Run to end" steps until no request is left (at
    most ``run_limit`` steps). Programmatic handles: ``.step_once()``,
    ``.run()``, ``.recorder``, ``.slider``, ``.image``, ``.status``, ``.redraws``.
    """
    for name in ("step", "has_unfinished_requests", "add_hook"):
        if not callable(getattr(engine, name, None)):
            raise TypeError(f"live() needs an engine with .step(), .has_unfinished_requests() and "
                            f".add_hook(fn); {type(engine).__name__} has no {name}()")
    try:
        import ipywidgets as W
    except ImportError as e:
        raise ImportError(f"live() needs ipywidgets ({e}); without Jupyter, record the run with a "
                          "TraceRecorder hook and use save(...) or print_trace(...)") from None
    recorder = TraceRecorder() if recorder is None else recorder
    engine.add_hook(recorder)
    fig = new_figure(dpi=dpi)
    step_button, run_button = W.Button(description="Step", button_style="primary"), W.Button(description="Run to end")
    slider = W.IntSlider(value=0, min=0, max=0, description="view", disabled=True, continuous_update=False)
    image, status = W.Image(format="png"), W.HTML("press <b>Step</b> to run one engine iteration")
    box = W.VBox([W.HBox([step_button, run_button, slider]), status, image])
    box.recorder, box.slider, box.image, box.status, box.figure = recorder, slider, image, status, fig
    box.step_button, box.run_button, box.redraws, box.current_step = step_button, run_button, 0, None
    quiet = [False]                                       # True while step_once moves the slider itself

    frames = FrameCache(64)                               # a frame depends on the whole run so far

    def show(value):
        traces = recorder.traces
        step = _shown_step(traces, value)
        key = (step, len(traces))
        if key not in frames:
            frames.put(key, _png(traces, step, fig))
            box.redraws += 1
        image.value = frames[key]
        status.value = f"<code>{step_title(next(t for t in traces if t.step == step))}</code>"
        box.current_step = step

    def step_once():
        """One engine.step(); returns its outputs (None when nothing is left to run)."""
        if not engine.has_unfinished_requests():
            status.value = "all requests have finished: add requests to the engine to continue"
            return None                                   # (buttons stay live: more may be added)
        before = len(recorder)
        outputs = engine.step()
        if len(recorder) == before:
            status.value = "engine.step() recorded no trace (nothing was scheduled)"
            return outputs
        quiet[0] = True
        slider.min, slider.disabled = recorder.traces[0].step, False
        slider.max = slider.value = recorder.traces[-1].step
        quiet[0] = False
        show(slider.value)
        return outputs

    def run():
        for _ in range(run_limit):
            done = not engine.has_unfinished_requests()
            step_once()                                   # the last call reports "all finished"
            if done:
                return

    def clicked(action):
        try:
            action()
        except Exception as e:                            # a callback must not die silently
            status.value = f"<b>error</b>: {type(e).__name__}: {e}"

    slider.observe(lambda change: quiet[0] or show(change["new"]), names="value")
    step_button.on_click(lambda _: clicked(step_once))
    run_button.on_click(lambda _: clicked(run))
    box.step_once, box.run = step_once, run
    return box
