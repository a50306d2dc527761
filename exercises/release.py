"""Build a student release: ``python -m exercises.release OUT_DIR [--parts ex1,ex6] [--solutions DIR]``.

A copy of this repository for students, in which the reference of every chosen part is gone:

* in ``minibatch/`` and ``kernels/`` the reference definition of each part is cut out. A function is replaced
  by a stand-in with the same signature and docstring that calls the student's (``exercises.call_student``);
  a class (the block allocator, the scheduler) by an empty stand-in whose instances are built over the
  student's class (``exercises.StudentsClass``); a helper the student writes too (ex9's kernel) is deleted;
  every further function of a piece of several (``Piece.also``: ex8's positions and accepted path) becomes a
  stand-in too.
  So the engine, the notebooks and the benchmarks run on the student's code, and a student file that
  re-exports the engine's name gets the stand-in back, which says so instead of passing;
* nothing else in the release computes a held-out part: every other implementation of it (``Piece.routes``, in the
  part's module, and ``Piece.elsewhere``, anywhere: ex2's "batched" and "cpu" backends, ex4's tree sampler, ex9's
  general and flash-decode kernels) is cut, or keeps its signature with a body that computes through the
  student's piece (``exercises.attention_through``, ``tree_rejection_through``, ``launch_paged_decode``). A student
  file that calls one back for its answer gets a clear error (a loop through its own function), not a pass: the
  wrapper mutants (``exercises/mutants/*_wraps_*.py``) check that;
* ``exercises/_release.py`` lists the parts held out: ``exercises.reference()`` refuses them, and a test
  outside ``tests/exercises`` (and a notebook cell) that reaches an unfinished one is skipped, saying which;
* the graded tests are the instructor's own: they compare with independent oracles (they never call the
  reference) and pass on the instructor's solutions; the grader (``python -m exercises.grade``) comes along;
* instructor-only files stay behind: the mutants, this builder, the honesty test, the grader's crash tests,
  the release's own test and the problem sets' answer keys (``INSTRUCTOR_ONLY``); the hints
  (``exercises/hints/``) too, unless ``--with-hints``;
* parts not held out keep their reference, so a staged release (``--parts`` per week) runs every notebook
  all term;
* each notebook gets a first cell that switches on ``exercises.notebook``'s guard, and a cell that works a
  held-out part's answer out by hand (metadata ``{"minibatch": {"answer_of": "exN"}}``) becomes a note.

``--solutions DIR`` also writes the instructor's solutions there, one student file per part: the stub with
every unwritten function replaced by the reference's definition (renamed where the names differ, with the
imports it needs). Keep them out of the release; grade them in it to check the release
(``python -m exercises.grade --student-dir DIR`` inside OUT_DIR scores full marks).
"""
from __future__ import annotations

import argparse
import ast
import builtins
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import exercises

REPO = Path(__file__).resolve().parent.parent
INSTRUCTOR_ONLY = ("exercises/mutants/", "exercises/release.py", "tests/test_exercise_honesty.py",
                   "tests/test_grader.py", "tests/test_release.py",
                   "exercises/problem_sets/keys/",        # the problem sets' answer keys and rubrics
                   "exercises/project_hidden.py")          # the project's hidden workload
HINTS = "exercises/hints/"                                 # worked approaches: only with --with-hints
SKIP_PARTS = {"__pycache__", ".git", ".pytest_cache", ".hypothesis", ".ipynb_checkpoints"}
GUARD_CELL = ["# Student release: a cell that needs an exercise you have not finished is skipped, with a message\n",
              "# saying which, and the notebook goes on (exercises/notebook.py).\n",
              "import exercises.notebook\n",
              "\n",
              "exercises.notebook.skip_unfinished_cells()"]


# A module whose cut source builds a native library at first use, and the name of that build: the release's gets a
# name of its own, so a release built and run on the instructor's machine never shares (and so never overwrites) the
# instructor's compiled library in the build cache (the release's C++ source is the operator's schema only).
OWN_BUILDS = {"minibatch.kv.backends.cpu_kernel": ('"minibatch_paged_attention_cpu"', '"minibatch_paged_attention_cpu_release"')}


