"""Grade the exercises: ``python -m exercises.grade [--parts ex1,ex3] [--json results.json]``.

Each part is graded in a process of its own, a fresh ``python -m pytest`` over
its graded tests (tests/exercises, marker exN) with MINIBATCH_STUDENT set to
that part alone, so whatever the student's file does costs that part only:

* every test has a time limit (pytest-timeout, ``--test-timeout``): a test that
  runs past it fails, and the part goes on with its next test;
* the part has a time limit (``--part-timeout``): past it, the process and
  everything it started are killed (an endless loop in native code, a loop that
  blocks the alarm signal);
* a process that dies (``os._exit``, a segfault, SIGKILL from the kernel's
  out-of-memory killer; ``--memory-mb`` caps its address space) ends that part
  only;
* the tests each part must run come from a trusted collection made first, on the
  reference; a part that ran fewer (``pytest.exit()``, deselection, a skipped
  file, a session that ended early) scores 0, with a message saying so.

An integration part (``INTEGRATIONS``: ex11, "your engine") has no file of its own: its session selects every part
it needs (exercises 1, 6 and 7), whose code runs the engine together; a release that does not hold all of them out
does not offer it (left out of the total, saying why).

A part that did not run all of its tests to the end scores 0, and the report
says why and which test was running. Points: ``POINTS`` per part, shared
among its tests in exact dyadic fractions (``split_points``): a part's tests add up to exactly its points,
and the top-level score is exactly the sum of the tests' scores. The report is printed as a table and, with ``--json``,
written in the format Gradescope's autograder reads (written whatever happens,
even when the grader itself fails): top level ``score``, ``execution_time``,
``output``, ``tests``; per test ``name``, ``score``, ``max_score``, ``status``,
``output``, ``visibility``, ``tags``.

Exit status: 0 when the grader ran (whatever the score, and whatever a part's
process did), 2 when the grader itself could not run (the report then says why).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import exercises
from exercises import _harness

# Each part's worth, shared equally among its graded tests. A part missing here is worth DEFAULT_POINTS.
# Points follow the hours a part takes (exercises/README.md's table: about 5 points an hour, every part within
# a factor of 2 of that).
POINTS = {"ex1": 3, "ex2": 8, "ex3": 5, "ex4": 10, "ex5": 3, "ex6": 30, "ex7": 20, "ex8": 10, "ex10": 8, "ex9": 15,
          "ex11": 5, "ex12": 10}
DEFAULT_POINTS = 10
PART_TIMEOUT = 300.0     # seconds for one part's whole session
TEST_TIMEOUT = 60.0      # seconds for one test
COLLECT_TIMEOUT = 300.0  # seconds for the trusted collection
MAX_OUTPUT = 2000        # characters of a failure kept in the report
PLUGIN = "exercises._grade_plugin"
# A part that needs a package some machines cannot install: (module, what to say). Where it is missing, the part
# is not graded (it is left out of the total, and the report says why) instead of scoring 0.
REQUIRES = {"ex9": ("triton", "needs Linux + Triton"), "ex10": ("triton", "needs Linux + Triton")}


@dataclass(frozen=True)
class Integration:
    """A graded part with no file of its own: its tests run the engine on several parts the student wrote, together
    (``needs``, piece names). Its session selects them all (``name``: its MINIBATCH_STUDENT), so a mistake in any
    of them can cost it too; its points are only for what the separate parts' tests cannot see (how they meet).

    In a student release it is offered only when the release holds out every part it needs (the week they are all
    handed out): in a staged release that lacks one, the engine would run the instructor's reference there, and
    the part would grade something else than "your engine". It is then left out of the total, saying why."""
    name_: str           # its own name (``--parts your_engine``)
    part: str            # its pytest marker
    title: str
    needs: tuple         # the pieces it grades together

    @property
    def name(self) -> str:
        """MINIBATCH_STUDENT for its session: every part it needs."""
        return ",".join(self.needs)

    @property
    def needs_parts(self) -> str:
        return ", ".join(exercises.piece(n).part for n in self.needs)


# Exercise 11 has no student file: exercises 1, 6 and 7 run the engine together (tests/exercises/test_ex11_*.py).
INTEGRATIONS = {i.part: i for i in (
    Integration("your_engine", "ex11", "your engine (ex1+ex6+ex7)", ("slot_mapping", "block_allocator", "scheduler")),
)}


def not_offered(part: str) -> str:
    """Why a student release does not offer ``part`` ("" when it does): an integration part whose pieces are not
    all held out of it."""
    i = INTEGRATIONS.get(part)
    if i is None or not exercises.REMOVED:
        return ""
    missing = [exercises.piece(n) for n in i.needs if n not in exercises.REMOVED]
    if not missing:
        return ""
    return (f"not in this release: it grades {i.needs_parts} together in the engine, and this release does not hand "
            f"out {', '.join(f'{p.part} ({p.title})' for p in missing)} yet")


def unavailable(part: str) -> str:
    """Why this machine (or this release) cannot grade ``part`` ("" when it can): a package it needs does not
    import here, or it is an integration part whose pieces this release does not all hold out."""
    if part in INTEGRATIONS:
        return not_offered(part)
    need = REQUIRES.get(part)
    if need is None:
        return ""
    try:
        importlib.import_module(need[0])
    except ImportError as e:
        return f"{need[1]}: not graded on this machine ({e})"
    return ""


class GradingError(RuntimeError):
    """The grader itself could not run (not the student's fault): the report says so."""


@dataclass
class Outcome:
    status: str              # passed, failed, error, skipped, not run
    message: str = ""        # the short message (AssertionError: ...)
    text: str = ""           # the full report


@dataclass
class PartRun:
    piece: "exercises.Piece | Integration"
    expected: list                                   # node ids the part must run (trusted collection)
    outcomes: dict = field(default_factory=dict)     # node id -> Outcome
    problem: str = ""                                # why the part scores 0, "" when it ran to the end
    seconds: float = 0.0
    log: str = ""                                    # the tail of the session's output
    not_graded: str = ""                             # why this machine cannot grade it (REQUIRES)

    @property
    def points(self) -> float:
        return float(POINTS.get(self.piece.part, DEFAULT_POINTS))

    @property
    def passed(self) -> int:
        return sum(self.outcomes.get(t, Outcome("not run")).status == "passed" for t in self.expected)

    def shares(self) -> list:
        """Each expected test's worth, in the order collected: exact (see ``split_points``)."""
        return split_points(self.points, len(self.expected))

    def test_score(self, nodeid: str, share: float) -> float:
        ok = not self.problem and self.outcomes.get(nodeid, Outcome("not run")).status == "passed"
        return share if ok else 0.0

    @property
    def score(self) -> float:
        """The sum of its tests' scores: exact, so a part with every test passed scores exactly its points."""
        return sum(self.test_score(t, w) for t, w in zip(self.expected, self.shares()))


def split_points(points: float, n: int) -> list:
    """``points`` shared among ``n`` tests as dyadic fractions (quarters, eighths, ...: exact in binary floating
    point, so any sum of them is exact, and Gradescope shows 10/10, never 9.9999/9.9999). The first tests get
    one unit more than the rest when the units do not divide evenly; a unit is the largest power of two over
    four (1/4, 1/8, ...) that gives every test at least four."""
    if n <= 0:
        return []
    denom = 4
    while points * denom < 4 * n:
        denom *= 2
    units = round(points * denom)
    base, extra = divmod(units, n)
    return [(base + (i < extra)) / denom for i in range(n)]


def parse_parts(text: str | None) -> list:
    """'ex1,ex3' or 'slot_mapping,top_k_top_p' or 'all' or None -> Pieces, in exercise order, then the integration
    parts named (``ex11`` or ``your_engine``; 'all' names them all)."""
    words = [w.strip() for w in (text or "all").split(",") if w.strip()]
    everything = any(w.lower() == "all" for w in words)
    by_name = {k: i for i in INTEGRATIONS.values() for k in (i.part, i.name_)}
    chosen = {by_name[w.lower()].part for w in words if w.lower() in by_name}
    rest = [w for w in words if w.lower() not in by_name]
    try:
        names = exercises.selected(",".join(rest)) if rest else set()
    except ValueError as e:
        raise ValueError(f"{e}; or {', '.join(f'{i.name_} ({i.part})' for i in INTEGRATIONS.values())}") from None
    integrations = [i for i in INTEGRATIONS.values() if everything or i.part in chosen]
    return exercises.in_order(names) + integrations


def read_events(path: Path) -> list:
    """The plugin's JSON lines; a line cut short by a kill (or anything unreadable) is skipped."""
    events = []
    if path.exists():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    return events


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _pytest(args: list, env: dict, log: Path, timeout: float, memory_mb: float | None = None):
    """Run ``python -m pytest ARGS`` in its own process group; (exit code, timed out). The group is killed
    at the end, so nothing the student's code started outlives its part."""
    def limit():                                   # in the child, before pytest starts
        if memory_mb:
            import resource
            cap = int(memory_mb * 2 ** 20)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    with open(log, "wb") as out:
        p = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=_harness.REPO, env=env, stdout=out,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                             preexec_fn=limit if memory_mb else None)
        timed_out = False
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        try:
            if hasattr(os, "killpg"):
                os.killpg(p.pid, signal.SIGKILL)
            elif timed_out:
                p.kill()
        except (ProcessLookupError, PermissionError):
            pass
        if timed_out:
            rc = p.wait()
    return rc, timed_out


