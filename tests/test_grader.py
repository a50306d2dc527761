"""The grader survives a student: real misbehaving student files, graded as a student would be.

Each part runs in its own process (exercises/grade.py); here student files in a
temporary MINIBATCH_STUDENT_DIR hang, exit, get killed, end the session early,
deselect tests, skip, run out of memory, and the report must show the damage on
their own part only, say what happened, and still be a complete Gradescope
report. Small time limits keep this file fast; each grading session costs a
Python start with torch (a few seconds), so the behaviours share sessions: one
part each.
"""
import json
import os
import signal
import textwrap
import time

import pytest

import exercises
from exercises import grade

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg") or not hasattr(signal, "SIGALRM"),
                                reason="the grader's process-group and alarm handling are POSIX")


def delegate(piece, prelude="", before_call=""):
    """A student's file for ``piece`` that does ``before_call`` and then hands the call to the reference."""
    p = exercises.piece(piece)
    body = textwrap.indent(textwrap.dedent(before_call).strip() or "pass", "    ")
    return (f"import exercises\n{textwrap.dedent(prelude)}\n\n"
            f"def {p.func}(*args, **kwargs):\n{body}\n"
            f"    return exercises.reference({p.name!r})(*args, **kwargs)\n")


def write_students(directory, files):
    directory.mkdir(parents=True, exist_ok=True)
    for piece, source in files.items():
        (directory / f"{exercises.piece(piece).stem}.py").write_text(source)
    return directory


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    """The trusted collection, made once for the parts used here."""
    pieces = grade.parse_parts("ex1,ex2,ex3,ex4,ex5")
    return grade.collect(pieces, tmp_path_factory.mktemp("collect"))


def by_part(runs):
    return {r.piece.part: r for r in runs}


def test_collection_knows_every_part(expected):
    for part in ("ex1", "ex2", "ex3", "ex4", "ex5"):
        assert len(expected[part]) >= 5, f"{part}: {expected[part]}"
        assert all(f"test_{part}_" in t for t in expected[part])


@pytest.fixture(scope="module")
def crashes(tmp_path_factory, expected):
    """ex1 hangs in one test; ex3 calls os._exit(1); ex4 is SIGKILLed (as by the OOM killer); ex5 calls
    pytest.exit(returncode=0) -- all in one grading run, each part in its own process."""
    d = write_students(tmp_path_factory.mktemp("crashes"), {
        "ex1": delegate("ex1", "", "if args[3] == 1:\n    while True:\n        pass"),
        "ex3": delegate("ex3", "import os", "os._exit(1)"),
        "ex4": delegate("ex4", "import os, signal", "os.kill(os.getpid(), signal.SIGKILL)"),
        "ex5": delegate("ex5", "import pytest", "pytest.exit('done early', returncode=0)"),
    })
    t0 = time.perf_counter()
    runs = grade.grade(grade.parse_parts("ex1,ex3,ex4,ex5"), d, part_timeout=120, test_timeout=3,
                       expected=expected)
    table, rep = grade.report(runs, time.perf_counter() - t0)
    return by_part(runs), table, rep


def test_a_hang_in_one_test_costs_that_test_only(crashes):
    runs, table, rep = crashes
    r = runs["ex1"]
    assert not r.problem, r.problem
    failed = [t for t in r.expected if r.outcomes[t].status != "passed"]
    assert [t.split("::")[-1] for t in failed] == ["test_block_size_one_and_one_big_block"]
    assert "Timeout" in r.outcomes[failed[0]].message
    shares = dict(zip(r.expected, r.shares()))
    assert r.score == grade.POINTS["ex1"] - shares[failed[0]]                  # exact: no rounding


def test_os_exit_costs_its_part_and_says_so(crashes):
    runs, table, rep = crashes
    r = runs["ex3"]
    assert r.score == 0 and "exited with status 1" in r.problem and "os._exit" in r.problem
    assert "while running test_" in r.problem


def test_an_out_of_memory_kill_costs_its_part_and_says_so(crashes):
    runs, table, rep = crashes
    r = runs["ex4"]
    assert r.score == 0 and "SIGKILL" in r.problem and "out-of-memory" in r.problem


def test_pytest_exit_with_status_0_scores_0(crashes):
    runs, table, rep = crashes
    r = runs["ex5"]
    assert r.score == 0 and "pytest.exit()" in r.problem
    assert f"of the {len(r.expected)} tests it must run" in r.problem