def module_path(p: exercises.Piece) -> str:
    return p.module.replace(".", "/") + ".py"


def held_out(p: exercises.Piece) -> list:
    """The names of the reference definitions a release cuts out of ``p.module``."""
    return [p.reference_name, *p.also, *p.helpers]


def tracked_files(root: Path) -> list:
    """The repository's files (git's view when there is one: tracked and new, not ignored), relative paths."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, check=True).stdout.decode()
        files = [f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = [str(f.relative_to(root)) for f in root.rglob("*") if f.is_file()]
    return sorted(f for f in files if (root / f).is_file() and not SKIP_PARTS & set(Path(f).parts)
                  and not f.endswith((".pyc", ".egg-info")) and ".egg-info/" not in f)


def _definitions(tree: ast.Module) -> dict:
    return {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def _top_level(tree: ast.Module) -> dict:
    """name -> its top-level definition: a function, a class, or an assignment to that one name."""
    out = _definitions(tree)
    for n in tree.body:
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            out.setdefault(n.targets[0].id, n)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None:
            out.setdefault(n.target.id, n)
    return out


def elsewhere(pieces) -> dict:
    """module -> {name: (piece, return expression or None)}: what a release holding ``pieces`` out does to the
    other implementations of their parts (``Piece.elsewhere``); a definition two of them name goes the later one's
    way (PIECES' order: exercise 9's kernels launch the decode kernel when both 2 and 9 are held out)."""
    out: dict = {}
    for p in exercises.in_order(q.name for q in pieces):
        for module, name, expression in p.elsewhere:
            out.setdefault(module, {})[name] = (p, expression)
    return out


def _span(node) -> tuple:
    """(first line, last line), 1-based, of a definition with its decorators."""
    return min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno


def _call_args(args: ast.arguments) -> str:
    """The call that hands a stand-in's arguments on. A keyword-only argument that defaults to None goes on only
    when given: the reference may have grown one (``tree_bits``) that the exercise's signature does not have."""
    out = [a.arg for a in args.posonlyargs + args.args]
    if args.vararg:
        out.append("*" + args.vararg.arg)
    optional = [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults)
                if isinstance(d, ast.Constant) and d.value is None]
    out += [f"{a.arg}={a.arg}" for a in args.kwonlyargs if a.arg not in optional]
    if optional:
        given = ", ".join(f"{name!r}: {name}" for name in optional)
        out.append(f"**{{k: v for k, v in {{{given}}}.items() if v is not None}}")
    if args.kwarg:
        out.append("**" + args.kwarg.arg)
    return ", ".join(out)


def _stand_in_function(lines: list, node: ast.FunctionDef, p: exercises.Piece) -> str:
    """The def line(s) and docstring of the reference, and a body that calls the student's function (the piece's
    ``func``, or the one of its ``also`` with the reference's name)."""
    target = p.name if node.name == p.reference_name else f"{p.name}.{node.name}"
    body0 = node.body[0]
    has_doc = isinstance(body0, ast.Expr) and isinstance(body0.value, ast.Constant) and isinstance(body0.value.value, str)
    head = "".join(lines[node.lineno - 1:body0.lineno - 1])
    doc = "".join(lines[body0.lineno - 1:body0.end_lineno]) if has_doc else ""
    return (f"{head}{doc}"
            f"    # held out of the student release: the engine calls yours, exercises/{p.stem}.py\n"
            f"    import exercises\n"
            f"    return exercises.call_student({target!r}, {_call_args(node.args)})\n\n\n"
            f"{node.name}._held_out = {p.name!r}\n")