def _env(changes: dict) -> dict:
    env = _harness.base_env()
    env.pop("PYTEST_PLUGINS", None)                # nothing from outside may change how students are graded
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    return _harness._apply(env, changes)


def collect(pieces: list, tmp: Path, timeout: float = COLLECT_TIMEOUT) -> dict:
    """The node ids each part must run, collected on the reference (no student code runs): {part: [ids]}."""
    events, log = tmp / "collect.jsonl", tmp / "collect.log"
    args = [str(_harness.TESTS), "--collect-only", "-q", "-p", "no:cacheprovider", "-p", PLUGIN,
            "-m", " or ".join(p.part for p in pieces)]
    rc, timed_out = _pytest(args, _env({"MINIBATCH_STUDENT": None, "MINIBATCH_STUDENT_DIR": None,
                                        "MINIBATCH_GRADE_EVENTS": events}), log, timeout)
    collected = [e for e in read_events(events) if e.get("e") == "collected"]
    if timed_out or rc not in (0, 5) or not collected:
        raise GradingError(f"could not collect the graded tests (pytest exit {rc}"
                           f"{', timed out' if timed_out else ''}):\n{_tail(log)}")
    out = {p.part: [] for p in pieces}
    for nodeid in collected[-1]["ids"]:
        part = collected[-1]["parts"].get(nodeid, "")
        if part in out:
            out[part].append(nodeid)
    return out


