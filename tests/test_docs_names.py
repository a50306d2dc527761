"""The prose cannot go stale (issue 29): every name the notebooks and READMEs give is one the code has.

Read: every notebook under notebooks/ (markdown and code cells) and every README.md in the repository. Checked:

* each repo path (``minibatch/kv/attention.py``, ``notebooks/02_paged_kv_cache.ipynb``, a relative Markdown link)
  exists;
* each dotted name ``minibatch.…``, ``kernels.…``, ``exercises.…`` imports: the longest importable module, then
  attributes (without Triton, ``kernels.…`` is read from the source instead of imported);
* each ``python -m MODULE …`` command of this repository: ``MODULE [SUBCOMMAND] --help`` exits 0 (all of them
  in one child process), every flag the command line names is in that help, a value given to a flag with
  choices is one of them, and the subcommand is one the module has;
* each attention backend, speculative method, speculative_config key, scheduling / policy / order name and demo
  scenario the text uses is one the code accepts (the tuples in minibatch/, not a copy here).

A failure names the file, the cell and the stale text, e.g.
``notebooks/02_paged_kv_cache.ipynb cell 16: path `minibatch/kv_cache.py` does not exist``.
"""
import ast
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"out", "build", "node_modules", "runs", "__pycache__"}
PACKAGES = ("minibatch", "kernels", "exercises")


def documents() -> list:
    """[(label, directory, text)]: each README, and each notebook cell (markdown and code). A label ends in
    "(code)" for a code cell, whose brackets are not Markdown links."""
    docs = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if any(p.startswith(".") or p in SKIP_DIRS or p.endswith(".egg-info") for p in rel.parts[:-1]):
            continue
        if path.name == "README.md":
            docs.append((str(rel), path.parent, path.read_text(encoding="utf-8")))
        elif path.suffix == ".ipynb" and rel.parts[0] == "notebooks":
            for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
                kind = " (code)" if cell["cell_type"] == "code" else ""
                docs.append((f"{rel} cell {i}{kind}", path.parent, "".join(cell["source"])))
    return docs


DOCS = documents()

# --- paths -----------------------------------------------------------------------------------------------------
PATH_RE = re.compile(r"(?<![\w./-])((?:minibatch|kernels|exercises|notebooks|tests|\.ci)/[\w./*<>-]*)")
NOTEBOOK_RE = re.compile(r"(?<![\w/-])(\d\d_\w+\.ipynb)")
LINK_RE = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


# files that only a student release has: exercises/release.py writes them (checked to still say so)
RELEASE_ONLY = {"exercises/_release.py": ("exercises/release.py", "_release.py")}


def _exists(base: Path, rel: str) -> bool:
    rel = rel.rstrip(".,:;")
    if base == ROOT and rel in RELEASE_ONLY:
        writer, mention = RELEASE_ONLY[rel]
        return mention in (ROOT / writer).read_text(encoding="utf-8")
    if "<" in rel or "*" in rel:                      # a pattern: <name>, *, and exN-style capitals stand for any
        return any(base.glob(re.sub(r"<[^>]*>|(?<=[a-z])[A-Z]+(?=[_.*-])", "*", rel)))
    return (base / rel).exists()


def path_problems() -> list:
    bad = []
    for label, where, text in DOCS:
        for m in PATH_RE.finditer(text):
            if not _exists(ROOT, m.group(1)):
                bad.append(f"{label}: path `{m.group(1).rstrip('.,:;')}` does not exist")
        for m in NOTEBOOK_RE.finditer(text):
            if not (ROOT / "notebooks" / m.group(1)).exists():
                bad.append(f"{label}: notebook `{m.group(1)}` is not in notebooks/")
        for m in LINK_RE.finditer("" if label.endswith("(code)") else text):
            target = m.group(1)
            if "://" not in target and not target.startswith("mailto:") and not _exists(where, target):
                bad.append(f"{label}: link target `{target}` does not exist (relative to {where.relative_to(ROOT)}/)")
    return bad


def test_every_repo_path_the_docs_name_exists():
    bad = path_problems()
    assert not bad, "stale paths:\n" + "\n".join(bad)


# --- dotted names ------------------------------------------------------------------------------------------------
DOTTED_RE = re.compile(r"(?<![\w.])((?:minibatch|kernels|exercises)(?:\.[A-Za-z_]\w*)+)")
FILE_SUFFIXES = {"py", "md", "json", "ipynb", "safetensors", "txt"}


