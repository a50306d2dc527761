"""The front door works as written (issue 37): each newcomer's path through README.md runs.

The README marks the code blocks a newcomer types with an info string after the language,
```` ```bash test:NAME ````, which GitHub ignores and this test reads. Checked here:

* the README stays short (at most 260 lines) and keeps the issue's order of sections, and each persona's
  "start here" link leads to a section whose first command sits within the first screen of it;
* the install blocks: a venv, Python >= 3.10, the torch pin and CPU index that requirements.txt names, and the
  two steps CI takes (``.ci/run`` installs requirements.txt and the package, then runs the README's test command
  exactly); the two commands tests/test_release.py reads in a student release stay byte for byte;
* the smoke test and the demo run as written (the demo with ``--small --text`` added: the same scenario and entry
  point without the animation), and the demo table lists every scenario the command takes;
* the course: every notebook is listed, and ``jupyter lab`` is installed by requirements.txt;
* the instructor's week: the release, then the grader on the stubs (0) and on the solutions (full marks) with the
  same ``--parts``, run as written, with ``../`` put under a temporary directory.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
LINES = README.splitlines()
SCREEN = 25                      # lines of a section a reader sees without scrolling
MAX_LINES = 260
ORDER = ["Install", "Start the course", "A demo in one command", "Teach with it", "A first look at the API",
         "Read the code", "Beyond the basics", "Measured", "Tests", "Troubleshooting", "How the weights were made"]
PERSONAS = {"Learn it": ["Install", "Start the course"], "Show it": ["Install", "A demo in one command"],
            "Teach it": ["Teach with it"]}


def blocks() -> dict:
    """name -> the lines of the ```bash test:NAME block."""
    found = {}
    for m in re.finditer(r"^```\w+ test:([\w-]+)\n(.*?)^```", README, re.S | re.M):
        assert m.group(1) not in found, f"two blocks named test:{m.group(1)}"
        found[m.group(1)] = m.group(2).splitlines()
    return found


BLOCKS = blocks()


def commands(name: str) -> list:
    """The commands of a block: comment lines and trailing comments out."""
    out = []
    for line in BLOCKS[name]:
        line = re.sub(r"\s+#\s.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def sections() -> dict:
    """'## ' heading -> (line index of the heading, the section's lines)."""
    heads = [i for i, line in enumerate(LINES) if line.startswith("## ")]
    return {LINES[h][3:]: (h, LINES[h + 1:(heads[k + 1] if k + 1 < len(heads) else len(LINES))])
            for k, h in enumerate(heads)}


def anchor(title: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def env(**extra) -> dict:
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    for k in ("MINIBATCH_STUDENT", "MINIBATCH_STUDENT_DIR", "PYTEST_ADDOPTS"):
        e.pop(k, None)
    e.update(extra)
    return e


def run(cmd: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """A README line as written, its `python` this interpreter."""
    argv = shlex.split(cmd)
    assert argv[0] in ("python", "python3"), cmd
    return subprocess.run([sys.executable, *argv[1:]], cwd=cwd, env=env(), capture_output=True, text=True,
                          timeout=timeout)


# -- the shape ------------------------------------------------------------------------------------------------
def test_the_readme_fits_and_keeps_the_issues_order():
    assert len(LINES) <= MAX_LINES, f"README.md has {len(LINES)} lines; the front door holds {MAX_LINES} at most"
    titles = list(sections())
    assert titles == ORDER, f"sections {titles}, want {ORDER}"
    pitch = "\n".join(LINES[:sections()["Install"][0]])
    assert "| idea | where | paper |" in pitch, "the ideas table comes before Install"


@pytest.mark.parametrize("persona", list(PERSONAS))
def test_each_personas_first_command_is_on_their_first_screen(persona):
    line = next((l for l in LINES[:sections()["Install"][0]] if f"**{persona}**" in l), None)
    assert line, f"the pitch has no start-here line for {persona!r}"
    linked = re.findall(r"\]\(#([\w-]+)\)", line)
    assert linked == [anchor(t) for t in PERSONAS[persona]], (persona, linked)
    secs = sections()
    for title in PERSONAS[persona]:
        head, body = secs[title]
        first = next((i for i, l in enumerate(body) if l.startswith("```bash")), None)
        assert first is not None and first < SCREEN, \
            f"{title!r}: its first command starts {first} lines below the heading (a screen is {SCREEN})"
        assert body[first].startswith("```bash test:"), f"{title!r}: its first command is not one this test runs"


# -- install ----------------------------------------------------------------------------------------------------
INSTALLS = ["install-linux-cpu", "install-linux-nvidia", "install-macos", "install-windows"]


def _pin() -> str:
    req = (ROOT / "requirements.txt").read_text()
    return re.search(r"^torch==([\w.+]+)", req, re.M).group(1)


