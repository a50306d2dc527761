"""Every notebook is a lesson in one form (issue 36), checked without running a cell.

* cell 1, right after the title, is the objectives cell: ``**Learning objectives.** After this notebook you can:``,
  at least two bullets, then a paragraph ``**Prerequisites.** ...``;
* two to five ``**Predict NN.k.**`` prompts, each opening its own markdown cell just before the code cell whose
  output answers it, numbered 1, 2, ... with the notebook's number; an ``**Explain NN.k.**`` prompt (its own cell)
  follows the Predict of the same label; no prompt in any other form (``**Predict:**`` inside a paragraph);
* one ``**Change this and see.**`` cell, followed by a code cell marked ``# change this`` (or ``these``);
* every label has a model answer under the same label (``### Predict NN.k``) in the instructor-only file
  ``exercises/problem_sets/keys/notebooks/<notebook>.md``, none is orphaned, and each answer names the code cell
  (``cell N``) whose output shows its figure. That folder lies under a prefix of ``exercises.release.INSTRUCTOR_ONLY``,
  so a student release leaves it out (and there the answer checks skip).
"""
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"
ANSWERS = ROOT / "exercises" / "problem_sets" / "keys" / "notebooks"
NOTEBOOKS = sorted(p.name for p in NB_DIR.glob("*.ipynb"))

OBJECTIVES = "**Learning objectives.** After this notebook you can:"
PREREQUISITES = "**Prerequisites.** "
CHANGE = "**Change this and see.**"
LABEL = re.compile(r"\*\*(Predict|Explain) (\d{2})\.(\d+)\.\*\*")
ANY_PROMPT = re.compile(r"\*\*(Predict|Explain)\b")
OTHER_FORMS = re.compile(r"You will learn|Learning objectives|\*\*Prerequisites|\*\*Before this|\*\*Change this")
ANSWER = re.compile(r"^### (Predict|Explain) (\d{2})\.(\d+)[ \t]*$", re.M)
CITED = re.compile(r"\b[Cc]ell (\d+)\b")
CHANGE_MARK = re.compile(r"#\s*change th(is|ese)\b")


def _text(cell) -> str:
    return "".join(cell["source"])


def _cells(nb) -> list:
    """The cells, less a student release's guard cell (exercises.notebook), which comes first there."""
    return [c for c in nb["cells"] if not (c["cell_type"] == "code" and "exercises.notebook" in _text(c))]


def lesson_problems(nb: dict, number: int) -> tuple[list[str], dict[str, int]]:
    """What keeps a notebook (an nbformat dict) from being a lesson in the one form, as sentences ([] when
    nothing), and its prompt labels ("Predict 02.1" -> the index of the cell that asks it)."""
    cells, problems, labels, predicts = _cells(nb), [], {}, 0
    obj = _text(cells[1]) if len(cells) > 1 and cells[1]["cell_type"] == "markdown" else ""
    if not obj.startswith(OBJECTIVES):
        problems.append(f"cell 1 is not the objectives cell: it must start {OBJECTIVES!r}")
    else:
        if len(re.findall(r"^\* ", obj, re.M)) < 2:
            problems.append("the objectives need at least two bullets ('* ...')")
        if "\n" + PREREQUISITES not in obj:
            problems.append(f"cell 1 gives no prerequisites: a paragraph starting {PREREQUISITES!r}")
    for i, cell in enumerate(cells):
        text = _text(cell)
        if cell["cell_type"] != "markdown":
            continue
        scan = text.replace(OBJECTIVES, "", 1).replace("\n" + PREREQUISITES, "\n", 1) if i == 1 else text
        stray = OTHER_FORMS.findall(scan[len(CHANGE):] if scan.startswith(CHANGE) else scan)
        if stray:
            problems.append(f"cell {i}: objectives, prerequisites or a change-this cell in another form: {stray}")
        for m in ANY_PROMPT.finditer(text):
            label = LABEL.match(text, m.start())
            if m.start() != 0 or label is None:
                problems.append(f"cell {i}: a prompt must open its own markdown cell as '**Predict NN.k.**' or "
                                f"'**Explain NN.k.**': {text[m.start():m.start() + 40]!r}")
                continue
            kind, nn, k = label.group(1), int(label.group(2)), int(label.group(3))
            name = f"{kind} {nn:02d}.{k}"
            if nn != number:
                problems.append(f"cell {i}: {name} is numbered for notebook {nn:02d}, not {number:02d}")
            if name in labels:
                problems.append(f"cell {i}: {name} twice (cells {labels[name]} and {i})")
            labels[name] = i
            if kind == "Predict":
                predicts += 1
                if k != predicts:
                    problems.append(f"cell {i}: {name} should be Predict {number:02d}.{predicts} (1, 2, ... in order)")
                if i + 1 >= len(cells) or cells[i + 1]["cell_type"] != "code":
                    problems.append(f"cell {i}: {name} must come just before the code cell whose output answers it")
            elif f"Predict {nn:02d}.{k}" not in labels:
                problems.append(f"cell {i}: {name} has no Predict {nn:02d}.{k} before it")
    if not 2 <= predicts <= 5:
        problems.append(f"{predicts} Predict prompts: a lesson has 2 to 5")
    changes = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown" and _text(c).startswith(CHANGE)]
    if len(changes) != 1:
        problems.append(f"{len(changes)} cells start {CHANGE!r}: a lesson has one")
    for i in changes:
        after = cells[i + 1] if i + 1 < len(cells) else None
        if after is None or after["cell_type"] != "code" or not CHANGE_MARK.search(_text(after)):
            problems.append(f"cell {i}: the change-this cell must be followed by a code cell marked '# change this' (or these)")
    return problems, labels


