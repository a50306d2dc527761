"""Jupyter widgets: step through a recorded run, or drive an engine live.

    step_through(traces)   Play + slider + Prev / Next over a recorded trace
    live(engine)           a "Step" button that calls engine.step() once per click

Both redraw the ``draw_step`` dashboard into an ``ipywidgets.Image`` as PNG
bytes. An Image (rather than ``display(fig)`` inside an Output) works with any
matplotlib backend, does not flicker, and can be checked without a browser:
the returned VBox carries ``.slider``, ``.image``, ``.step(n)``, ``.next()``,
``.prev()``, ``.current_step`` and ``.redraws``, so a test (or a lecture
script) can drive it exactly as the buttons do.

ipywidgets is imported inside the functions: ``import minibatch`` must work
where Jupyter is not installed.
"""
from __future__ import annotations

import io

from minibatch.trace import TraceRecorder
from minibatch.viz.anim import new_figure, to_html
from minibatch.viz.common import as_traces
from minibatch.viz.dashboard import draw_step, step_title


def _png(traces, step, fig) -> bytes:
    draw_step(traces, step, fig=fig)
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


def step_through(traces, interval: int = 700, dpi: int = 90, static_frames: int = 24):
    """A widget to step through ``traces`` (VBox; see the module doc for its handles).

    A static render of the notebook (nbconvert, GitHub) has no widget front end: for it the widget's
    display data also carry ``text/html``, the HTML player over ``static_frames`` steps, drawn when
    the widget is displayed (a few seconds); ``static_frames=0`` leaves it out."""
    traces = as_traces(traces)
    try:
        import ipywidgets as W
    except ImportError as e:
        return _fallback(traces, str(e))
    steps = [t.step for t in traces]
    fig = new_figure(dpi=dpi)
    slider = W.IntSlider(value=steps[0], min=steps[0], max=steps[-1], description="step",
                         continuous_update=False, layout=W.Layout(width="60%"))
    play = W.Play(value=steps[0], min=steps[0], max=steps[-1], step=1, interval=interval)
    W.link((play, "value"), (slider, "value"))          # kernel-side link: works without a front end
    prev_button, next_button = W.Button(description="◀ Prev"), W.Button(description="Next ▶")
    image, caption = W.Image(format="png"), W.HTML()
    box = W.VBox([W.HBox([play, prev_button, next_button, slider]), caption, image])
    box.slider, box.play, box.image, box.caption, box.figure = slider, play, image, caption, fig
    box.prev_button, box.next_button = prev_button, next_button
    box.redraws, box.current_step = 0, None

    def show(value):
        step = _shown_step(traces, value)
        image.value = _png(traces, step, fig)
        caption.value = f"<code>{step_title(next(t for t in traces if t.step == step))}</code>"
        box.current_step, box.redraws = step, box.redraws + 1

    def go(n):
        if not steps[0] <= n <= steps[-1]:
            raise ValueError(f"step {n} is outside the trace (steps {steps[0]}..{steps[-1]})")
        slider.value = n                                  # the observer below redraws

    slider.observe(lambda change: show(change["new"]), names="value")
    prev_button.on_click(lambda _: go(max(steps[0], slider.value - 1)))
    next_button.on_click(lambda _: go(min(steps[-1], slider.value + 1)))
    box.step = go
    box.next = lambda: go(min(steps[-1], slider.value + 1))
    box.prev = lambda: go(max(steps[0], slider.value - 1))
    show(steps[0])
    if static_frames:
        widget_bundle, cache = box._repr_mimebundle_, {}

        def bundle(**kwargs):                              # front ends pick the widget view, static ones the HTML
            if "html" not in cache:
                cache["html"] = _static_html(traces, static_frames)
            return {**widget_bundle(**kwargs), "text/html": cache["html"]}
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

    def show(value):
        traces = recorder.traces
        step = _shown_step(traces, value)
        image.value = _png(traces, step, fig)
        status.value = f"<code>{step_title(next(t for t in traces if t.step == step))}</code>"
        box.current_step, box.redraws = step, box.redraws + 1

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