def _outcomes(events: list) -> dict:
    """node id -> Outcome, from the reports of its setup, call and teardown."""
    out = {}
    for e in events:
        if e.get("e") != "report":
            continue
        nodeid, outcome = e["id"], e["outcome"]
        prev = out.get(nodeid)
        if outcome == "failed":
            status = "failed" if e["when"] == "call" else "error"
        elif outcome == "skipped":
            status = "skipped"
        else:
            status = "passed"
        rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 2}
        if prev is None or rank[status] > rank[prev.status]:
            out[nodeid] = Outcome(status, e.get("message", ""), e.get("text", ""))
    return out


def _short(nodeid: str) -> str:
    return nodeid.split("::", 1)[-1]


def run_part(piece, expected: list, tmp: Path, student_dir=None, part_timeout: float = PART_TIMEOUT,
             test_timeout: float = TEST_TIMEOUT, memory_mb: float | None = None) -> PartRun:
    """One part in its own process, on the student's code; what happened, judged."""
    events, log = tmp / f"{piece.part}.jsonl", tmp / f"{piece.part}.log"
    env = {"MINIBATCH_STUDENT": piece.name, "MINIBATCH_GRADE_EVENTS": events}
    if student_dir:                                  # else MINIBATCH_STUDENT_DIR as inherited, or the package
        env["MINIBATCH_STUDENT_DIR"] = str(Path(student_dir).resolve())
    args = [str(_harness.TESTS), "-m", piece.part, "-q", "--tb=short", "-p", "no:cacheprovider", "-p", PLUGIN]
    if test_timeout and importlib.util.find_spec("pytest_timeout") is not None:
        method = "signal" if hasattr(signal, "SIGALRM") else "thread"
        args += [f"--timeout={test_timeout:g}", f"--timeout-method={method}"]
    run = PartRun(piece, list(expected))
    t0 = time.perf_counter()
    rc, timed_out = _pytest(args, _env(env), log, part_timeout, memory_mb)
    run.seconds = time.perf_counter() - t0
    run.log = _tail(log)
    evs = read_events(events)
    run.outcomes = _outcomes(evs)
    run.problem = judge(run, evs, rc, timed_out, part_timeout)
    return run