@pytest.mark.parametrize("name", INSTALLS)
def test_each_install_block_makes_a_venv_and_takes_cis_two_steps(name):
    cmds = " ; ".join(commands(name))
    assert re.search(r"-m venv \.venv", cmds), f"{name}: no venv"
    assert re.search(r"pip install -r requirements\.txt\b", cmds) and re.search(r"pip install -e \.(\s|$)", cmds), name
    for m in re.finditer(r"pip install torch==(\S+)( --index-url (\S+))?", cmds):
        assert m.group(1) == _pin(), f"{name}: torch {m.group(1)}, requirements.txt pins {_pin()}"
        assert m.group(3) == "https://download.pytorch.org/whl/cpu", f"{name}: {m.group(0)}"
        assert m.group(3) in (ROOT / "requirements.txt").read_text(), "requirements.txt names another CPU index"
    torch_first = [i for i, c in enumerate(commands(name)) if "torch==" in c]
    reqs = [i for i, c in enumerate(commands(name)) if "-r requirements.txt" in c]
    assert all(t < reqs[0] for t in torch_first), f"{name}: the CPU torch must come before requirements.txt"
    if name in ("install-linux-cpu", "install-windows"):
        assert torch_first, f"{name}: PyPI's Linux torch is the CUDA build; a CPU-only install needs the CPU index"
    assert "3.10" in README.split("```bash test:install-linux-cpu")[0].split("## Install")[1], \
        "Install names Python 3.10 or newer before the first block"


def test_ci_takes_the_readmes_steps_and_runs_its_test_command_exactly():
    ci = (ROOT / ".ci" / "run").read_text()
    norm = lambda s: re.sub(r"\s+(-q|--no-deps)\b", "", s.replace("python3 -m pip", "pip"))
    ci_lines = [norm(l.strip()) for l in ci.splitlines() if not l.lstrip().startswith("#")]
    assert "pip install -r requirements.txt" in ci_lines and "pip install -e ." in ci_lines, ci_lines
    assert "pip install -r requirements.txt && pip install -e ." in README       # tests/test_release.py reads it
    assert commands("tests") == ["python -m pytest"]
    bare = [l for l in ci.splitlines() if re.fullmatch(r"python3? -m pytest", l.strip())]
    assert bare == ["python3 -m pytest"], f".ci/run should run the README's test command as it is: {bare}"


# -- the smoke test and the demo ----------------------------------------------------------------------------------
def test_the_smoke_test_runs_as_written():
    (cmd,) = commands("smoke")
    # tests/test_release.py runs the README's first `python -m minibatch generate` line in a release: this one
    assert re.search(r"(python -m minibatch generate .*)", README).group(1) == cmd
    p = run(cmd, ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("def fib(n):") and len(p.stdout) > len("def fib(n):") + 20, p.stdout


def test_the_demo_runs_as_written(tmp_path):
    (cmd,) = commands("demo")
    assert cmd.startswith("python -m minibatch demo ")
    p = run(cmd + " --small --text", tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "steps" in p.stdout, p.stdout[-2000:]


def test_the_demo_table_has_every_scenario():
    from minibatch.bench.demo import SCENARIOS
    body = "\n".join(sections()["A demo in one command"][1])
    listed = re.findall(r"^\| `(\w+)` \|", body, re.M)
    assert listed == list(SCENARIOS), f"the demo table lists {listed}; the command takes {list(SCENARIOS)}"
    for row in re.findall(r"^\| `\w+` \|.*$", body, re.M):
        assert re.search(r"\d+(\.\d+)? (s|min)\b[^|]*\|$", row), f"no run time in {row!r}"


# -- the course -----------------------------------------------------------------------------------------------------
def test_the_course_opens_every_notebook():
    assert commands("course") == ["jupyter lab notebooks/"]
    assert re.search(r"^jupyterlab\b", (ROOT / "requirements.txt").read_text(), re.M)
    body = "\n".join(sections()["Start the course"][1])
    listed = re.findall(r"^- `(\d\d_\w+\.ipynb)`", body, re.M)
    assert listed == sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")), listed


# -- the instructor's week ------------------------------------------------------------------------------------------
@pytest.mark.skipif(not (ROOT / "exercises" / "release.py").exists(),
                    reason="the release builder stays with the instructor (this is a student release)")
def test_the_instructors_week_runs_as_written(tmp_path):
    """Release with --parts, then grade the stubs and the solutions with the same --parts: 0, then full marks."""
    cwd, reports = ROOT, []
    cmds = commands("teach")
    parts = {re.search(r"--parts (\S+)", c).group(1) for c in cmds if "--parts" in c}
    assert len(parts) == 1, f"release and grading must name the same --parts: {parts}"
    assert any("exercises.release" in c for c in cmds) and sum("exercises.grade" in c for c in cmds) == 2
    for cmd in cmds:
        cmd = cmd.replace("../", f"{tmp_path}/")
        if cmd.startswith("cd "):
            cwd = Path(shlex.split(cmd)[1])
            continue
        if "exercises.grade" in cmd:
            reports.append(tmp_path / f"results{len(reports)}.json")
            cmd += f" --json {reports[-1]}"
        p = run(cmd, cwd, timeout=900)
        assert p.returncode == 0, f"{cmd}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    assert cwd != ROOT and (cwd / "exercises" / "_release.py").exists(), "the grading ran outside the release"
    stubs, solved = (json.loads(r.read_text()) for r in reports)
    assert stubs["extra_data"]["max_score"] > 0 and stubs["score"] == 0, stubs["output"]
    assert solved["score"] == solved["extra_data"]["max_score"] == stubs["extra_data"]["max_score"], solved["output"]
