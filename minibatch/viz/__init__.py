"""Seeing the engine work: renderers, animations, widgets and a text view of step traces.

Everything here reads ``StepTrace`` data only (``minibatch.trace``): record a
run with ``rec = TraceRecorder(); engine.add_hook(rec)``, then

    draw_step(rec, step)          the dashboard of one step (what a slide shows; the widgets and animations too)
    draw_timeline(rec)            batch membership: steps x sequences, cells by phase
    draw_lanes(rec)               the CPU lane and the model lane on the wall clock (async overlaps them)
    draw_blocks(rec, step)        the physical block pool + every sequence's block table
    draw_kv_usage(rec)            used / cached-free / free blocks over steps
    draw_throughput(rec)          tokens per step against the token budget
    draw_comparison(a, b)         two runs of one workload side by side (static vs continuous)
    draw_tree(rec, step)          one sequence's token tree in a verify step, the accepted path coloured
    draw_tree_mask(rec, step)     that tree's attention mask as a heat map (rows query, columns key)
    draw_radix_tree(rec, step)    the radix prefix cache (prefix_cache="radix"): nodes, blocks, locks, evictable
    draw_radix_blocks(rec, step)  ... beside the block pool and the block tables
    animate(rec) / save(rec, "run.gif" | ".html" | ".mp4" | ".png")
    step_through(rec)             Jupyter: Play / slider / Prev / Next
    live(engine)                  Jupyter: one engine.step() per click
    text_view(trace), print_trace(rec)   no graphics at all

Every renderer takes ``preset="slide"`` (1920×1080, no text under 18 px) for a
projector, or draws at its own notebook size by default; ``with using("slide"):``
sets it for a whole block. A saved trace (``rec.save("run.json")``) replays anywhere without a model:
every function also takes the path of such a file. Each renderer draws on an
Axes you pass (or a new figure) and returns a dict of what it drew, so tests
and notebooks can check it. The rooms, one idea each:

    common     phase colours (Okabe–Ito), size presets, input checks
    palette    sequence colours: concurrent sequences never share one (Tol muted / rainbow)
    blocks     block pool and block tables          timeline   batch membership
    usage      occupancy, throughput, comparison    dashboard  draw_step
    anim       animate, save                        widget     step_through, live
    text       text_view, print_trace                tree       draw_tree, draw_tree_mask
    tree_data  step_tree, tree_trace: a tree step as plain data
    lanes      draw_lanes, lane_spans: the CPU's and the model's spans on the wall clock
    radix_tree draw_radix_tree, draw_radix_blocks: the radix cache
"""
# name -> the module that defines it; imported on first use, so the matplotlib-free modules (common, text,
# tree_data; tree and radix_tree until they draw) load without matplotlib and `import minibatch.viz` stays cheap.
_WHERE = {
    **dict.fromkeys(['WriterUnavailableError', 'animate', 'busiest_step', 'frame_steps', 'save', 'to_html'], 'anim'),
    **dict.fromkeys(['block_owners', 'block_state', 'draw_block_tables', 'draw_blocks'], 'blocks'),
    **dict.fromkeys(['PHASE_COLORS', 'PHASE_LABELS', 'PRESETS', 'TraceError', 'as_traces', 'evicted_blocks',
                     'using'], 'common'),
    **dict.fromkeys(['SEQ_PALETTE', 'SEQ_PALETTE_LARGE', 'alive_sets', 'seq_color', 'seq_order'], 'palette'),
    **dict.fromkeys(['draw_step', 'step_title'], 'dashboard'),
    **dict.fromkeys(['print_trace', 'text_view', 'tree_outline'], 'text'),
    **dict.fromkeys(['draw_tree', 'draw_tree_mask'], 'tree'),
    **dict.fromkeys(['step_tree', 'token_label', 'tree_steps', 'tree_trace'], 'tree_data'),
    **dict.fromkeys(['draw_timeline', 'run_title', 'speculation', 'timeline_cells'], 'timeline'),
    **dict.fromkeys(['busy_share', 'draw_lanes', 'lane_spans', 'overlap'], 'lanes'),
    **dict.fromkeys(['draw_comparison', 'draw_kv_usage', 'draw_throughput', 'kv_usage', 'summarize', 'tokens_per_step'], 'usage'),
    **dict.fromkeys(['live', 'step_through'], 'widget'),
    **dict.fromkeys(['draw_radix_blocks', 'draw_radix_tree', 'has_radix_tree', 'radix_boxes'], 'radix_tree'),
}


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module 'minibatch.viz' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"minibatch.viz.{_WHERE[name]}"), name)


__all__ = [
    "draw_step", "draw_timeline", "draw_blocks", "draw_block_tables", "draw_kv_usage", "draw_throughput",
    "draw_comparison", "animate", "save", "to_html", "step_through", "live", "text_view", "print_trace",
    "seq_color", "seq_order", "timeline_cells", "speculation", "block_owners", "block_state", "evicted_blocks",
    "kv_usage", "tokens_per_step", "summarize", "frame_steps", "busiest_step", "step_title", "as_traces",
    "PHASE_COLORS", "PHASE_LABELS", "SEQ_PALETTE", "SEQ_PALETTE_LARGE", "TraceError", "WriterUnavailableError",
    "PRESETS", "using", "alive_sets", "run_title", "draw_tree", "draw_tree_mask", "step_tree", "token_label",
    "tree_steps", "tree_trace", "tree_outline", "draw_lanes", "lane_spans", "overlap", "busy_share",
    "tree_steps", "tree_trace", "tree_outline", "draw_radix_tree", "draw_radix_blocks", "has_radix_tree",
    "radix_boxes",
]
