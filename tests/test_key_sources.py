"""Every figure an answer key quotes from a run names where it comes from, and the source checks out (issue 36).

The convention (exercises/problem_sets/keys/README.md): a figure taken from code or a run is followed by a marker
``(from: SOURCE; SOURCE ...)`` that vouches for the figures of its clause (the text back to the previous marker,
the start of the paragraph or bullet, or the last ". " or "; "). A SOURCE is one of

* an expression in backticks, `` `get_model("llama-3-8b").kv_bytes_per_token / 1024` ``: evaluated here with
  ``CostModel, get_hardware, get_model`` (``minibatch.perf``), ``expected_speedup, expected_tokens_per_step``
  (``minibatch.spec_decode.stats``), ``replace`` (``dataclasses``), ``math`` and ``step`` (notebook 09's hand-made
  StepTrace); the value, or each value of a list or tuple, must be one of the clause's figures to the figure's
  own rounding (``128``, ``55.94``, ``26,674``, ``1.3e-3``);
* a command in backticks, `` `python -m minibatch.bench speculative --methods draft --ks 2,4` ``: the module
  exists and its argparse accepts the subcommand and every flag (``--help``, in one child process, as
  tests/test_docs_names.py checks the READMEs); nothing is run, so its figures are the key's word;
* ``notebook 09, cell 7, `anchor` ``: the notebook and the cell exist, the cell is code and its source holds the
  anchor (so a renumbered notebook is caught, and the message says where the anchor went); where the notebook
  stores outputs, every decimal figure of the clause must be in that cell's output;
* ``the script above`` / ``the script below``: the same answer holds a ```python block that parses.

A marker that names none of these, or an expression that does not evaluate, fails too. The checker is tested on
a fabricated key with a wrong figure, a bad flag, a moved cell and an unknown source.
"""
import ast
import importlib.util
import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = sorted((ROOT / "exercises" / "problem_sets" / "keys").glob("[0-9][0-9]_*.md"))


def _docs_names():
    """tests/test_docs_names.py, for its --help runner and flag checks (one definition of a valid command)."""
    if "_docs_names_for_keys" not in sys.modules:
        spec = importlib.util.spec_from_file_location("_docs_names_for_keys", ROOT / "tests" / "test_docs_names.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["_docs_names_for_keys"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["_docs_names_for_keys"]


# --- markers ---------------------------------------------------------------------------------------------------
def markers(text: str) -> list:
    """[(start, end, [source, ...])] for every ``(from: ...)``; backticks may hold parentheses and semicolons."""
    found, i = [], 0
    while (i := text.find("(from: ", i)) >= 0:
        j, tick, depth = i + len("(from: "), False, 0
        while j < len(text):
            ch = text[j]
            if ch == "`":
                tick = not tick
            elif not tick and ch == "(":
                depth += 1
            elif not tick and ch == ")":
                if depth == 0:
                    break
                depth -= 1
            j += 1
        body, parts, cur, tick = text[i + len("(from: "):j], [], "", False
        for ch in body:
            if ch == "`":
                tick = not tick
            if ch == ";" and not tick:
                parts.append(cur.strip())
                cur = ""
            else:
                cur += ch
        parts.append(cur.strip())
        found.append((i, j + 1, [re.sub(r"\s+", " ", p) for p in parts if p]))       # a source may wrap
        i = j + 1
    return found


BOUNDARY_RE = re.compile(r"\n\s*\n|\n\* |\n\d+\. |\*\*Q\d+\.\*\*|(?<=[^\s\d.])\. |(?<=[^\s\d.])\.\s*\n|; ")


def clause(text: str, start: int, floor: int) -> str:
    """The text a marker at ``start`` vouches for: back to ``floor`` (the previous marker's end) or the last
    boundary (paragraph, bullet, question, ". ", "; "), whichever is nearer."""
    head = text[floor:start]
    cut = 0
    for m in BOUNDARY_RE.finditer(head):
        if m.end() < len(head):
            cut = m.end()
    return head[cut:]


NUMBER_RE = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)(?![\w.]*\d)")


def figures(text: str) -> list:
    """[(value, half a unit of its last digit)] of every number written in text: 26,674; 2.15; 1.3e-3; 4."""
    out = []
    for m in NUMBER_RE.finditer(text):
        s = m.group(1).replace(",", "")
        mant, _, exp = s.lower().partition("e")
        decimals = len(mant.partition(".")[2])
        scale = 10.0 ** int(exp) if exp else 1.0
        out.append((float(s), 0.5 * 10.0 ** -decimals * scale))
    return out


def _flatten(v) -> list:
    if isinstance(v, bool):
        raise TypeError("a boolean is not a figure")
    if isinstance(v, (int, float)):
        return [float(v)]
    if isinstance(v, (list, tuple)):
        return [x for item in v for x in _flatten(item)]
    raise TypeError(f"an expression must give a number or a list of numbers, got {type(v).__name__}")


def quoted(value: float, figs) -> bool:
    return any(abs(value - x) <= half * (1 + 1e-9) + 1e-12 for x, half in figs)