def answer_problems(nb: dict, labels: dict[str, int], answers: str) -> list[str]:
    """What is wrong with a notebook's answers file (its text) against the notebook's prompt labels."""
    cells, problems = _cells(nb), []
    heads = list(ANSWER.finditer(answers))
    found = [f"{m.group(1)} {m.group(2)}.{m.group(3)}" for m in heads]
    problems += [f"{name}: no answer ('### {name}')" for name in labels if name not in found]
    problems += [f"answer '### {name}' has no prompt of that label in the notebook" for name in found
                 if name not in labels]
    problems += [f"answer '### {name}' given twice" for name in sorted(set(found)) if found.count(name) > 1]
    for m, nxt in zip(heads, heads[1:] + [None]):
        body = answers[m.end():nxt.start() if nxt else len(answers)]
        name = f"{m.group(1)} {m.group(2)}.{m.group(3)}"
        if len(body.split()) < 10:
            problems.append(f"answer '### {name}' is empty or a stub")
        cited = [int(n) for n in CITED.findall(body)]
        if not cited:
            problems.append(f"answer '### {name}' names no cell ('cell N') whose output shows its figure")
        problems += [f"answer '### {name}' cites cell {n}, which is not a code cell of the notebook" for n in cited
                     if n >= len(cells) or cells[n]["cell_type"] != "code"]
    return problems


def _load(name):
    return json.loads((NB_DIR / name).read_text(encoding="utf-8"))


def _number(name) -> int:
    return int(name[:2])


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_notebook_is_a_lesson(name):
    problems, _ = lesson_problems(_load(name), _number(name))
    assert not problems, f"notebooks/{name}:\n" + "\n".join(problems)


def _answers_or_skip():
    if not ANSWERS.is_dir():
        pytest.skip("no exercises/problem_sets/keys/notebooks/ (a student release leaves the model answers out)")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_prompt_has_its_model_answer(name):
    _answers_or_skip()
    path = ANSWERS / (pathlib.Path(name).stem + ".md")
    assert path.exists(), f"no model answers for {name}: write {path.relative_to(ROOT)}"
    nb = _load(name)
    _, labels = lesson_problems(nb, _number(name))
    problems = answer_problems(nb, labels, path.read_text(encoding="utf-8"))
    assert not problems, f"{path.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_model_answers_are_instructor_only():
    _answers_or_skip()
    from exercises.release import INSTRUCTOR_ONLY
    where = ANSWERS.relative_to(ROOT).as_posix() + "/"
    assert where.startswith(INSTRUCTOR_ONLY), f"{where} is not under a prefix of exercises.release.INSTRUCTOR_ONLY"
    orphans = sorted(p.name for p in ANSWERS.glob("*.md") if p.stem + ".ipynb" not in NOTEBOOKS)
    assert not orphans, f"answers files with no notebook: {orphans}"


# ---- the checkers can fail -------------------------------------------------------------------------------------

def _nb(*specs):
    return {"cells": [{"cell_type": kind, "metadata": {}, "source": [text]} for kind, text in specs]}