def test_the_report_is_complete_and_in_gradescope_format(crashes, expected):
    runs, table, rep = crashes
    assert set(rep) >= {"score", "execution_time", "output", "tests"}
    assert isinstance(rep["score"], float) and isinstance(rep["execution_time"], float)
    json.dumps(rep)                                                   # serialisable as it is
    names = [t["name"] for t in rep["tests"]]
    assert len(names) == len(set(names)) == sum(len(expected[p]) for p in ("ex1", "ex3", "ex4", "ex5"))
    for t in rep["tests"]:
        assert set(t) >= {"name", "score", "max_score", "output", "status", "visibility"}
        assert t["status"] == ("passed" if t["score"] == t["max_score"] else "failed")
        assert t["visibility"] == "visible" and 0 <= t["score"] <= t["max_score"]
    ex3 = [t for t in rep["tests"] if t["tags"] == ["ex3"]]
    assert all(t["score"] == 0 and "The part scores 0: the test process exited" in t["output"] for t in ex3)
    assert rep["score"] == sum(t["score"] for t in rep["tests"]) == runs["ex1"].score      # exact
    for part in ("ex1", "ex3", "ex4", "ex5"):                 # a part's tests add up to exactly its points
        assert sum(t["max_score"] for t in rep["tests"] if t["tags"] == [part]) == grade.POINTS[part]
    for part in ("ex3", "ex4", "ex5"):
        assert f"{part} (" in table and "scores 0" in table


def test_a_hang_that_blocks_the_alarm_is_stopped_at_the_part_limit(tmp_path, expected, monkeypatch):
    """SIGALRM blocked, so the per-test limit cannot fire: the part's limit kills the process and what it started.
    (The student's directory comes from MINIBATCH_STUDENT_DIR here, as a student running it locally would set.)"""
    pid_file = tmp_path / "child.pid"
    d = write_students(tmp_path / "s", {"ex2": delegate("ex2", "import signal, subprocess, sys", f"""
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGALRM}})
        while True:
            pass""")})
    t0 = time.perf_counter()
    monkeypatch.setenv("MINIBATCH_STUDENT_DIR", str(d))
    (r,) = grade.grade(grade.parse_parts("ex2"), None, part_timeout=8, test_timeout=1, expected=expected)
    assert time.perf_counter() - t0 < 60
    assert r.score == 0 and "time limit of 8 s" in r.problem, r.problem + r.log
    child = int(pid_file.read_text())
    for _ in range(50):                                               # the kill reached the student's child too
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("a process the student's code started outlived its part")


DESELECT = """
    import gc
    import _pytest.main
    for o in gc.get_objects():
        if isinstance(o, _pytest.main.Session):
            del o.items[1:]           # the session now ends after this test, with exit status 0
"""