# --- the sources ---------------------------------------------------------------------------------------------------
def _notebook_step():
    """Notebook 09's ``step(rows)``: the hand-made StepTrace its cells (and key 09) time."""
    nb = json.loads(next((ROOT / "notebooks").glob("09_*.ipynb")).read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "code" and "def step(" in src:
            tree = ast.parse(src)
            fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "step")
            ns = {}
            exec("from minibatch.trace import SeqStep, StepTrace", ns)
            exec(compile(ast.Module([fn], []), "notebook 09 step", "exec"), ns)
            return ns["step"]
    raise LookupError("notebook 09 has no `def step(` cell")


def namespace() -> dict:
    from minibatch.perf import CostModel, get_hardware, get_model
    from minibatch.spec_decode.stats import expected_speedup, expected_tokens_per_step
    return {"CostModel": CostModel, "get_hardware": get_hardware, "get_model": get_model, "replace": replace,
            "math": math, "expected_speedup": expected_speedup, "expected_tokens_per_step": expected_tokens_per_step,
            "step": _notebook_step()}


NOTEBOOK_RE = re.compile(r"notebook (\d\d), cell (\d+), `([^`]+)`")
SCRIPT_RE = re.compile(r"the script (above|below)")


def notebook_problem(where: str, src: str, text: str) -> str | None:
    m = NOTEBOOK_RE.fullmatch(src)
    paths = sorted((ROOT / "notebooks").glob(f"{m.group(1)}_*.ipynb"))
    if not paths:
        return f"{where}: no notebook {m.group(1)} in notebooks/"
    cells = json.loads(paths[0].read_text(encoding="utf-8"))["cells"]
    i, anchor = int(m.group(2)), m.group(3)
    has = [k for k, c in enumerate(cells) if c["cell_type"] == "code" and anchor in "".join(c["source"])]
    moved = f" (`{anchor}` is in code cell(s) {has})" if has else f" (no code cell holds `{anchor}`)"
    if i >= len(cells):
        return f"{where}: {paths[0].name} has {len(cells)} cells, no cell {i}{moved}"
    cell = cells[i]
    if cell["cell_type"] != "code" or anchor not in "".join(cell["source"]):
        return f"{where}: {paths[0].name} cell {i} is not the code cell that holds `{anchor}`{moved}"
    outs = "".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                   for o in cell.get("outputs", []))
    if outs:
        missing = [f for f in re.findall(r"\d+\.\d+", text) if f not in outs]
        if missing:
            return f"{where}: {paths[0].name} cell {i}'s stored output does not show {missing}"
    return None


def key_problems(name: str, text: str, ns: dict | None = None) -> tuple[list, list]:
    """(problems, commands to check with --help): every marker of one key checked but the commands'."""
    ns = namespace() if ns is None else ns
    bad, cmds, floor = [], [], 0
    answers = [(m.start(), m.group(0)) for m in re.finditer(r"\*\*Q\d+\.\*\*", text)]
    for start, end, sources in markers(text):
        said = clause(text, start, floor)
        floor = end
        line = text.count("\n", 0, start) + 1
        q = next((a for s, a in reversed(answers) if s <= start), "")
        where = f"{name}:{line} {q}".rstrip()
        if not sources:
            bad.append(f"{where}: an empty (from: ) marker")
        for src in sources:
            if src.startswith("`python -m ") and src.endswith("`"):
                m = _docs_names().COMMAND_RE.match(src[1:-1])
                if m:
                    cmds.append((where, *m.groups()))
                else:
                    bad.append(f"{where}: {src} is not a command of minibatch, kernels or exercises")
            elif src.startswith("`python") and src.endswith("`"):
                bad.append(f"{where}: {src}: name a `python -m` command or give the expression itself")
            elif src.startswith("`") and src.endswith("`") and len(src) > 2:
                expr = src[1:-1]
                try:
                    values = _flatten(eval(compile(expr, f"{name}:{line}", "eval"), dict(ns)))
                except Exception as e:          # a source that does not evaluate is a problem, reported with it
                    bad.append(f"{where}: `{expr}` does not evaluate: {type(e).__name__}: {e}")
                    continue
                figs = figures(said)
                for v in values:
                    if not quoted(v, figs):
                        bad.append(f"{where}: `{expr}` gives {v:.6g}, which the text before it does not quote "
                                   f"(it says: {said.strip()[-160:]!r})")
            elif NOTEBOOK_RE.fullmatch(src):
                problem = notebook_problem(where, src, said)
                if problem:
                    bad.append(problem)
            elif SCRIPT_RE.fullmatch(src):
                after = [s for s, _ in answers if s > start]
                block = text[next((s for s, _ in reversed(answers) if s <= start), 0):after[0] if after else None]
                scripts = re.findall(r"```python\n(.*?)```", block, re.S)
                if not scripts:
                    bad.append(f"{where}: `{src}`, but this answer holds no ```python block")
                for s in scripts:
                    try:
                        ast.parse(s)
                    except SyntaxError as e:
                        bad.append(f"{where}: the script does not parse: {e}")
            else:
                bad.append(f"{where}: unknown source `{src}` (an expression or a `python -m` command in "
                           f"backticks, notebook NN, cell M, `anchor`, or the script above/below)")
    return bad, cmds