def _good():
    return [("markdown", "# 99 · A lesson"),
            ("markdown", f"{OBJECTIVES}\n\n* do one thing;\n* do another.\n\n{PREREQUISITES}Notebook 01."),
            ("code", "import torch"),
            ("markdown", "**Predict 99.1.** How many?"), ("code", "print(3)"),
            ("markdown", "**Explain 99.1.** Why?"),
            ("markdown", "**Predict 99.2.** Which?"), ("code", "print(4)"),
            ("markdown", f"{CHANGE} Vary x."), ("code", "x = 1      # change this: 1..3\nprint(x)")]


GOOD_ANSWERS = """# answers
### Predict 99.1
Three, because the cell prints it: cell 4 prints 3 and nothing else at all.
### Explain 99.1
Because three is what the code prints; cell 4 shows it, as asked, on one line.
### Predict 99.2
Four: cell 7 prints 4, which is the answer the prompt asks for, and so on.
"""


def test_the_checkers_pass_a_lesson():
    nb = _nb(*_good())
    problems, labels = lesson_problems(nb, 99)
    assert problems == [] and labels == {"Predict 99.1": 3, "Explain 99.1": 5, "Predict 99.2": 6}
    assert answer_problems(nb, labels, GOOD_ANSWERS) == []


@pytest.mark.parametrize("change, expected", [
    (lambda c: c.__setitem__(3, ("markdown", "**Predict.** How many?")), "must open its own markdown cell"),
    (lambda c: c.__setitem__(5, ("markdown", "The answer. **Predict:** how many?")), "must open its own"),
    (lambda c: c.__setitem__(3, ("markdown", "**Predict 98.1.** How many?")), "numbered for notebook 98"),
    (lambda c: c.__setitem__(6, ("markdown", "**Predict 99.3.** Which?")), "should be Predict 99.2"),
    (lambda c: c.__setitem__(5, ("markdown", "**Explain 99.2.** Why?")), "has no Predict 99.2 before it"),
    (lambda c: c.insert(4, ("markdown", "A note.")), "just before the code cell"),
    (lambda c: c.__delitem__(slice(6, 8)), "1 Predict prompts"),
    (lambda c: c.__setitem__(1, ("markdown", "**You will learn** things.\n\n**Before this:** 01.")),
     "not the objectives cell"),
    (lambda c: c.__setitem__(1, ("markdown", f"{OBJECTIVES}\n\n* one;\n* two.")), "gives no prerequisites"),
    (lambda c: c.__setitem__(1, ("markdown", f"{OBJECTIVES}\n\n* one.\n\n{PREREQUISITES}01.")), "two bullets"),
    (lambda c: c.__delitem__(slice(8, 10)), f"0 cells start {CHANGE!r}"),
    (lambda c: c.__setitem__(8, ("markdown", "**Change this:** vary x.")), "in another form"),
    (lambda c: c.__setitem__(9, ("code", "x = 1\nprint(x)")), "marked '# change this'"),
])
def test_the_lesson_checker_fails_a_notebook_out_of_form(change, expected):
    cells = _good()
    change(cells)
    problems, _ = lesson_problems(_nb(*cells), 99)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("answers, expected", [
    (GOOD_ANSWERS.split("### Predict 99.2")[0], "Predict 99.2: no answer"),
    (GOOD_ANSWERS + "### Explain 99.2\nAn orphan: no prompt asks it, though cell 7 prints a figure for it.\n",
     "'### Explain 99.2' has no prompt"),
    (GOOD_ANSWERS + "### Predict 99.1\nTwice over, the same label again; cell 4 prints 3, as it always does.\n",
     "given twice"),
    (GOOD_ANSWERS.replace("cell 7 prints 4", "the run prints 4"), "names no cell"),
    (GOOD_ANSWERS.replace("cell 7 prints 4", "cell 6 prints 4"), "cites cell 6, which is not a code cell"),
    (GOOD_ANSWERS.replace("Three, because the cell prints it: cell 4 prints 3 and nothing else at all.", "Three."),
     "empty or a stub"),
])
def test_the_answer_checker_fails_a_wrong_answers_file(answers, expected):
    nb = _nb(*_good())
    _, labels = lesson_problems(nb, 99)
    problems = answer_problems(nb, labels, answers)
    assert any(expected in p for p in problems), problems