def _routed_helper(lines: list, node: ast.FunctionDef, p: exercises.Piece, expression: str) -> str:
    """A helper the engine calls (a batched fast path) kept with its signature and docstring, its body one
    ``return`` through the student's function: the release has no second implementation of the part."""
    body0 = node.body[0]
    has_doc = isinstance(body0, ast.Expr) and isinstance(body0.value, ast.Constant) and isinstance(body0.value.value, str)
    head = "".join(lines[_span(node)[0] - 1:body0.lineno - 1])
    doc = "".join(lines[body0.lineno - 1:body0.end_lineno]) if has_doc else ""
    use = "    import exercises\n" if "exercises." in expression else ""
    return (f"{head}{doc}"
            f"    # held out of the student release: computed through yours, exercises/{p.stem}.py\n"
            f"{use}    return {expression}\n")


def _stand_in_class(node: ast.ClassDef, p: exercises.Piece) -> str:
    bases = ", ".join(ast.unparse(b) for b in node.bases)
    first = (ast.get_docstring(node) or "").split("\n")[0]
    return (f"# -- held out of the student release ------------------------------------------------------------\n"
            f"# The reference {node.name} is not here: the engine builds yours, the class {p.func} in\n"
            f"# exercises/{p.stem}.py (a subclass of {bases}).\n"
            f"from exercises import StudentsClass as _StudentsClass  # noqa: E402\n\n\n"
            f"class {node.name}({bases}, metaclass=_StudentsClass, piece={p.name!r}):\n"
            f"    \"\"\"{first}\n\n    Building one builds yours, from exercises/{p.stem}.py.\"\"\"\n")


def cut(source: str, p: exercises.Piece) -> str:
    """``source`` (the piece's module) with the piece's reference definitions replaced by stand-ins."""
    tree, lines = ast.parse(source), source.splitlines(keepends=True)
    defs = _definitions(tree)
    for name in held_out(p):
        if name not in defs:
            raise ValueError(f"{p.name}: {name} is not defined at the top of {p.module}")
    for name in sorted(held_out(p), key=lambda n: -defs[n].lineno):          # bottom up: line numbers hold
        node = defs[name]
        first, last = _span(node)
        if name in dict(p.routes):
            new = _routed_helper(lines, node, p, dict(p.routes)[name])
        elif name not in (p.reference_name, *p.also):
            new = (f"# {name}: held out of the student release (you write it in exercises/{p.stem}.py)\n")
        elif isinstance(node, ast.ClassDef):
            new = _stand_in_class(node, p)
        else:
            new = _stand_in_function(lines, node, p)
        lines[first - 1:last] = [new]
    out = "".join(lines)
    ast.parse(out)
    return out


def cut_elsewhere(source: str, module: str, plan: dict) -> str:
    """``source`` (``module``'s) with each definition ``plan`` names ({name: (piece, expression)}) cut (None) or
    kept with a body that computes through the student's piece (an assignment: that value, ``$VALUE`` the old; or
    a function of the old value's source that returns the new)."""
    tree, lines = ast.parse(source), source.splitlines(keepends=True)
    defs = _top_level(tree)
    missing = sorted(set(plan) - set(defs))
    if missing:
        raise ValueError(f"{', '.join(missing)}: not defined at the top of {module} "
                         f"(Piece.elsewhere of {', '.join(sorted({plan[m][0].name for m in missing}))})")
    for name in sorted(plan, key=lambda n: -defs[n].lineno):                  # bottom up: line numbers hold
        p, expression = plan[name]
        node = defs[name]
        first, last = _span(node) if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else (node.lineno,
                                                                                              node.end_lineno)
        if expression is None:
            new = (f"# {name}: held out of the student release, which computes {p.title} through yours only "
                   f"(exercises/{p.stem}.py)\n")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            old = ast.get_source_segment(source, node.value)
            value = expression(old) if callable(expression) else expression.replace("$VALUE", old)
            new = (f"# held out of the student release: {p.title} is computed through yours, exercises/{p.stem}.py\n"
                   f"{name} = {value}\n")
        else:
            new = _routed_helper(lines, node, p, expression)
        lines[first - 1:last] = [new]
    out = "".join(lines)
    ast.parse(out)
    return out


