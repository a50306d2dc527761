"""The house is a stack: every import in minibatch/ and kernels/ points down the order written in the README.

A student reads the engine room by room, from the model up to the drivers. That only works while each room
uses rooms below it and none above, so this test parses every module (imports at module level *and* inside
functions: moving an import into a function hides a circle, it does not remove it; only an import under
``if TYPE_CHECKING:``, for annotations, is left out) and fails on any import that climbs the stack, naming the
file and the line, and on any circle between modules, even inside one room.

Where a lower room needs something from above, pass it in (the engine builds the proposer; the runner hands
the sampler in), or move the driver up (benchmarks' ``main()``s live in ``bench/``).

A room's own command line (``minibatch/perf/__main__.py``: ``python -m minibatch.perf``) is that room's, and
points down like the rest of it: were it a room of its own at the top, ``perf/__main__.py`` importing
``bench`` would hide the circle bench -> engine -> perf -> bench inside one package (issue 47, item 8). Only
``python -m minibatch`` itself (``minibatch/__main__.py``) and the package's public names stand above all.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Bottom to top; a room may import itself and the rooms before it. Keep README.md's Layout picture in step.
STACK = [
    "kernels",       # Triton: store K/V by slot, paged attention (kernels/)
    "model",         # GPT-2 over a flat batch, tokenizer, weights, training
    "kv",            # block allocator, KV cache tensors, attention metadata and backends, the token tree's shape
    "sampling",      # SamplingParams, the sampler, logits processors, logprobs, structured outputs, the oracles
    "spec_decode",   # proposers, their config, the rejection sampler
    "trace",         # StepTrace: what one step did, as plain data
    "stats",         # every figure of a run, from the traces
    "perf",          # the simulated clock: hardware and model profiles, the roofline cost model
    "distributed",   # process groups, tensor-parallel layers and workers, the KV transfer
    "engine",        # scheduler, model runner, CUDA graphs, the step loop
    "disagg",        # disaggregated prefill/decode: two engines and a router
    "llm",           # the offline LLM (vLLM's entry point)
    "viz",           # renderers of the traces
    "serve",         # the OpenAI-compatible server
    "export",        # the weights as a Hugging Face directory
    "slides",        # reveal.js decks of the notebooks
    "bench",         # workloads, benchmarks, demos, calibration: they drive engines
    "commands",      # `python -m minibatch` (minibatch/__main__.py) and the package's public names
]
HEIGHT = {room: i for i, room in enumerate(STACK)}

# (importing module, imported module) -> why this one climbs. At most two, each with its reason.
EXCEPTIONS: dict = {}


def modules() -> dict:
    """Dotted name -> path, for every module of minibatch/ and kernels/."""
    out = {}
    for base in ("minibatch", "kernels"):
        for p in sorted((ROOT / base).rglob("*.py")):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def room(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "kernels":
        return "kernels"
    if module in ("minibatch", "minibatch.__main__"):
        return "commands"
    return parts[1]                     # minibatch.X.__main__ too: `python -m minibatch.X` is room X's command


def _type_checking_nodes(tree: ast.AST) -> set:
    skip = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            skip |= {id(c) for c in ast.walk(n)}
    return skip


def imports(module: str, path: pathlib.Path, known: dict) -> list:
    """[(line, imported module)] of one module: every import statement wherever it stands, and
    ``importlib.import_module("minibatch....")`` with a literal (or an f-string's literal prefix)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        names = []
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:                                   # relative: resolve against the package
                up = package.split(".")[: len(package.split(".")) - (n.level - 1)]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in n.names] + [base]
        elif isinstance(n, ast.Call) and ast.unparse(n.func).endswith("import_module") and n.args:
            arg = n.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names = [arg.value]
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                names = [str(arg.values[0].value).rstrip(".")]
        for t in names:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != module and not module.startswith(t + ".") and t != "minibatch":
                found.append((n.lineno, t))
    return found


MODULES = modules()
EDGES = {m: imports(m, p, MODULES) for m, p in MODULES.items()}


def test_every_room_has_its_place_in_the_stack():
    unplaced = sorted({room(m) for m in MODULES} - set(HEIGHT))
    assert not unplaced, (f"rooms not in the stack: {unplaced}. A new room enters at its height: add it to STACK "
                          f"here and to the picture in README.md's Layout")


def test_every_import_points_down_the_stack():
    climbs = []
    for m, found in EDGES.items():
        for line, t in found:
            a, b = room(m), room(t)
            if HEIGHT[b] > HEIGHT[a] and (m, t) not in EXCEPTIONS:
                path = MODULES[m].relative_to(ROOT)
                climbs.append(f"{path}:{line} imports {t}: room {a!r} sits below {b!r} in the stack")
    assert not climbs, ("imports that point up the stack (README.md, Layout); pass what the lower room needs in, "
                        "or move the driver up:\n  " + "\n  ".join(sorted(set(climbs))))


def test_exceptions_are_few_and_each_has_its_reason():
    assert len(EXCEPTIONS) <= 2
    for (a, b), why in EXCEPTIONS.items():
        assert a in MODULES and b in MODULES and isinstance(why, str) and len(why) > 20, (a, b, why)


def _circles(edges: dict) -> list:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = counter[0]; counter[0] += 1
        stack.append(start); on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1
                    stack.append(w); on.add(w)
                    work.append((w, iter(edges.get(w, ()))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop(); on.discard(w); comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_module_imports_itself_back():
    edges = {m: sorted({t for _, t in found}) for m, found in EDGES.items()}
    circles = _circles(edges)
    assert not circles, "import circles between modules (imports inside functions count):\n  " + "\n  ".join(
        " <-> ".join(c) for c in circles)


@pytest.mark.parametrize("source, climbs", [
    ("from minibatch.engine.engine import LLMEngine\n", True),                       # module level
    ("def f():\n    from minibatch.llm import LLM\n", True),                           # hidden in a function
    ("import importlib\nimportlib.import_module('minibatch.serve.app')\n", True),      # by name
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from minibatch.engine.engine import LLMEngine\n", False),
    ("from minibatch.model.model import GPT\n", False),                               # down
])
def test_the_parser_sees_every_kind_of_import(tmp_path, source, climbs):
    """The checks above are only as good as ``imports``: a kv module with each kind of import."""
    p = tmp_path / "x.py"
    p.write_text(source)
    found = imports("minibatch.kv.x", p, MODULES)
    up = [t for _, t in found if HEIGHT[room(t)] > HEIGHT["kv"]]
    assert bool(up) == climbs, found


def test_a_rooms_command_line_is_held_to_its_room(tmp_path):
    """``python -m minibatch.perf`` is perf's: reaching up to bench from it is a climb (the circle bench ->
    engine -> perf -> bench); ``python -m minibatch`` and ``python -m minibatch.bench`` may run anything below."""
    assert (room("minibatch.perf.__main__"), room("minibatch.bench.__main__"), room("minibatch.__main__")) == \
        ("perf", "bench", "commands")
    p = tmp_path / "__main__.py"
    p.write_text("def main():\n    from minibatch.bench.calibrate import main as run\n")
    found = imports("minibatch.perf.__main__", p, MODULES)
    assert {t for _, t in found if HEIGHT[room(t)] > HEIGHT["perf"]} == {"minibatch.bench.calibrate"}


def test_the_circle_finder_finds_circles():
    assert _circles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert _circles({"a": ["b"], "b": []}) == []
