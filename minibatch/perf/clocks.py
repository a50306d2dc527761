"""Both clocks side by side, for lectures and notebooks: what a run costs here, and on a GPU.

    from minibatch.perf import compare_clocks
    print(compare_clocks({"static": static_traces, "continuous": cont_traces}, "h100:llama-3-8b"))

``retime(traces, spec)`` stamps ``simulated_time`` / ``simulated_duration`` on recorded traces (a saved
run, a demo, a notebook's), exactly as ``EngineConfig(simulate=spec)`` does while the engine runs: the
cost model reads only the trace. ``compare_clocks`` then prints, per run, its output tokens, steps, and
seconds and tokens/s on each clock, and the ratio of the last run to the first on each clock; the
lesson is where the two ratios differ. The KV pool of a re-timed run is the one it ran with (the simulated
model's budget applies only when the engine itself runs with ``simulate``).
"""
from __future__ import annotations

from minibatch.perf.cost import CostModel
from minibatch.stats import run_stats


def retime(traces, spec: str) -> list:
    """The traces, each stamped with its simulated start and duration on ``spec`` (e.g. 'h100:llama-3-8b')."""
    cm, clock = CostModel.from_spec(spec), 0.0
    traces = list(traces)
    for t in traces:
        t.simulated_time, t.simulated_duration = clock, cm.step_time(t)
        clock += t.simulated_duration
    return traces


def clock_rows(runs: dict, spec: str) -> dict:
    """name -> {"tokens", "steps", "wall_s", "wall_tok_s", "sim_s", "sim_tok_s"} (wall: the measured durations)."""
    rows = {}
    for name, traces in runs.items():
        traces = retime(traces, spec)
        wall, sim = run_stats(traces, "wall"), run_stats(traces, "simulated")
        n = wall["generated_tokens"]
        rows[name] = {"tokens": n, "steps": wall["num_steps"], "wall_s": wall["step_time"],
                      "wall_tok_s": n / wall["step_time"], "sim_s": sim["step_time"],
                      "sim_tok_s": n / sim["step_time"]}
    return rows


def compare_clocks(runs: dict, spec: str = "h100:llama-3-8b") -> str:
    """A table of each run on the wall clock (this machine) and the simulated one, and last/first per clock."""
    if not isinstance(runs, dict) or not runs:
        raise ValueError("runs must be a non-empty dict: name -> list of StepTrace")
    rows = clock_rows(runs, spec)
    w = max(len("run"), *(len(str(n)) for n in rows))
    lines = [f"{'run':<{w}}  {'tokens':>7}  {'steps':>6}  {'wall s':>8}  {'wall tok/s':>10}  "
             f"{'sim s':>8}  {'sim tok/s':>10}   (wall: this machine, measured; sim: {spec}, simulated)"]
    for name, r in rows.items():
        lines.append(f"{name:<{w}}  {r['tokens']:>7}  {r['steps']:>6}  {r['wall_s']:>8.3f}  {r['wall_tok_s']:>10.1f}  "
                     f"{r['sim_s']:>8.4f}  {r['sim_tok_s']:>10.1f}")
    if len(rows) > 1:
        (a, ra), (b, rb) = next(iter(rows.items())), list(rows.items())[-1]
        lines.append(f"{b} / {a} in tokens/s: {rb['wall_tok_s'] / ra['wall_tok_s']:.2f}x on the wall clock, "
                     f"{rb['sim_tok_s'] / ra['sim_tok_s']:.2f}x on the simulated one")
    return "\n".join(lines)
