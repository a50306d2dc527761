"""llguidance is optional: where it is missing, the engine serves every request that does not ask for a grammar,
and one that does gets a clear error naming the install line (as tests/no_triton/ does for Triton).

Run in a fresh Python whose `import llguidance` is blocked, as on a machine where it is not installed.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK = textwrap.dedent("""
    import sys

    class _NoLLGuidance:
        def find_spec(self, name, path=None, target=None):
            if name == "llguidance" or name.startswith("llguidance."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, _NoLLGuidance())
""")


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300)


def test_the_engine_runs_without_llguidance_and_a_structured_request_names_the_fix():
    r = run("""
        import torch
        from minibatch import LLM, SamplingParams
        from minibatch.model.model import GPT, GPTConfig
        torch.manual_seed(0)
        llm = LLM(GPT(GPTConfig("tiny", n_layer=1, n_head=2, n_embd=32, n_ctx=64)).eval(), block_size=4)
        out = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=4))
        print("plain", len(out[0].outputs[0].token_ids))
        taught = SamplingParams(temperature=0, max_tokens=4,
                                structured_outputs={"regex": "[a-c]+", "backend": "teaching"})
        print("teaching", bytes(llm.generate(["x"], taught)[0].outputs[0].token_ids).decode())
        assert "llguidance" not in sys.modules
        try:
            SamplingParams(structured_outputs={"json": {"type": "object"}})
        except ValueError as e:
            print("refused", type(e).__name__, e)
    """)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "plain 4"
    assert lines[1].startswith("teaching ") and set(lines[1].split()[1]) <= set("abc")
    assert lines[2].startswith("refused StructuredOutputsUnavailable") and "pip install llguidance" in lines[2]


def test_the_blocker_blocks():
    r = run("import llguidance")
    assert r.returncode != 0 and "blocked by the test" in r.stderr