def judge(run: PartRun, events: list, rc: int, timed_out: bool, part_timeout: float) -> str:
    """Why this part's session cannot be trusted to the end ("" when it can)."""
    if not run.expected:
        return (f"no graded test of {run.piece.part} was collected (a skipped or missing test file?); "
                f"the part cannot be graded")
    done = set(run.outcomes)
    started = [e["id"] for e in events if e.get("e") == "start"]
    running = [t for t in started if t not in done]
    where = f" while running {_short(running[-1])}" if running else ""
    progress = f"{len(done & set(run.expected))} of its {len(run.expected)} tests had finished"
    finish = [e["status"] for e in events if e.get("e") == "finish"]
    if timed_out:
        return (f"stopped at the part's time limit of {part_timeout:g} s{where} (an endless loop, or "
                f"far too slow?); {progress}")
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        if -rc == signal.SIGKILL:
            return (f"the test process was killed by SIGKILL{where}, which is what the kernel's out-of-memory "
                    f"killer sends: did it use too much memory?; {progress}")
        return f"the test process crashed with {name}{where}; {progress}"
    if not finish:
        return (f"the test process exited with status {rc}{where} before its session ended (os._exit(), "
                f"or a crash?); {progress}")
    missing = [t for t in run.expected if t not in done]
    if missing:
        names = ", ".join(_short(t) for t in missing[:5]) + (", ..." if len(missing) > 5 else "")
        return (f"the session ended (pytest exit status {finish[-1]}) having run {len(done & set(run.expected))} "
                f"of the {len(run.expected)} tests it must run: pytest.exit(), deselection, or a skipped "
                f"file? Not run: {names}")
    if finish[-1] not in (0, 1):
        return f"pytest ended with exit status {finish[-1]} (internal error or interrupted)"
    return ""


def _test_output(run: PartRun, nodeid: str) -> str:
    o = run.outcomes.get(nodeid, Outcome("not run"))
    if o.status == "passed":
        body = ""
    elif o.status == "not run":
        body = "did not run"
    else:
        skipped = o.status == "skipped"
        head = "skipped: " + o.message.removeprefix("Skipped: ") if skipped else o.message
        text = "" if skipped else o.text
        room = MAX_OUTPUT - len(head) - 2
        if len(text) > room:
            text = "...\n" + text[-max(0, room - 4):]     # the end of a traceback says what went wrong
        body = (head + "\n\n" + text).strip()
        if memory_mb_hint(o):
            body = "out of memory? " + body
    if run.problem:
        was = {"passed": "it had passed", "not run": "it did not run"}.get(o.status, f"it had {o.status}")
        body = (f"The part scores 0: {run.problem}. (This test: {was}.)" + ("\n\n" + body if body and
                o.status not in ("passed", "not run") else ""))
    return body[:MAX_OUTPUT + 400]


def memory_mb_hint(o: Outcome) -> bool:
    t = o.message + o.text[-2000:]
    return "MemoryError" in t or "can't allocate memory" in t or "out of memory" in t.lower()


