"""Grade the exercises: ``python -m exercises.grade [--parts ex1,ex3] [--json results.json]``.

Runs the graded tests (tests/exercises) on the student's code for the chosen
parts (all by default), one point per test, prints a table of points per
exercise, and writes a report in the JSON format that Gradescope's autograder
reads: {"score", "max_score", "tests": [{"name", "score", "max_score", "output"}...]}.
The exit status is 0 whenever the tests ran (whatever the score), 2 when they could not.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import exercises
from exercises import _harness

MAX_OUTPUT = 2000        # characters of a failure kept in the report


def parse_parts(text: str | None) -> list:
    """'ex1,ex3' or 'slot_mapping,top_k_top_p' or 'all' or None -> Pieces, in exercise order."""
    names = exercises.selected("all" if not text else text)
    return sorted((exercises.PIECES[n] for n in names), key=lambda p: int(p.part[2:]))


def run_tests(pieces: list, student_dir: str | None, timeout: float):
    """Run the graded tests of these pieces, each on the student's code; returns (results, log text)."""
    with tempfile.TemporaryDirectory() as tmp:
        junit, log = Path(tmp) / "report.xml", Path(tmp) / "pytest.log"
        env = {"MINIBATCH_STUDENT": ",".join(p.name for p in pieces)}
        if student_dir:
            env["MINIBATCH_STUDENT_DIR"] = str(Path(student_dir).resolve())
        args = [str(_harness.TESTS), "-m", " or ".join(p.part for p in pieces), "-q", "-p", "no:cacheprovider",
                f"--junitxml={junit}"]
        (rc,) = _harness.run([_harness.Job(args, env, str(log))], fork=False, timeout=timeout)
        text = log.read_text(errors="replace") if log.exists() else ""
        results = _harness.parse_junit(junit) if junit.exists() else []
    if rc not in (0, 1) or not results:
        raise RuntimeError(f"the graded tests did not run (pytest exit {rc}):\n{text[-4000:]}")
    return results, text


def report(pieces: list, results: list, seconds: float) -> tuple[str, dict]:
    """The table printed, and the Gradescope-style report."""
    tests, lines = [], []
    width = max(len(p.title) for p in pieces + [exercises.PIECES["slot_mapping"]]) + 2
    row = "{:<6}{:<%d}{:>4} / {:<4}" % width
    lines.append(("{:<6}{:<%d}{:>10}" % width).format("part", "exercise", "points"))
    total = max_total = 0
    for p in pieces:
        mine = [r for r in results if r.part == p.part]
        got = sum(r.outcome == "passed" for r in mine)
        total, max_total = total + got, max_total + len(mine)
        lines.append(row.format(p.part, p.title, got, len(mine)))
        failed = [r.name for r in mine if r.outcome != "passed"]
        if failed and got:                               # partly done: say what is left
            lines.append(f"      {len(failed)} failing: MINIBATCH_STUDENT={p.name} python -m pytest tests/exercises "
                         f"-m {p.part} shows why")
        for r in mine:
            tests.append({"name": f"{p.part} {p.title}: {r.name}", "score": int(r.outcome == "passed"),
                          "max_score": 1, "output": r.output[:MAX_OUTPUT], "tags": [p.part]})
    lines.append(row.format("", "total", total, max_total))
    table = "\n".join(lines)
    return table, {"score": total, "max_score": max_total, "execution_time": round(seconds, 1),
                   "output": table, "tests": tests}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m exercises.grade", description=__doc__.splitlines()[0])
    ap.add_argument("--parts", help="comma-separated parts (ex1,ex3) or piece names; default: all")
    ap.add_argument("--json", metavar="PATH", help="write the Gradescope-style report here")
    ap.add_argument("--student-dir", help="the directory holding the student's ex*.py "
                                          "(default: MINIBATCH_STUDENT_DIR, else the exercises package)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for the whole run (default 900)")
    args = ap.parse_args(argv)
    try:
        pieces = parse_parts(args.parts)
    except ValueError as e:
        ap.error(str(e))
    t0 = time.perf_counter()
    try:
        results, _ = run_tests(pieces, args.student_dir, args.timeout)
    except Exception as e:                              # the tests did not run (timeout, collection error...)
        print(f"grading failed: {e}", file=sys.stderr)
        return 2
    table, rep = report(pieces, results, time.perf_counter() - t0)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=2))
        print(f"report written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
