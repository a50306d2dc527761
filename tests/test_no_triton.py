"""Every laptop (issue 29): what runs where Triton does not install (macOS, Windows), and `kernels` stays ours.

CI runs a short part of the suite with MINIBATCH_NO_TRITON=1 (tests/conftest.py blocks `import triton` there
and in every Python the tests start); the tests here hold either way, simulating what they need.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKER = ROOT / "tests" / "no_triton"


def python(code: str, cwd, *path, timeout=120) -> subprocess.CompletedProcess:
    """A fresh Python in ``cwd`` with exactly ``path`` in front of its sys.path (no inherited PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(map(str, path)))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def foreign(tmp_path):
    """A folder holding another package named `kernels` (as `pip install transformers` brings Hugging Face's)."""
    (tmp_path / "site" / "kernels").mkdir(parents=True)
    (tmp_path / "site" / "kernels" / "__init__.py").write_text("FOREIGN = True\n")
    return tmp_path / "site"


def test_a_foreign_kernels_earlier_on_the_path_does_not_shadow_the_repos(tmp_path, foreign):
    res = python("""
        import importlib.util
        print(importlib.util.find_spec("kernels").origin)      # before minibatch: the foreign one (the trap)
        import minibatch
        print(importlib.util.find_spec("kernels").origin)      # after: this repository's
        print(importlib.util.find_spec("kernels.store_kv").origin)    # its submodules too, through its __path__
    """, tmp_path, foreign, ROOT)
    assert res.returncode == 0, res.stderr
    before, after, sub = res.stdout.split()
    assert Path(before) == foreign / "kernels" / "__init__.py", "the simulation did not put a foreign kernels first"
    assert Path(after) == ROOT / "kernels" / "__init__.py"
    assert Path(sub) == ROOT / "kernels" / "store_kv.py"


def test_a_foreign_kernels_imported_before_minibatch_is_named_in_a_warning(tmp_path, foreign):
    res = python("import kernels, minibatch", tmp_path, foreign, ROOT)
    assert res.returncode == 0, res.stderr
    assert "foreign `kernels` package" in res.stderr and "import minibatch first" in res.stderr


def test_without_triton_the_engine_runs_and_the_triton_backend_says_why(tmp_path):
    res = python("""
        import sys
        from minibatch import LLM, SamplingParams
        from minibatch.model.model import GPT, GPTConfig
        model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_ctx=64))
        out = LLM(model, device="cpu").generate(["ab"], SamplingParams(temperature=0, max_tokens=3))
        print("generated", len(out[0].outputs[0].token_ids))
        try:
            LLM(model, device="cpu", attention_backend="triton").generate(["ab"], SamplingParams(max_tokens=2))
        except ImportError as e:
            print("ImportError:", e)
        assert "triton" not in sys.modules
    """, tmp_path, BLOCKER, ROOT)
    assert res.returncode == 0, res.stderr
    assert "generated 3" in res.stdout
    assert "ImportError: the 'triton' backend needs the kernels package and Triton" in res.stdout
    assert "blocked by MINIBATCH_NO_TRITON=1" in res.stdout


def test_the_grader_marks_ex9_needs_linux_and_triton_instead_of_0(monkeypatch):
    from exercises import BY_PART, grade
    monkeypatch.setitem(sys.modules, "triton", None)          # `import triton` raises ImportError
    ex9 = BY_PART["ex9"]
    runs = grade.grade([ex9])                                 # nothing to collect or run
    assert runs[0].not_graded.startswith("needs Linux + Triton")
    table, rep = grade.report(runs, 0.0)
    assert "needs Linux + Triton" in table and "0.0 / 20" not in table
    assert rep["score"] == 0 and rep["extra_data"]["max_score"] == 0 and rep["tests"] == []
    assert rep["extra_data"]["parts"]["ex9"]["not_graded"].startswith("needs Linux + Triton")