def report(runs: list, seconds: float) -> tuple[str, dict]:
    """The table printed, and the Gradescope report."""
    tests, lines, problems = [], [], []
    width = max([len(r.piece.title) for r in runs] + [len("exercise")]) + 2
    lines.append(("{:<6}{:<%d}{:>16}   {}" % width).format("part", "exercise", "points", "tests passed"))
    total = max_total = 0.0
    parts = {}
    for r in runs:
        if r.not_graded:                                 # left out of the total, and said so
            lines.append(("{:<6}{:<%d}{:>16}   {}" % width).format(r.piece.part, r.piece.title, "-", r.not_graded))
            parts[r.piece.part] = {"score": 0.0, "max_score": 0.0, "not_graded": r.not_graded}
            continue
        n, got = len(r.expected), r.passed
        total, max_total = total + r.score, max_total + r.points
        note = "NOT GRADED, see below" if r.problem else f"{got} / {n}"
        lines.append(("{:<6}{:<%d}{:>7.1f} / {:<6g}   {}" % width).format(r.piece.part, r.piece.title, r.score,
                                                                        r.points, note))
        if r.problem:
            problems.append(f"{r.piece.part} ({r.piece.title}) scores 0: {r.problem}.")
        elif 0 < got < n:                                # partly done: say what is left
            lines.append(f"      {n - got} failing: MINIBATCH_STUDENT={r.piece.name} python -m pytest "
                         f"tests/exercises -m {r.piece.part} shows why")
        rows = list(zip(r.expected, r.shares())) or [(f"(no tests: {r.piece.part})", r.points)]
        for t, share in rows:
            got_t = r.test_score(t, share)
            tests.append({"name": f"{r.piece.part} {r.piece.title}: {_short(t)}",
                          "score": got_t, "max_score": share,
                          "status": "passed" if share and got_t == share else "failed",
                          "output": _test_output(r, t), "visibility": "visible", "tags": [r.piece.part]})
        parts[r.piece.part] = {"score": r.score, "max_score": r.points, "tests": n, "passed": got,
                               "problem": r.problem, "seconds": round(r.seconds, 1)}
    lines.append(("{:<6}{:<%d}{:>7.1f} / {:<6g}" % width).format("", "total", total, max_total))
    table = "\n".join(line.rstrip() for line in lines + ([""] + problems if problems else []))
    total = sum(t["score"] for t in tests)             # exact: dyadic fractions add up without rounding
    return table, {"score": total, "execution_time": round(seconds, 1), "output": table,
                   "visibility": "visible", "stdout_visibility": "visible", "tests": tests,
                   "extra_data": {"max_score": max_total, "parts": parts}}


def add_project(rep: dict, student_dir=None) -> None:
    """The scheduling project (exercises/project.py, in a process of its own) into the report: one test entry
    (the correctness floor, then the headroom closed against the engine's scheduler, each workload's figures in
    its output), and Gradescope's ``leaderboard``."""
    from exercises import project
    p = project.score(student_dir)
    rep["tests"].append({"name": "project: scheduling policy (correctness floor, headroom closed)",
                         "score": p["points"], "max_score": float(p["max_points"]),
                         "status": "passed" if p["floor"] else "failed",
                         "output": p["output"], "visibility": "visible", "tags": ["project"]})
    rep["score"] = sum(t["score"] for t in rep["tests"])
    rep["leaderboard"] = p["leaderboard"]
    rep["extra_data"]["max_score"] += p["max_points"]
    rep["extra_data"]["project"] = {k: p[k] for k in ("points", "max_points", "floor", "headroom", "goodput",
                                                      "baseline")}
    rep["extra_data"]["project"]["seeds"] = [
        {"seed": r["seed"], "requests": r["student"].get("requests"), "met": r["student"].get("met_slo"),
         "baseline_met": r["baseline"].get("met_slo"), "headroom": r.get("headroom")} for r in p.get("seeds", [])]
    rep["output"] += f"\n\nproject: {p['points']:g} / {p['max_points']}\n{p['output']}"