# -- the instructor's solutions -------------------------------------------------------------------------------
def _free_names(node) -> set:
    """Names a definition reads that it does not bind itself (its globals, roughly)."""
    bound = set()
    for n in ast.walk(node):
        if isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            bound.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n is not node:
            bound.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in n.names}
    used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return {x for x in used - bound if not hasattr(builtins, x)}


def _top_names(tree: ast.Module) -> set:
    names = set()
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, ast.Assign):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return names


def solution(p: exercises.Piece, root: Path = REPO) -> str:
    """The student file of ``p`` with every unwritten function replaced by the reference's own definition."""
    stub = (root / "exercises" / f"{p.stem}.py").read_text()
    ref_src = (root / module_path(p)).read_text()
    ref_tree, ref_lines = ast.parse(ref_src), ref_src.splitlines(keepends=True)
    ref_defs = _definitions(ref_tree)
    tree, lines = ast.parse(stub), stub.splitlines(keepends=True)
    todo = []                                     # (stub node, reference node, name in the stub)
    for n in tree.body:
        if isinstance(n, ast.FunctionDef) and exercises.unwritten(n):
            ref_name = p.reference_name if n.name == p.func else n.name
            todo.append((n, ref_defs[ref_name], n.name))
        elif isinstance(n, ast.ClassDef):
            ref_methods = {m.name: m for m in ref_defs[p.reference_name].body if isinstance(m, ast.FunctionDef)}
            todo += [(m, ref_methods[m.name], m.name) for m in n.body
                     if isinstance(m, ast.FunctionDef) and exercises.unwritten(m)]
    needed = set()
    for stub_node, ref_node, name in sorted(todo, key=lambda t: -t[0].lineno):
        first, last = _span(ref_node)
        text = "".join(ref_lines[first - 1:last])
        if ref_node.name != name:
            text = text.replace(f"def {ref_node.name}(", f"def {name}(", 1)
        s_first, s_last = _span(stub_node)
        lines[s_first - 1:s_last] = [text]
        needed |= _free_names(ref_node)
    missing = sorted(needed - _top_names(tree) - set(p.functions))
    missing = [x for x in missing if x in _top_names(ref_tree) or x in _definitions(ref_tree)]
    out = "".join(lines)
    if missing:
        last_import = max(n.end_lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))
        out_lines = out.splitlines(keepends=True)
        out_lines.insert(last_import, f"from {p.module} import {', '.join(missing)}  # noqa: F401 (the solution's)\n")
        out = "".join(out_lines)
    head = f'"""Solution (instructor\'s copy, not for students): exercise {p.part[2:]}, {p.title}.\n\n'
    out = out.replace('"""', head, 1) if out.startswith('"""') else head + '"""\n' + out
    ast.parse(out)
    return out


# -- building ---------------------------------------------------------------------------------------------------
def _answer_cell(cell: dict, p: exercises.Piece) -> dict:
    """A notebook cell that works an exercise's answer out by hand (metadata ``{"minibatch": {"answer_of":
    "exN"}}``), in a release that holds that part out: a note pointing at the student's file instead."""
    names = ", ".join(f"`{f}`" for f in p.functions)
    out = {"cell_type": "markdown", "metadata": {},
           "source": [f"*In this student release, a cell here worked out by hand what exercise {p.part[2:]} asks of "
                      f"you ({names} in `exercises/{p.stem}.py`); the cells below run on yours.*"]}
    if "id" in cell:
        out["id"] = cell["id"]
    return out


