"""Run the graded tests in fresh pytest sessions and read their results (used by grade.py and the honesty test).

``run(jobs)`` runs one pytest session per job, each in its own process with its
own environment (MINIBATCH_STUDENT, MINIBATCH_STUDENT_DIR), exactly as a
student's run would be. Importing torch costs seconds per process, so on Linux
the sessions are forked from one server process that imported torch and pytest
once (and ran no torch op, so no thread pool is copied half-initialised);
elsewhere each session is a plain ``python -m pytest`` subprocess.

    python -m exercises._harness < jobs.json     # the server: runs the jobs, prints their exit codes
"""
from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests" / "exercises"


@dataclass
class Job:
    args: list                 # pytest arguments (add --junitxml yourself to read results)
    env: dict                  # variables to set; a value of None removes the variable
    log: str                   # where the session's stdout and stderr go


@dataclass
class TestResult:
    name: str                  # test_x[param]
    part: str                  # ex1 .. ex5 (from the file name), or "" if none
    outcome: str               # passed, failed, error, skipped
    output: str                # the failure message and traceback, "" when passed


def base_env() -> dict:
    env = dict(os.environ)
    env.pop("PYTEST_ADDOPTS", None)                  # the caller's options must not change how students are graded
    # TRITON_INTERPRET is left as it is: tests/conftest.py, the first file a session loads, switches Triton's
    # CPU interpreter on where there is no GPU, before any kernel (ex9's included) is decorated; setting it
    # here, where torch may not even be imported, would force the interpreter on a GPU machine too.
    return env


def _apply(env: dict, changes: dict) -> dict:
    for k, v in changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env


def run(jobs: list, fork: bool | None = None, timeout: float = 900) -> list[int]:
    """Exit code of each job's pytest session (0 all passed, 1 some failed, 2+ trouble)."""
    if fork is None:
        fork = sys.platform.startswith("linux")
    if not fork:
        rcs = []
        for job in jobs:
            with open(job.log, "w") as log:
                p = subprocess.run([sys.executable, "-m", "pytest", *job.args], cwd=REPO, stdout=log,
                                   stderr=subprocess.STDOUT, env=_apply(base_env(), job.env), timeout=timeout)
            rcs.append(p.returncode)
        return rcs
    payload = json.dumps([{"args": j.args, "env": j.env, "log": j.log} for j in jobs])
    # its own process group, so that a timeout ends the server and the session it forked together
    p = subprocess.Popen([sys.executable, "-m", "exercises._harness"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=REPO, env=base_env(), start_new_session=True)
    try:
        out, err = p.communicate(payload, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    if p.returncode != 0:
        raise RuntimeError(f"the pytest fork server failed (exit {p.returncode}):\n{out}\n{err}")
    return json.loads(out.strip().splitlines()[-1])


def parse_junit(path) -> list[TestResult]:
    """Every test case in a --junitxml report, with its part taken from its file (test_exN_...)."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        m = re.search(r"test_(ex\d+)_", case.get("classname", "") + " " + case.get("file", ""))
        outcome, text = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                text = ((node.get("message") or "") + "\n" + (node.text or "")).strip()
                break
        out.append(TestResult(case.get("name", "?"), m.group(1) if m else "", outcome, text))
    return out


def _serve() -> None:
    """Read jobs (JSON) on stdin; fork one pytest session per job; print their exit codes (JSON)."""
    jobs = json.loads(sys.stdin.read())
    import torch  # noqa: F401  -- the point: imported once, before the forks
    import pytest
    from importlib.metadata import entry_points
    # Plugins too, and what they import lazily (hypothesis): a module first imported inside a session is
    # assertion-rewritten there, seconds per session for hypothesis.
    for ep in entry_points(group="pytest11"):
        try:
            ep.load()
        except Exception:
            pass
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        pass
    # Everything imported so far is permanent: the children's gc.collect() (pytest calls it at exit)
    # need not walk torch's heap every session, and the shared pages stay shared.
    gc.freeze()
    sys.stdout.flush()
    rcs = []
    for job in jobs:
        pid = os.fork()
        if pid == 0:                                  # the child: one pytest session, then exit without cleanup
            rc = 3
            try:
                fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                _apply(os.environ, job["env"])
                rc = int(pytest.main(job["args"]))
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
        _, status = os.waitpid(pid, 0)
        rcs.append(os.waitstatus_to_exitcode(status))
    print(json.dumps(rcs))


if __name__ == "__main__":
    _serve()