def address_space_mb() -> float:
    """This process's virtual size (torch imported, as in a grading session), in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
def test_deselection_skips_and_memory_through_the_command_line(tmp_path, capsys):
    """ex1 deselects the rest of its session; ex3 skips every test at import; ex5 runs out of memory under
    --memory-mb in one test; ex2 is right. Through main(), which writes results.json."""
    cap = address_space_mb() + 1500                      # room for a session, not for the hog's extra 2 GiB
    hog = int((cap + 2048) * 2 ** 20 / 4)                # float32 elements
    d = write_students(tmp_path / "s", {
        "ex1": delegate("ex1", "", DESELECT),
        "ex3": delegate("ex3", "import pytest\npytest.skip('not today', allow_module_level=True)"),
        "ex2": delegate("ex2"),
        "ex5": delegate("ex5", "import torch\nHOG = []", "if len(args[0]) > 25 and not HOG:\n"
                        f"    HOG.append(1)\n    torch.ones({hog})   # more than the cap"),
    })
    out = tmp_path / "results" / "results.json"
    rc = grade.main(["--parts", "ex1,ex2,ex3,ex5", "--student-dir", str(d), "--json", str(out),
                     "--test-timeout", "30", "--part-timeout", "120", "--memory-mb", f"{cap:.0f}"])
    printed = capsys.readouterr().out
    assert rc == 0
    rep = json.loads(out.read_text())
    parts = rep["extra_data"]["parts"]
    assert "deselection" in parts["ex1"]["problem"] and parts["ex1"]["score"] == 0
    assert parts["ex2"]["score"] == grade.POINTS["ex2"] and not parts["ex2"]["problem"]
    assert parts["ex3"]["score"] == 0 and parts["ex3"]["passed"] == 0 and not parts["ex3"]["problem"]
    ex3 = [t for t in rep["tests"] if t["tags"] == ["ex3"]]
    assert ex3 and all(t["output"].startswith("skipped: not today") for t in ex3)
    assert not parts["ex5"]["problem"] and parts["ex5"]["passed"] == parts["ex5"]["tests"] - 1
    hog = [t for t in rep["tests"] if t["tags"] == ["ex5"] and t["status"] == "failed"]
    assert len(hog) == 1 and hog[0]["output"].startswith("out of memory?"), hog
    assert rep["score"] == pytest.approx(parts["ex2"]["score"] + parts["ex5"]["score"])
    assert "ex1 (slot mapping) scores 0" in printed and rep["output"] in printed


@pytest.mark.parametrize("points", [5, 10, 15, 20, 25, 30])
def test_points_split_exactly_among_any_number_of_tests(points):
    for n in range(1, 200):
        shares = grade.split_points(points, n)
        assert len(shares) == n and sum(shares) == points, (points, n)       # exact, not approx
        assert max(shares) - min(shares) <= min(shares) / 3, (points, n, sorted(set(shares)))
        for k in range(n + 1):                                    # any subset's sum is exact too
            assert sum(shares[:k]) + sum(shares[k:]) == points


def test_results_json_is_written_even_when_the_grader_fails(tmp_path, monkeypatch, capsys):
    def broken(*a, **k):
        raise grade.GradingError("no tests here")
    monkeypatch.setattr(grade, "collect", broken)
    out = tmp_path / "results.json"
    assert grade.main(["--parts", "ex1", "--json", str(out)]) == 2
    rep = json.loads(out.read_text())
    assert rep["score"] == 0 and rep["tests"] == [] and "no tests here" in rep["output"]
    assert "grading failed" in capsys.readouterr().err


# -- the scheduling project ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_project_scores_the_floor_the_headroom_and_a_leaderboard(tmp_path):
    """The shipped policy (the engine's own scheduler) meets the floor and matches the baseline on every seed (half
    the goodput points), with the same score on a second run (the simulated clock) and each seed's figures printed;
    a policy that leaks a block, or one that crashes, scores 0, in its own process, saying why."""
    from exercises import project
    good = project.score(exercises.PACKAGE_DIR, seeds=(1, 2), num_requests=6)
    assert good["floor"] and good["points"] == project.POINTS_FLOOR + project.POINTS_GOODPUT / 2, good["output"]
    assert good["headroom"] == 0 and [r["seed"] for r in good["seeds"]] == [1, 2]
    assert good["leaderboard"][0] == {"name": "headroom closed (%)", "value": 0.0, "order": "desc"}
    assert "clock: simulated" in good["output"].splitlines()[0]
    assert all(f"seed {s} (practice): " in good["output"] for s in (1, 2)), good["output"]
    again = project.score(exercises.PACKAGE_DIR, seeds=(1, 2), num_requests=6)
    assert again["output"] == good["output"]                 # the simulated clock: the same score every run
    leaky = tmp_path / "leaky"
    leaky.mkdir()
    (leaky / "project_scheduler.py").write_text(
        "from minibatch.engine.scheduler import Scheduler\n\n\nclass ProjectScheduler(Scheduler):\n"
        "    def _fill(self, out):\n        super()._fill(out)\n"
        "        if not hasattr(self, 'leaked'):\n            self.leaked = self.allocator.allocate('leak', [1, 2, 3])\n")
    bad = project.score(leaky, seed=project.PRACTICE_SEED, num_requests=6)
    assert not bad["floor"] and bad["points"] == 0 and "blocks leaked" in bad["output"], bad["output"]
    (leaky / "project_scheduler.py").write_text("import os\nos._exit(3)\n")
    dead = project.score(leaky, seed=project.PRACTICE_SEED, num_requests=6)
    assert dead["points"] == 0 and "status 3" in dead["output"], dead["output"]


@pytest.mark.slow
def test_full_project_marks_are_reachable_on_the_hidden_workloads(tmp_path):
    """Issue 36: the instructor's shortest-job-first admission (exercises/project_hidden.py, about 15 lines) earns
    every goodput point on the hidden workloads, closing some of the headroom on each, and not all of it."""
    from exercises import project
    d = tmp_path / "sjf"
    d.mkdir()
    (d / "project_scheduler.py").write_text(
        "from exercises.project_hidden import ShortestJobFirst as ProjectScheduler  # noqa: F401\n")
    got = project.score(d)                                   # the hidden seeds and size
    from exercises.project_hidden import NUM_REQUESTS, SEEDS
    assert got["points"] == project.POINTS_FLOOR + project.POINTS_GOODPUT, got["output"]
    assert [r["seed"] for r in got["seeds"]] == list(SEEDS)
    assert all(0 < r["headroom"] < 1 and r["student"]["requests"] == NUM_REQUESTS for r in got["seeds"]), got["output"]
    assert project.FULL_AT <= got["headroom"] < 1


def test_the_headroom_rule():
    """(met - base) / (N - base) above the engine's scheduler, (met - base) / base below it, nothing where there was
    nothing to gain; goodput points: half for matching, all at FULL_AT, none for meeting nothing."""
    from exercises import project
    assert project.headroom(34, 26, 40) == 8 / 14 and project.headroom(26, 26, 40) == 0
    assert project.headroom(13, 26, 40) == -0.5 and project.headroom(0, 26, 40) == -1
    assert project.headroom(40, 40, 40) is None and project.headroom(39, 40, 40) == -1 / 40
    share = project.goodput_share
    assert share(0) == 0.5 and share(project.FULL_AT) == share(1) == 1 and share(-1) == 0
    assert share(project.FULL_AT / 2) == 0.75 and share(-0.5) == 0.25


def test_the_grader_prints_every_workloads_figures(monkeypatch):
    """``--project`` puts the project in results.json: one test entry whose output and the report's output show
    each seed's figures, the leaderboard, and the headroom in extra_data."""
    from exercises import project
    out = ("headroom closed +12.5 % on average over 2 workload(s) of 120 requests (...)\n"
           "  seed 5: 90 of 120 met the targets, the engine's scheduler 86: ...\n"
           "  seed 6: 88 of 120 met the targets, the engine's scheduler 88: ...")
    fake = {"points": 17.5, "max_points": 20, "floor": True, "headroom": 0.125, "goodput": 30.0, "baseline": 29.0,
            "output": out, "leaderboard": [{"name": "headroom closed (%)", "value": 12.5, "order": "desc"}],
            "seeds": [{"seed": 5, "student": {"requests": 120, "met_slo": 90}, "baseline": {"met_slo": 86},
                       "headroom": 4 / 34},
                      {"seed": 6, "student": {"requests": 120, "met_slo": 88}, "baseline": {"met_slo": 88},
                       "headroom": 0.0}]}
    monkeypatch.setattr(project, "score", lambda student_dir=None: fake)
    rep = {"score": 0.0, "tests": [], "output": "table", "extra_data": {"max_score": 0.0}}
    grade.add_project(rep, None)
    assert rep["score"] == 17.5 and rep["extra_data"]["max_score"] == 20 and rep["leaderboard"] == fake["leaderboard"]
    assert "seed 5: 90 of 120" in rep["output"] and "seed 6: 88 of 120" in rep["tests"][0]["output"]
    assert rep["extra_data"]["project"]["headroom"] == 0.125
    assert [s["met"] for s in rep["extra_data"]["project"]["seeds"]] == [90, 88]