def _static_attr(module_file: Path, attr: str) -> bool:
    """Whether ``attr`` is bound at the top level of a module's source (for a module that needs a missing package)."""
    tree = ast.parse(module_file.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == attr:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name).split(".")[0] == attr
                                                                  for a in node.names):
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(n, ast.Name) and n.id == attr for t in targets for n in ast.walk(t)):
                return True
    return False


def _resolve_statically(parts: list) -> str | None:
    """The dotted name read from the source tree: packages and modules by file, then one attribute by AST."""
    path = ROOT
    for i, part in enumerate(parts):
        if (path / part).is_dir():
            path = path / part
            continue
        if (path / f"{part}.py").exists():
            path = path / f"{part}.py"
            rest = parts[i + 1:]
            break
        module_file = path / "__init__.py"
        if module_file.exists() and _static_attr(module_file, part):
            return None
        return f"`{'.'.join(parts[:i + 1])}` is neither a module nor a name bound in `{'.'.join(parts[:i])}`"
    else:
        return None
    if rest and not _static_attr(path, rest[0]):
        return f"`{'.'.join(parts[:len(parts) - len(rest)])}` has no attribute `{rest[0]}`"
    return None


def resolve(name: str) -> str | None:
    """None when ``name`` imports (the longest importable module, then getattr), else why not."""
    parts = name.split(".")
    module, i = None, 0
    for i in range(1, len(parts) + 1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name == ".".join(parts[:i]):
                i -= 1
                break
            if e.name and e.name.split(".")[0] not in PACKAGES:     # needs a package not installed (triton)
                return _resolve_statically(parts)
            raise
    obj = module
    for j in range(i, len(parts)):
        if not hasattr(obj, parts[j]):
            return f"`{'.'.join(parts[:j])}` has no attribute `{parts[j]}`"
        obj = getattr(obj, parts[j])
    return None


def dotted_problems() -> list:
    bad, seen = [], {}
    for label, _, text in DOCS:
        for m in DOTTED_RE.finditer(text):
            name = m.group(1)
            if name.rsplit(".", 1)[-1] in FILE_SUFFIXES or text[m.end():m.end() + 1] == "/":
                continue
            if name not in seen:
                seen[name] = resolve(name)
            if seen[name]:
                bad.append(f"{label}: `{name}` does not import: {seen[name]}")
    return bad


def test_every_dotted_name_imports():
    bad = dotted_problems()
    assert not bad, "stale dotted names:\n" + "\n".join(bad)


# --- python -m commands -----------------------------------------------------------------------------------------
COMMAND_RE = re.compile(r"python3? -m ((?:minibatch|kernels|exercises)(?:\.\w+)*)([^\n`]*)")
FLAG_RE = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")

HELP_RUNNER = r"""
import contextlib, io, json, os, runpy, sys
results = []
for argv in json.loads(sys.argv[1]):
    out, code = io.StringIO(), None
    sys.argv = [argv[0]] + argv[1:]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        code, _ = 1, out.write(f"{type(e).__name__}: {e}")
    results.append([code, out.getvalue()])
print(json.dumps(results))
"""


def commands() -> list:
    """[(label, module, rest of the command line)], comments and shell glue cut off."""
    found = []
    for label, _, text in DOCS:
        text = text.replace("\\\n", " ")
        for m in COMMAND_RE.finditer(text):
            rest = re.split(r"\s#|\s&&\s|\s\|\s|;|\)$", m.group(2))[0]
            found.append((label, m.group(1), rest))
    return found


def _tokens(rest: str) -> list:
    try:
        return shlex.split(rest)
    except ValueError:
        return rest.split()


def help_argv(module: str, rest: str) -> list:
    """The command line as written, placeholders tidied (``[--x Y]`` -> ``--x Y``, ``a|b`` -> ``a``, a capitalised
    placeholder such as ``N`` or ``OUT_DIR`` -> ``1``), + --help."""
    toks = [t.strip("[]") for t in _tokens(rest) if t.strip("[]") not in ("", "...", "\\")]
    toks = ["1" if re.fullmatch(r"[A-Z][A-Z_]*", t) else t for t in toks]
    return [module] + [t.split("|")[0] if "|" in t and not t.startswith("{") else t for t in toks] + ["--help"]


def _has_argparse(module: str) -> bool:
    """Whether the module's entry point parses arguments (else `--help` would run it)."""
    base = ROOT.joinpath(*module.split("."))
    src = base / "__main__.py" if base.is_dir() else base.with_suffix(".py")
    if not src.exists():
        return False
    text = src.read_text(encoding="utf-8")
    if "ArgumentParser" in text or "argparse" in text:
        return True
    imported = re.findall(r"from ((?:minibatch|exercises|kernels)[\w.]*) import main", text)   # a thin __main__
    return any(_has_argparse(m) for m in imported)


def run_helps(cmds) -> dict:
    """help argv -> (exit code, what it printed): each command line as written, + --help, in one child process.
    argparse acts on --help once it has read the arguments before it, so a subcommand's own help is printed,
    a bad choice or subcommand fails with argparse's message, and nothing runs."""
    wanted = []
    for _, module, rest in cmds:
        argv = help_argv(module, rest)
        if _has_argparse(module) and argv not in wanted:
            wanted.append(argv)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("TRITON_INTERPRET", "1")
    proc = subprocess.run([sys.executable, "-c", HELP_RUNNER, json.dumps(wanted)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return {tuple(a): tuple(r) for a, r in zip(wanted, results)}


def _choices(help_text: str, flag: str):
    m = re.search(re.escape(flag) + r"[ =]\{([^}]*)\}", help_text)
    return set(m.group(1).split(",")) if m else None


def command_problems(cmds, table) -> list:
    from minibatch.bench.demo import SCENARIOS
    bad = []
    for label, module, rest in cmds:
        where = f"{label}: `python -m {module}{rest.rstrip()}`"
        if not _has_argparse(module):
            bad.append(f"{where}: {module} has no argparse entry point, so `--help` cannot be checked")
            continue
        argv = help_argv(module, rest)
        code, text = table[tuple(argv)]
        if code != 0:
            bad.append(f"{where}: `python -m {' '.join(argv)}` exited {code}: {text.strip()[-400:]}")
            continue
        toks = _tokens(rest)
        if toks[:1] == ["demo"]:
            scenario = next((t for t in toks[1:] if not t.startswith("-")), None)
            if scenario and not scenario.endswith(".json") and scenario not in SCENARIOS and scenario.upper() != scenario:
                bad.append(f"{where}: demo scenario `{scenario}` is not one of {list(SCENARIOS)}")
        for m in FLAG_RE.finditer(rest):
            flag = m.group(1)
            if flag in ("-h", "--help"):
                continue
            if not re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", text):
                bad.append(f"{where}: flag `{flag}` is not in `python -m {' '.join(argv)}`")
                continue
            choices = _choices(text, flag)
            if choices and flag in toks and toks.index(flag) + 1 < len(toks):
                value = toks[toks.index(flag) + 1].strip("[]")
                if not value.startswith("-"):
                    for v in re.split(r"[|,]", value):
                        if v and v not in choices and v.upper() != v:
                            bad.append(f"{where}: `{flag} {v}`: choose one of {sorted(choices)}")
    return bad


def test_every_python_m_command_parses_its_help_and_flags():
    cmds = commands()
    bad = command_problems(cmds, run_helps(cmds))
    assert not bad, "stale commands:\n" + "\n".join(bad)


# --- option values -----------------------------------------------------------------------------------------------
def option_problems() -> list:
    from minibatch.bench.demo import SCENARIOS
    from minibatch.engine.config import SCHEDULINGS
    from minibatch.engine.request_queue import POLICIES
    from minibatch.engine.scheduler import ORDERS
    from minibatch.kv.attention import BACKENDS
    from minibatch.spec_decode.config import KEYS, METHODS, TREE_KINDS
    from minibatch.spec_decode.typical import ACCEPTANCE
    q = r"""["']"""
    rules = [                               # (what, pattern whose group 1 is the name, the names accepted)
        ("attention backend", rf"attention_backend\s*=\s*{q}(\w+){q}", BACKENDS),
        ("attention backend", r"--backend[ =](\w+)", BACKENDS),
        ("attention backend", rf"`?{q}(\w+){q}`?,? (?:the \w+ )?backend\b", BACKENDS),
        ("attention backend", rf"\bbackends? `?{q}(\w+){q}", BACKENDS),
        ("speculative method", rf"{q}method{q}\s*:\s*{q}(\w+){q}", METHODS),
        ("speculative method", rf"\bmethod\s*=\s*{q}(\w+){q}", METHODS),
        ("speculative method", r"--speculative[ =](\w+)", METHODS),
        ("token tree kind", rf"{q}tree{q}\s*:\s*{q}(\w+){q}", tuple(TREE_KINDS.values())),
        ("acceptance", rf"{q}acceptance{q}\s*:\s*{q}(\w+){q}", ACCEPTANCE),
        ("scheduling", rf"\bscheduling\s*=\s*{q}(\w+){q}", SCHEDULINGS),
        ("policy", rf"\bpolicy\s*=\s*{q}(\w+){q}", POLICIES),
        ("order", rf"\border\s*=\s*{q}([\w-]+){q}", ORDERS),
        ("demo scenario", rf"run_demo\(\s*{q}(\w+){q}", SCENARIOS),
    ]
    bad = []
    for label, _, text in DOCS:
        for what, pattern, accepted in rules:
            for m in re.finditer(pattern, text):
                if m.group(1) not in accepted:
                    bad.append(f"{label}: {what} `{m.group(1)}` (in `{m.group(0)}`) is not one of {list(accepted)}")
        for m in re.finditer(r"\{[^{}]*[\"']method[\"'][^{}]*\}", text):         # a speculative_config's keys
            for key in re.findall(r"[\"'](\w+)[\"']\s*:", m.group(0)):
                if key not in KEYS:
                    bad.append(f"{label}: speculative_config key `{key}` (in `{m.group(0)}`) is not one of {sorted(KEYS)}")
    return bad


def test_every_backend_method_and_option_name_is_accepted():
    bad = option_problems()
    assert not bad, "stale option names:\n" + "\n".join(bad)


def test_the_checker_finds_stale_text(tmp_path, monkeypatch):
    """The checks above on text known to be stale (the names issue 29 found) report each one, with its place."""
    stale = ("`minibatch/model.py`, `minibatch.reference.generate`, `minibatch.sampler.probabilities`, "
             "`minibatch/kv_cache.py`, attention_backend=\"dense\", `\"dense\"`, the vectorised backend, "
             "minibatch.speculative.rejection_sample, speculative_config={\"method\": \"medusa2\", \"k\": 3}, "
             "see 12_missing.ipynb\n```\npython -m minibatch demo paged --frames 3\n"
             "python -m minibatch.bench speculative --kv-reuse sometimes\npython -m minibatch sing\n```")
    good = "`minibatch/kv/kv_cache.py`, `minibatch.sampling.reference.generate`, attention_backend=\"batched\""
    monkeypatch.setattr(sys.modules[__name__], "DOCS", [("stale.md", ROOT, stale), ("good.md", ROOT, good)])
    found = path_problems() + dotted_problems() + option_problems()
    for expected in ["stale.md: path `minibatch/model.py`", "stale.md: path `minibatch/kv_cache.py`",
                     "stale.md: `minibatch.reference.generate` does not import",
                     "stale.md: `minibatch.sampler.probabilities` does not import",
                     "stale.md: `minibatch.speculative.rejection_sample` does not import",
                     "stale.md: attention backend `dense` (in `attention_backend=\"dense\"`)",
                     "stale.md: speculative method `medusa2`", "stale.md: speculative_config key `k`",
                     "stale.md: notebook `12_missing.ipynb`"]:
        assert any(f.startswith(expected) for f in found), f"not reported: {expected}\n" + "\n".join(found)
    assert sum(f.startswith("stale.md: attention backend `dense`") for f in found) == 2, found
    assert not any(f.startswith("good.md") for f in found), found
    cmds = commands()
    cmds = command_problems(cmds, run_helps(cmds))
    for expected in ["flag `--frames` is not in `python -m minibatch demo paged --frames 3 --help`",
                     "invalid choice: 'sometimes'",
                     "`python -m minibatch sing --help` exited 2"]:
        assert any(expected in f for f in cmds), f"not reported: {expected}\n" + "\n".join(cmds)


# --- exercises/README.md: points, hours and the syllabus against the grader and the files ---------------------------
def exercises_readme_problems(text: str) -> list:
    """The points table, the totals, "Points per part" and the syllabus of exercises/README.md, against
    ``exercises.grade.POINTS`` (the owner of points), the notebooks and the problem sets."""
    from exercises.grade import POINTS
    bad = []
    section = text.split("**Time and points.**", 1)[-1].split("\n\n", 2)
    rows = re.findall(r"\| (ex\d+) [^|]*\| ([\d.]+)(?:-([\d.]+))? \| (\d+) \|", "\n\n".join(section[:2]))
    table = {part: (float(lo), float(hi or lo), int(pts)) for part, lo, hi, pts in rows}
    for part, points in POINTS.items():
        if part not in table:
            pending = f"<!-- {part} row: merged by maintainer" in text
            bad.append(f"exercises/README.md: {part} ({points} points in grade.py) has no row in the points table"
                       + (" (its row is still the placeholder: merge it)" if pending else ""))
        elif table[part][2] != points:
            bad.append(f"exercises/README.md: {part} is worth {table[part][2]} in the table, {points} in grade.py")
    bad += [f"exercises/README.md: {part} is in the points table but not in grade.py's POINTS"
            for part in table if part not in POINTS]
    lo, hi = sum(v[0] for v in table.values()), sum(v[1] for v in table.values())
    fmt = lambda x: f"{x:g}"
    m = re.search(r"In all (\d+) points for about ([\d.]+)-([\d.]+) hours", text)
    if not m or int(m.group(1)) != sum(POINTS.values()) or (m.group(2), m.group(3)) != (fmt(lo), fmt(hi)):
        bad.append(f"exercises/README.md: 'In all ... points for about ... hours' should say {sum(POINTS.values())} "
                   f"points for about {fmt(lo)}-{fmt(hi)} hours, it says {m.group(0) if m else 'nothing'}")
    m = re.search(r"Points per part \(`POINTS`[^)]*\)[^:]*:\s*((?:ex\d+ \d+,\s*)+)(\d+) in all", text)
    said = dict(re.findall(r"(ex\d+) (\d+)", m.group(1))) if m else {}
    if not m or {k: int(v) for k, v in said.items()} != POINTS or int(m.group(2)) != sum(POINTS.values()):
        bad.append(f"exercises/README.md: 'Points per part' should list {POINTS}, {sum(POINTS.values())} in all")
    weeks = re.findall(r"^\s*\| (\d+) \| ([^|]*)\| ([^|]*)\| ([^|]*)\|", text, re.M)
    notebooks = {p.name[:2] for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    sets = {p.name[:2] for p in (ROOT / "exercises" / "problem_sets").glob("[0-9][0-9]_*.md")}
    taught = {n for _, nb, _, _ in weeks for n in re.findall(r"(?<![\d.])(\d\d)(?![\d.])", nb)}
    setted = {n for _, _, ps, _ in weeks for n in re.findall(r"(?<![\d.])(\d\d)(?![\d.])", ps)}
    handed = {p for _, _, _, out in weeks for p in re.findall(r"\b(ex\d+)\b", out)}
    if len(weeks) != 10 or [int(w) for w, *_ in weeks] != list(range(1, 11)):
        bad.append(f"exercises/README.md: the syllabus should have weeks 1-10, it has {[w for w, *_ in weeks]}")
    bad += [f"exercises/README.md: notebook {n} has no week in the syllabus" for n in sorted(notebooks - taught)]
    bad += [f"exercises/README.md: problem set {n} has no week in the syllabus" for n in sorted(sets - setted)]
    bad += [f"exercises/README.md: {p} is not handed out in any week of the syllabus" for p in POINTS if p not in handed]
    if not any("project" in out for *_, out in weeks):
        bad.append("exercises/README.md: the project has no week in the syllabus")
    return bad


def test_exercises_readme_points_hours_and_syllabus_agree_with_the_grader():
    bad = exercises_readme_problems((ROOT / "exercises" / "README.md").read_text(encoding="utf-8"))
    assert not bad, "\n".join(bad)


def test_the_readme_checker_finds_a_wrong_total_and_a_missing_week():
    text = (ROOT / "exercises" / "README.md").read_text(encoding="utf-8")
    from exercises.grade import POINTS
    total = str(sum(POINTS.values()))
    broken = (text.replace(f"In all {total} points", "In all 999 points")
              .replace("| ex1 slot mapping | 0.5 | 3 |", "| ex1 slot mapping | 0.5 | 4 |")
              .replace("| 10 | 11 structured outputs; 13 the memory hierarchy; 14 fewer bytes per token | 11, 13 |",
                       "| 10 | structured outputs; 13 the memory hierarchy; 14 fewer bytes per token | 13 |"))
    bad = exercises_readme_problems(broken)
    for expected in ["should say " + total + " points", "ex1 is worth 4 in the table, 3 in grade.py",
                     "notebook 11 has no week", "problem set 11 has no week"]:
        assert any(expected in b for b in bad), f"not reported: {expected}\n" + "\n".join(bad)