def command_problems(cmds) -> list:
    dn = _docs_names()
    return dn.command_problems(cmds, dn.run_helps(cmds))


# --- the tests -------------------------------------------------------------------------------------------------------
def test_every_key_figure_from_a_run_names_a_source_that_gives_it():
    ns, bad, cmds = namespace(), [], []
    for path in KEYS:
        b, c = key_problems(path.name, path.read_text(encoding="utf-8"), ns)
        bad += b
        cmds += c
    bad += command_problems(cmds)
    assert not bad, "key figures whose source does not check out:\n" + "\n".join(bad)


def test_the_keys_use_the_convention():
    """Not a convention on paper only: the keys that quote runs carry markers of every kind."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in KEYS)
    kinds = [s for _, _, sources in markers(text) for s in sources]
    assert any(s.startswith("`python -m ") for s in kinds), "no key names a command"
    assert any(NOTEBOOK_RE.fullmatch(s) for s in kinds), "no key names a notebook cell"
    assert sum(1 for s in kinds if s.startswith("`") and not s.startswith("`python")) >= 10, "few expressions"
    assert (ROOT / "exercises" / "problem_sets" / "keys" / "12_accounting.md").exists()


def test_the_checker_catches_a_wrong_figure_a_bad_flag_a_moved_cell_and_an_unknown_source():
    cells = json.loads(next((ROOT / "notebooks").glob("03_*.ipynb")).read_text(encoding="utf-8"))["cells"]
    at = next(i for i, c in enumerate(cells) if c["cell_type"] == "code" and "fcfs_bound" in "".join(c["source"]))
    good = ("**Q1.** Llama-3-8B's K/V: 128 KiB a token (from: `get_model(\"llama-3-8b\").kv_bytes_per_token / 1024`)"
            ", and 26,674 blocks of 16 (from: `CostModel.from_spec(\"h100:llama-3-8b\").num_gpu_blocks(16, 0.9)`). "
            "Speed-up 2.80x at k = 4 (from: `round(expected_speedup(0.95, 4, 0.154), 2)`; "
            "`python -m minibatch.bench speculative --methods draft --ks 2,4`). "
            f"Gain 1.87x (from: notebook 03, cell {at}, `fcfs_bound`). Hits 36 / 60 (from: the script below).\n\n"
            "```python\nprint(36 / 60)\n```\n")
    bad, cmds = key_problems("good.md", good)
    assert not bad and not command_problems(cmds), bad
    wrong = (good.replace("128 KiB", "256 KiB").replace("26,674", "26,764").replace("2.80x", "2.8x")
             .replace("--ks 2,4", "--ks 2,4 --num-drafts 4").replace(f"cell {at},", f"cell {at - 1},")
             .replace("the script below", "the run I did").replace("print(36 / 60)", "print(36 / 60"))
    bad, cmds = key_problems("wrong.md", wrong)
    bad += command_problems(cmds)
    for expected in ["gives 128, which the text before it does not quote",
                     "gives 26674, which the text before it does not quote",
                     "flag `--num-drafts` is not in",
                     f"cell {at - 1} is not the code cell that holds `fcfs_bound` (`fcfs_bound` is in code cell(s) [{at}",
                     "unknown source `the run I did`"]:
        assert any(expected in b for b in bad), f"not reported: {expected}\n" + "\n".join(bad)
    assert not any("2.8" in b and "expected_speedup" in b for b in bad), "2.8 is 2.80 to its own rounding"
    off = good.replace("2.80x", "2.90x").replace("print(36 / 60)", "print(36 / 60")
    bad, _ = key_problems("off.md", off.replace("the script below", "the script above"))
    assert any("gives 2.8, which" in b for b in bad), bad
    assert any("this answer holds no ```python block" in b or "does not parse" in b for b in bad), bad
    bad, _ = key_problems("nan.md", "**Q1.** 3 (from: `undefined_name + 1`)")
    assert bad and "does not evaluate: NameError" in bad[0], bad


def test_figures_read_as_written():
    assert figures("26,674 blocks, 2.15x, 1.3e-3, Llama-3-8B at 4 ms") == [
        (26674.0, 0.5), (2.15, 0.005), (1.3e-3, 0.5e-4), (3.0, 0.5), (8.0, 0.5), (4.0, 0.5)]
    assert quoted(2.154, figures("2.15")) and not quoted(2.156, figures("2.15"))
    text = "**Q1.** First 1.5 (from: `1.5`). Then 2.5 and 3.5; 4.5 (from: `4.5`)"
    (s1, e1, _), (s2, _, _) = markers(text)
    assert clause(text, s1, 0).strip() == "First 1.5" and clause(text, s2, e1).strip() == "4.5"
    assert markers("a (from: `f(x); g(y)`; notebook 01, cell 2, `x`) b") == [(2, 48, ["`f(x); g(y)`",
                                                                                        "notebook 01, cell 2, `x`"])]
