"""The notebooks in notebooks/: stored clean, and every code cell runs headless.

Each notebook's code cells are executed in order, in one namespace, in a fresh
Python process started in notebooks/ (the working directory Jupyter gives them),
with matplotlib's Agg backend and, without CUDA, Triton's CPU interpreter. The
child imports this checkout's ``minibatch`` (PYTHONPATH is set to the repository
root), not whatever an editable install elsewhere points at. No
Jupyter kernel is needed: widget cells build their ipywidgets objects without a
front end, and ``display`` prints a repr. A failing cell shows up in the
traceback as ``<NAME.ipynb cell N>``.
"""
import ast
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"
NOTEBOOKS = ["01_model_and_generation.ipynb", "02_paged_kv_cache.ipynb", "03_continuous_batching.ipynb",
             "04_speculative_decoding.ipynb", "05_triton_kernels.ipynb", "06_speculation_without_a_second_model.ipynb",
             "07_token_trees.ipynb", "08_graduating_to_vllm.ipynb", "09_why_it_pays_on_a_gpu.ipynb",
             "10_past_one_device.ipynb", "11_structured_outputs.ipynb", "12_from_gpt2_to_llama.ipynb",
             "13_memory_hierarchy.ipynb", "14_fewer_bytes_per_token.ipynb"]
TIMEOUT_S = 300          # each takes ~5-15 s on a 2-core CPU; this only catches a hang

# Runs in the child process: argv[1] is the notebook's file name. In a student release the first cell switches
# on exercises.notebook's guard (a cell that needs an unfinished exercise is skipped), which Jupyter applies
# through IPython; here the runner applies it.
RUNNER = r"""
import ast, json, sys, time
nb = json.load(open(sys.argv[1], encoding="utf-8"))
ns = {"__name__": "__main__"}
for i, cell in enumerate(nb["cells"]):
    if cell["cell_type"] != "code":
        continue
    t = time.perf_counter()
    tree = ast.parse("".join(cell["source"]), f"<{sys.argv[1]} cell {i}>")
    guard = sys.modules.get("exercises.notebook")
    if guard is not None and guard.ACTIVE:
        tree = guard.guard(tree)
    exec(compile(tree, f"<{sys.argv[1]} cell {i}>", "exec"), ns)
    if "matplotlib.pyplot" in sys.modules:            # as if each cell's figures had been shown
        sys.modules["matplotlib.pyplot"].close("all")
    print(f"[cell {i}: {time.perf_counter() - t:.2f} s]", flush=True)
"""


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
        return True
    except ImportError:                   # macOS, Windows, or MINIBATCH_NO_TRITON=1 (tests/conftest.py)
        return False


def needs_triton(name) -> bool:
    """A notebook that imports the Triton kernels (05): without Triton it stops at once, saying why."""
    return any(re.search(r"^\s*import kernels|^\s*from kernels", c, re.M) for c in code_cells(load(name)))


def load(name):
    return json.loads((NB_DIR / name).read_text(encoding="utf-8"))


def code_cells(nb):
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def test_every_notebook_is_listed():
    assert sorted(p.name for p in NB_DIR.glob("*.ipynb")) == NOTEBOOKS
    readme = (NB_DIR / "README.md").read_text(encoding="utf-8")
    for name in NOTEBOOKS:
        assert name in readme, f"notebooks/README.md does not mention {name}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stored_clean(name):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(str(NB_DIR / name), as_version=4)
    nbformat.validate(nb)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.lstrip().startswith("# "), \
        f"{name}: the first cell must be a markdown title ('# ...')"
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        assert cell.outputs == [] and cell.execution_count is None, \
            f"{name} cell {i} has stored outputs: clear them before committing (diffs stay small)"
        magics = [line for line in cell.source.splitlines() if line.lstrip().startswith(("%", "!"))]
        assert not magics, f"{name} cell {i} uses IPython magics {magics}: the notebooks must run as plain Python"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_first_cell_sets_the_thread_count_and_prints_no_generator(name):
    """On a busy CPU, generate ran at 5.5 tok/s with default threads and 57.7 with one (issue 15): the first
    code cell sets it. And a bare ``torch.manual_seed(0)`` as a cell's last line prints <torch._C.Generator>."""
    cells = [c for c in code_cells(load(name)) if "exercises.notebook" not in c]   # a release's guard cell comes first
    first = ast.parse(cells[0])
    calls = [ast.unparse(n.func) for n in ast.walk(first) if isinstance(n, ast.Call)]
    assert "torch.set_num_threads" in calls, f"{name}: the first code cell must call torch.set_num_threads"
    for i, source in enumerate(code_cells(load(name))):
        body = ast.parse(source).body
        last = body[-1] if body else None
        assert not (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)
                    and ast.unparse(last.value.func) == "torch.manual_seed"), \
            f"{name} code cell {i} ends with torch.manual_seed(...): its Generator gets printed"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name):
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    # a tiny model gains nothing from intra-op threads, and on a busy 2-core machine they oversubscribe
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        proc = subprocess.run([sys.executable, "-c", RUNNER, name], cwd=NB_DIR, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")[-3000:]
        pytest.fail(f"{name} did not finish in {TIMEOUT_S} s; last output:\n{out}")
    if needs_triton(name) and not _has_triton():
        assert proc.returncode != 0 and "needs Triton, which installs on Linux only" in proc.stderr, \
            f"{name} needs Triton; without it, its first code cell must stop the notebook saying why:\n{proc.stderr[-3000:]}"
        # only the cells before the check may run (a release's guard cell comes first; the check raises)
        cells = json.loads((NB_DIR / name).read_text())["cells"]
        check = next(i for i, c in enumerate(cells) if c["cell_type"] == "code" and "import triton" in "".join(c["source"]))
        ran = [int(i) for i in re.findall(r"\[cell (\d+):", proc.stdout)]
        assert all(i < check for i in ran), f"{name} ran cells past the Triton check:\n{proc.stdout[-2000:]}"
        return
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