def test_the_hidden_workloads_are_more_and_larger_than_the_practice_ones():
    from exercises import project
    from exercises.project_hidden import NUM_REQUESTS, SEEDS
    assert len(SEEDS) >= 3 and not set(SEEDS) & set(project.PRACTICE_SEEDS) and NUM_REQUESTS > project.NUM_REQUESTS
    assert all(project.workload(s) != project.workload(p) for s in SEEDS for p in project.PRACTICE_SEEDS)


# -- the integration part (ex11: exercises 1, 6 and 7 together) -----------------------------------------------------
def test_your_engine_is_a_part_that_needs_three_others():
    """ex11 has no file: --parts names it (or all does), its session selects exercises 1, 6 and 7, and the report
    says which parts it grades together."""
    ex11 = grade.INTEGRATIONS["ex11"]
    assert [p.part for p in grade.parse_parts("your_engine,ex1")] == ["ex1", "ex11"]
    assert grade.parse_parts(None)[-1] is ex11 and grade.parse_parts("all")[-1] is ex11
    assert set(ex11.name.split(",")) == {"slot_mapping", "block_allocator", "scheduler"}
    assert exercises.selected(ex11.name) == {"slot_mapping", "block_allocator", "scheduler"}
    assert "ex1+ex6+ex7" in ex11.title and ex11.needs_parts == "ex1, ex6, ex7"
    with pytest.raises(ValueError, match="your_engine \\(ex11\\)"):
        grade.parse_parts("your_engin")
    assert grade.POINTS["ex11"] < grade.POINTS["ex7"] and grade.unavailable("ex11") == ""


def test_a_release_without_all_three_does_not_offer_your_engine(monkeypatch):
    monkeypatch.setattr(exercises, "REMOVED", frozenset({"slot_mapping", "block_allocator"}))
    why = grade.unavailable("ex11")
    assert why.startswith("not in this release") and "ex7 (scheduler step)" in why and "ex6" not in why.split("out")[-1]
    runs = grade.grade(grade.parse_parts("ex11"))              # nothing to collect or run
    table, rep = grade.report(runs, 0.0)
    assert "not in this release" in table and rep["extra_data"]["max_score"] == 0 and rep["tests"] == []
    monkeypatch.setattr(exercises, "REMOVED", frozenset(exercises.PIECES))
    assert grade.unavailable("ex11") == ""