def _guard_notebook(path: Path, held_out=()) -> None:
    nb = json.loads(path.read_text(encoding="utf-8"))
    by_part = {p.part: p for p in held_out}
    nb["cells"] = [_answer_cell(c, by_part[c["metadata"]["minibatch"]["answer_of"]])
                   if c.get("metadata", {}).get("minibatch", {}).get("answer_of") in by_part else c
                   for c in nb["cells"]]
    code = next((c for c in nb["cells"] if c["cell_type"] == "code"), None)
    cell = {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": list(GUARD_CELL)}
    if code is not None and "id" in code:
        cell["id"] = "student-release-guard"
    first = 1 if nb["cells"] and nb["cells"][0]["cell_type"] == "markdown" else 0
    nb["cells"].insert(first, cell)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def build(out: Path, parts=None, solutions: Path | None = None, root: Path = REPO, force: bool = False,
          with_hints: bool = False) -> dict:
    """Write the release to ``out``; returns {"pieces": [...], "files": n, "solutions": [...]}."""
    pieces = exercises.in_order(exercises.selected("all" if not parts else parts))
    out = Path(out).resolve()
    if out == root.resolve() or out in root.resolve().parents:
        raise ValueError(f"refusing to write the release over the repository itself ({out})")
    if out.exists():
        if not force and any(out.iterdir()):
            raise FileExistsError(f"{out} exists and is not empty (--force replaces it)")
        shutil.rmtree(out)
    files = [f for f in tracked_files(root) if not f.startswith(INSTRUCTOR_ONLY)
             and (with_hints or not f.startswith(HINTS))]
    for f in files:
        (out / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, out / f)
    for p in pieces:
        target = out / module_path(p)
        target.write_text(cut(target.read_text(), p))
    for module, plan in elsewhere(pieces).items():       # the parts' other implementations (Piece.elsewhere)
        target = out / (module.replace(".", "/") + ".py")
        if target.exists():                              # a module this checkout lacks has nothing to give away
            text = cut_elsewhere(target.read_text(), module, plan)
            if module in OWN_BUILDS:
                old, new = OWN_BUILDS[module]
                if text.count(old) != 1:
                    raise ValueError(f"{module}: the build's name {old} is not in it once (OWN_BUILDS)")
                text = text.replace(old, new)
            target.write_text(text)
    names = ", ".join(repr(p.name) for p in pieces)
    (out / "exercises" / "_release.py").write_text(
        '"""Written by exercises/release.py: the parts whose reference this student release leaves out."""\n'
        f"REMOVED = frozenset({{{names}}})\n")
    for nb in sorted((out / "notebooks").glob("*.ipynb")):
        _guard_notebook(nb, pieces)
    readme = out / "exercises" / "README.md"
    if readme.exists():
        parts = ", ".join(f"{p.part} ({p.title})" for p in pieces)
        readme.write_text(
            f"> **Student release.** The reference of {parts} is not in `minibatch/` or `kernels/`: the engine runs "
            f"your code there. A test or a notebook cell that needs a part you have not finished is skipped, saying "
            f"which. (The instructors' tools described at the end, the mutants, the honesty test and the release "
            f"builder, are not shipped.)\n\n" + readme.read_text())
    written = []
    if solutions is not None:
        solutions = Path(solutions)
        solutions.mkdir(parents=True, exist_ok=True)
        for p in pieces:
            (solutions / f"{p.stem}.py").write_text(solution(p, root))
            written.append(p.stem)
    return {"pieces": [p.name for p in pieces], "files": len(files), "solutions": written}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m exercises.release", description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the directory to write the release to (new, or empty; --force replaces it)")
    ap.add_argument("--parts", help="parts to hold out (ex1,ex6 or piece names; default: all)")
    ap.add_argument("--solutions", metavar="DIR", help="also write the instructor's solutions here (keep them apart)")
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists")
    ap.add_argument("--with-hints", action="store_true",
                    help="ship exercises/hints/ (the worked approaches; left out by default)")
    args = ap.parse_args(argv)
    try:
        info = build(Path(args.out), args.parts, Path(args.solutions) if args.solutions else None, force=args.force,
                     with_hints=args.with_hints)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"student release in {args.out}: {info['files']} files; held out: {', '.join(info['pieces'])}")
    if info["solutions"]:
        print(f"instructor's solutions in {args.solutions}: {', '.join(s + '.py' for s in info['solutions'])}")
    print(textwrap.dedent(f"""\
        next: check it (cd {args.out} && python -m exercises.grade: every part scores 0;
              python -m exercises.grade --student-dir {args.solutions or 'SOLUTIONS'}: full marks), then hand it out"""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
