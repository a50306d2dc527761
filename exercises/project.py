"""The scheduling project, scored: ``python -m exercises.project [--student-dir DIR] [--seed N] [--json PATH]``.

The student's ``ProjectScheduler`` (``project_scheduler.py`` in ``--student-dir``, else this package) runs the
engine on a workload of requests that arrive over time, with the shipped model; so does the engine's own
scheduler, on the same workload in the same process, as the baseline. Each is scored by **goodput**: the
requests that met both latency targets (time to the first token <= TTFT_SLO, time per output token after it
<= TPOT_SLO), per second of the run's clock. The correctness floor comes first: every request finishes and
no block leaks (the allocator's free count is back to its size, its invariants hold); a policy below the
floor scores 0.

The clock is one switch, ``CLOCK``: "cpu" (each step's measured wall time: noisy on a shared machine, so the
baseline runs in the same process) or "simulated" (``StepTrace.simulated_duration`` from the engine's
simulator, ``LLM(..., simulate=SIMULATE)``, once the engine has one); the report names it.

The workload is generated from a seed (``workload``): the practice seed ships; the grader's hidden one lives in
``exercises/project_hidden.py``, which a student release leaves out. Scoring runs in a child process of its
own (``--run``), killed past ``--timeout``, so a policy that hangs or crashes costs the project only.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

CLOCK = "cpu"                          # "cpu" | "simulated": the single switch (see the module docstring)
SIMULATE = "h100:llama-3-8b"           # the simulated target, with CLOCK = "simulated"
PRACTICE_SEED = 1
TTFT_SLO = {"cpu": 1.0, "simulated": 0.5}        # seconds
TPOT_SLO = {"cpu": 0.15, "simulated": 0.05}      # seconds per output token
ENGINE = dict(block_size=8, num_gpu_blocks=48, max_num_seqs=8, max_num_batched_tokens=64)
POINTS_FLOOR, POINTS_GOODPUT = 10, 10            # autograded; the written report is graded by hand
TIMEOUT = 900.0


def workload(seed: int, n: int = 20) -> list:
    """[(arrival s, prompt token ids, max_tokens)], sorted by arrival: bursts of short chats and a few long
    prompts (the mix that makes admission order and chunking matter). Arrivals are in the run's clock."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(8.0) if rng.random() < 0.85 else rng.uniform(0.3, 0.8)
        long = rng.random() < 0.2
        plen = rng.randint(120, 200) if long else rng.randint(8, 40)
        prompt = [rng.randrange(32, 127) for _ in range(plen)]
        out.append((round(t, 3), prompt, rng.randint(4, 12) if long else rng.randint(8, 32)))
    return out


def run_policy(cls, reqs: list, model) -> dict:
    """Serve ``reqs`` with scheduler class ``cls``; per-request TTFT/TPOT on the run's clock, and the floor."""
    import minibatch.engine.engine as engine
    from minibatch import LLM, SamplingParams
    saved = engine.Scheduler
    engine.Scheduler = cls
    try:
        kw = dict(ENGINE, **({"simulate": SIMULATE} if CLOCK == "simulated" else {}))
        llm = LLM(model, enable_prefix_caching=False, **kw)
    finally:
        engine.Scheduler = saved
    eng = llm.llm_engine
    durations = []
    if CLOCK == "simulated":
        eng.add_hook(lambda tr: durations.append(tr.simulated_duration))
    t, i, first, done, steps = 0.0, 0, {}, {}, 0
    while i < len(reqs) or eng.has_unfinished_requests():
        while i < len(reqs) and reqs[i][0] <= t:
            eng.add_request(f"r{i}", reqs[i][1], SamplingParams(temperature=0, max_tokens=reqs[i][2]))
            i += 1
        if not eng.has_unfinished_requests():
            t = reqs[i][0]                              # idle until the next arrival
            continue
        t0 = time.perf_counter()
        outs = eng.step()
        t += durations.pop() if CLOCK == "simulated" else time.perf_counter() - t0
        steps += 1
        if steps > 20000:
            raise RuntimeError("more than 20000 steps: the policy does not finish the workload")
        for o in outs:
            if o.outputs and o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = t
            if o.finished:
                done[o.request_id] = (t, len(o.outputs[0].token_ids))
    alloc = eng.allocator
    leak = alloc.num_blocks - alloc.num_free_blocks         # every request finished: every block comes back
    if leak:
        return {"finished": len(done), "requests": len(reqs), "leaked_blocks": leak}
    alloc.check_invariants([])
    met = 0
    for k, (arrival, _, _) in enumerate(reqs):
        rid = f"r{k}"
        ttft = first[rid] - arrival
        end, n = done[rid]
        tpot = (end - first[rid]) / (n - 1) if n > 1 else 0.0
        met += ttft <= TTFT_SLO[CLOCK] and tpot <= TPOT_SLO[CLOCK]
    span = max(end for end, _ in done.values())
    return {"finished": len(done), "requests": len(reqs), "leaked_blocks": leak, "met_slo": met,
            "seconds": span, "goodput": met / span if span else 0.0}


