"""A pytest plugin for the grader: one JSON line per event, written the moment it happens.

    python -m pytest -p exercises._grade_plugin ...   with MINIBATCH_GRADE_EVENTS=/path/events.jsonl

A junit report is written when the session ends, so a session that hangs, calls
``os._exit`` or is killed for memory leaves none. This plugin appends (and
closes) a line per event instead, so the grader knows, whatever happened, which
tests were collected, which finished and how, which one was running when the
process stopped, and whether the session reached its end:

    {"e": "collected", "ids": [nodeid, ...], "parts": {nodeid: "ex1", ...}}
    {"e": "start", "id": nodeid}
    {"e": "report", "id": nodeid, "when": "setup|call|teardown", "outcome": "passed|failed|skipped",
     "message": short message, "text": the full report}
    {"e": "finish", "status": pytest's exit status}
"""
from __future__ import annotations

import json
import os
import re

_PART = re.compile(r"ex\d+$")
# read once, when pytest loads the plugin: nothing the student's code does to os.environ later moves it
_PATH = os.environ.get("MINIBATCH_GRADE_EVENTS", "")


def _write(record: dict) -> None:
    path = _PATH
    if not path:
        return
    line = json.dumps(record) + "\n"
    # one write per line, file closed at once: a kill loses at most the line being written
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


def part_of(item) -> str:
    """The item's exercise marker (ex1 ... exN); "" if it has none, "?" if it has several."""
    parts = {m.name for m in item.iter_markers() if _PART.match(m.name)}
    return parts.pop() if len(parts) == 1 else ("?" if parts else "")


def pytest_collection_finish(session):
    _write({"e": "collected", "ids": [it.nodeid for it in session.items],
            "parts": {it.nodeid: part_of(it) for it in session.items}})


def pytest_runtest_logstart(nodeid, location):
    _write({"e": "start", "id": nodeid})


def pytest_runtest_logreport(report):
    if report.when != "call" and report.outcome == "passed":
        return                                   # setup and teardown matter only when they go wrong
    message = ""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        message = crash.message
    elif report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        message = str(report.longrepr[2])        # (file, line, reason)
    text = "" if report.passed else report.longreprtext
    _write({"e": "report", "id": report.nodeid, "when": report.when, "outcome": report.outcome,
            "message": message, "text": text})


def pytest_sessionfinish(session, exitstatus):
    _write({"e": "finish", "status": int(exitstatus)})