def failed_report(error: str, seconds: float) -> dict:
    """The report when the grader itself could not grade: score 0, and why (for the instructor)."""
    return {"score": 0.0, "execution_time": round(seconds, 1), "visibility": "visible",
            "stdout_visibility": "visible", "tests": [],
            "output": "The grader could not run the tests (this is not your code's fault; tell your instructor):"
                      f"\n{error[-MAX_OUTPUT:]}", "extra_data": {"grader_error": True}}


def grade(pieces: list, student_dir=None, part_timeout: float = PART_TIMEOUT, test_timeout: float = TEST_TIMEOUT,
          memory_mb: float | None = None, progress=None, expected: dict | None = None) -> list:
    """Collect (unless ``expected`` is given), then run each part in its own process; [PartRun] in exercise order."""
    with tempfile.TemporaryDirectory(prefix="minibatch-grade-") as tmp:
        tmp = Path(tmp)
        missing = {p.part: unavailable(p.part) for p in pieces}
        gradable = [p for p in pieces if not missing[p.part]]
        expected = collect(gradable, tmp) if expected is None and gradable else expected or {}
        runs = []
        for p in pieces:
            if missing[p.part]:
                runs.append(PartRun(p, [], not_graded=missing[p.part]))
                continue
            run = run_part(p, expected.get(p.part, []), tmp, student_dir, part_timeout, test_timeout, memory_mb)
            if progress:
                progress(run)
            runs.append(run)
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m exercises.grade", description=__doc__.splitlines()[0])
    ap.add_argument("--parts", help="comma-separated parts (ex1,ex3), piece names, or ex11 / your_engine (exercises 1, 6 "
                                          "and 7 together in the engine); default: all")
    ap.add_argument("--json", metavar="PATH", help="write the Gradescope report here (whatever happens)")
    ap.add_argument("--student-dir", help="the directory holding the student's ex*.py "
                                          "(default: MINIBATCH_STUDENT_DIR, else the exercises package)")
    ap.add_argument("--part-timeout", type=float, default=PART_TIMEOUT,
                    help=f"seconds for one part's whole session (default {PART_TIMEOUT:g})")
    ap.add_argument("--test-timeout", type=float, default=TEST_TIMEOUT,
                    help=f"seconds for one test, 0 for none (default {TEST_TIMEOUT:g})")
    ap.add_argument("--memory-mb", type=float, default=None,
                    help="cap each part's address space (RLIMIT_AS) at this many MiB (default: no cap; "
                         "not with CUDA, which reserves far more address space than it uses)")
    ap.add_argument("--project", action="store_true",
                    help="also score the scheduling project (exercises/project.py): a test entry and Gradescope's "
                         "leaderboard")
    args = ap.parse_args(argv)
    try:
        pieces = parse_parts(args.parts)
    except ValueError as e:
        ap.error(str(e))
    t0 = time.perf_counter()
    rep, rc = None, 0
    try:
        runs = grade(pieces, args.student_dir, args.part_timeout, args.test_timeout, args.memory_mb,
                     progress=lambda r: print(f"  {r.piece.part}: {r.passed}/{len(r.expected)} passed in "
                                              f"{r.seconds:.1f} s" + (" (not graded)" if r.problem else ""),
                                              file=sys.stderr, flush=True))
        table, rep = report(runs, time.perf_counter() - t0)
        if args.project:
            add_project(rep, args.student_dir)
            table = rep["output"]
        print(table)
    except Exception as e:                       # the grader's own failure: still a report, and a clear exit
        detail = str(e) if isinstance(e, GradingError) else traceback.format_exc()
        print(f"grading failed: {detail}", file=sys.stderr)
        rep, rc = failed_report(detail, time.perf_counter() - t0), 2
    finally:
        if args.json:
            if rep is None:                      # interrupted (KeyboardInterrupt): still a report
                rep = failed_report("interrupted", time.perf_counter() - t0)
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(rep, indent=2))
            print(f"report written to {args.json}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