def _load_student(student_dir: Path):
    path = Path(student_dir) / "project_scheduler.py"
    spec = importlib.util.spec_from_file_location("_minibatch_student_project", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.ProjectScheduler


def _run(student_dir: Path, seed: int, out: Path, num_requests: int = 20) -> None:
    """In the child: baseline and student's policy on the same workload (baseline first, then the student's,
    then the baseline again: the CPU clock drifts on a shared machine, the better baseline run is kept)."""
    import torch
    from minibatch.engine.scheduler import Scheduler
    from minibatch.model.weights import load_model
    torch.manual_seed(0)
    model = load_model("target", device="cpu")
    reqs = workload(seed, num_requests)
    student_cls = _load_student(student_dir)
    base = [run_policy(Scheduler, reqs, model)]
    result = {"clock": CLOCK, "seed_is_practice": seed == PRACTICE_SEED}
    try:
        result["student"] = run_policy(student_cls, reqs, model)
    except Exception as e:                                   # below the floor: say why
        result["student"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    base.append(run_policy(Scheduler, reqs, model))
    result["baseline"] = max(base, key=lambda r: r["goodput"])
    out.write_text(json.dumps(result))


def score(student_dir=None, seed=None, timeout: float = TIMEOUT, num_requests: int = 20) -> dict:
    """Run the project in a child process; {"points", "max_points", "floor", "goodput", "baseline", "output",
    "leaderboard": [{"name", "value", "order"}]}."""
    import tempfile
    student_dir = Path(student_dir or os.environ.get("MINIBATCH_STUDENT_DIR") or Path(__file__).parent).resolve()
    if seed is None:
        try:
            from exercises.project_hidden import SEED as seed      # the instructor's hidden workload
        except ImportError:
            seed = PRACTICE_SEED
    with tempfile.TemporaryDirectory(prefix="minibatch-project-") as tmp:
        out = Path(tmp) / "result.json"
        p = subprocess.Popen([sys.executable, "-m", "exercises.project", "--run", "--student-dir", str(student_dir),
                              "--seed", str(seed), "--result", str(out), "--requests", str(num_requests)], cwd=Path(__file__).resolve().parent.parent,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            log = p.communicate(timeout=timeout)[0].decode(errors="replace")
            why = "" if p.returncode == 0 else f"the project's process exited with status {p.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            log, why = p.communicate()[0].decode(errors="replace"), f"stopped at the time limit of {timeout:g} s"
        res = json.loads(out.read_text()) if out.exists() else {}
    st, base = res.get("student", {}), res.get("baseline", {})
    floor = not why and "error" not in st and st.get("finished") == st.get("requests") and st.get("leaked_blocks") == 0
    if not floor:
        reason = why or st.get("error") or (f"{st.get('finished')} of {st.get('requests')} requests finished, "
                                            f"{st.get('leaked_blocks')} blocks leaked")
        return {"points": 0.0, "max_points": POINTS_FLOOR + POINTS_GOODPUT, "floor": False, "goodput": 0.0,
                "baseline": base.get("goodput", 0.0), "leaderboard": [{"name": "goodput (req/s)", "value": 0.0,
                                                                       "order": "desc"}],
                "output": f"Below the correctness floor: {reason}.\n{log[-1500:]}"}
    # half the goodput points for matching the engine's scheduler, all of them at 1.3 times its goodput
    ratio = st["goodput"] / base["goodput"] if base.get("goodput") else 1.0
    share = min(1.0, max(0.0, 0.5 + (ratio - 1.0) / 0.6))
    quarters = round(4 * POINTS_GOODPUT * share)                   # a dyadic fraction: exact in the sums
    points = POINTS_FLOOR + quarters / 4
    text = (f"clock: {res['clock']}{' (simulated)' if res['clock'] == 'simulated' else ' (CPU wall time)'}; "
            f"{st['met_slo']} of {st['requests']} requests met TTFT <= {TTFT_SLO[CLOCK]} s and TPOT <= "
            f"{TPOT_SLO[CLOCK]} s; goodput {st['goodput']:.3f} req/s, the engine's scheduler {base['goodput']:.3f} "
            f"req/s (x{ratio:.2f}); floor met (every request finished, no block leaked)")
    return {"points": points, "max_points": POINTS_FLOOR + POINTS_GOODPUT, "floor": True, "goodput": st["goodput"],
            "baseline": base["goodput"], "output": text,
            "leaderboard": [{"name": "goodput (req/s)", "value": round(st["goodput"], 4), "order": "desc"},
                            {"name": "met SLO", "value": st["met_slo"], "order": "desc"}]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m exercises.project", description=__doc__.splitlines()[0])
    ap.add_argument("--student-dir", help="the directory holding project_scheduler.py (default: this package)")
    ap.add_argument("--seed", type=int, help=f"the workload's seed (default: the hidden one, else {PRACTICE_SEED})")
    ap.add_argument("--json", metavar="PATH", help="write the score here")
    ap.add_argument("--timeout", type=float, default=TIMEOUT, help=f"seconds (default {TIMEOUT:g})")
    ap.add_argument("--run", action="store_true", help=argparse.SUPPRESS)      # the child
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=20, help="how many requests the workload has (default 20)")
    args = ap.parse_args(argv)
    if args.run:
        _run(Path(args.student_dir), args.seed, Path(args.result), args.requests)
        return 0
    rep = score(args.student_dir, args.seed, args.timeout, args.requests)
    print(rep["output"])
    print(f"project: {rep['points']:g} / {rep['max_points']} autograded points (the report is graded by hand)")
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
