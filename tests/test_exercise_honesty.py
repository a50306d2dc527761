"""The graded exercise tests are honest: stubs score nothing, known-wrong answers are caught, the reference passes.

Each variant is graded exactly as a student is: its own pytest session over
tests/exercises, with MINIBATCH_STUDENT and MINIBATCH_STUDENT_DIR pointing at a
temporary directory that holds a full set of student files.
  * the untouched stubs (MINIBATCH_STUDENT=all): every graded test fails;
  * the reference behind the student switch (thin files that call minibatch/): every test passes;
  * each mutant in exercises/mutants/<piece>_<bug>.py, in place of that piece's file,
    graded on its part only (-m exN -x): at least one test fails.
  * each mutant of the integration part (exercises/mutants/your_engine/<piece>_<bug>.py: a file of one piece
    it needs, the rest the reference) is graded on that part (-m ex11 -x): at least one test fails; one whose
    docstring says that its own part's tests pass it ("exercise N's own tests pass it") is graded on its part too,
    and must pass there: the integration part catches what the separate parts cannot.
A *wrapper* mutant (<piece>_wraps_<what>.py) answers its part by calling another implementation of it that this
repository has (a batched backend, the tree sampler, a kernel): right here, by design, so it is graded where it
must fail, in a built student release that cuts or reroutes that implementation (tests/test_release.py,
test_every_wrapper_mutant_fails_in_the_release); here every part must have one.
The sessions are forked from one process that imported torch once (exercises/_harness.py).
Also here: the switch itself (exercises.get / selected / patch_engine).
"""
import ast
import shutil
import sys
from pathlib import Path

import pytest

import exercises
from exercises import _harness, unwritten
from exercises.grade import INTEGRATIONS, unavailable

PKG = Path(exercises.__file__).resolve().parent
MUTANTS = sorted((PKG / "mutants").glob("*.py"))
WRAPPERS = [m for m in MUTANTS if "_wraps_" in m.stem]       # graded in a release (tests/test_release.py)
# The integration part's mutants: exercises/mutants/your_engine/<piece>_<bug>.py, one piece's file wrong.
ENGINE = INTEGRATIONS["ex11"]
ENGINE_MUTANTS = sorted((PKG / "mutants" / ENGINE.name_).glob("*.py"))
PARTS = sorted(exercises.BY_PART) + sorted(INTEGRATIONS)      # every graded part, the integration ones too


def own_tests_pass(path: Path) -> bool:
    """An integration mutant that claims its own part's tests pass it (its docstring's first line says so)."""
    return "own tests pass it" in (ast.get_docstring(ast.parse(path.read_text())) or "").split("\n\n")[0]
# A part without a wrapper mutant, and why: nothing in the release computes it but torch itself, which its graded
# tests take as the oracle (they cannot tell a Triton launch from ``x + y``).
NO_WRAPPER = {"triton_warmup": "the puzzles' only other implementation is torch (x + y, softmax, a @ b, table[idx])"}
COMMON = ["-q", "-p", "no:cacheprovider", str(_harness.TESTS)]


def mutant_piece(path: Path):
    hits = [p for p in exercises.PIECES.values() if path.stem.startswith(p.name + "_")]
    return max(hits, key=lambda p: len(p.name)) if hits else None


def untouched(p) -> bool:
    """The shipped stub: a function of it is still unwritten (the piece's function itself, for ex9 the kernel
    it launches, for ex6, ex7 and ex12 a method of the class)."""
    tree = ast.parse((PKG / f"{p.stem}.py").read_text())
    return any(isinstance(n, ast.FunctionDef) and unwritten(n) for n in ast.walk(tree))


def student_files(dest: Path, replace=None) -> Path:
    """A full set of student files (the package's ex*.py), with one piece's file replaced if asked."""
    dest.mkdir(parents=True)
    for p in exercises.PIECES.values():
        shutil.copy(PKG / f"{p.stem}.py", dest / f"{p.stem}.py")
    if replace is not None:
        piece, src = replace
        shutil.copy(src, dest / f"{piece.stem}.py")
    return dest


def shim_files(dest: Path) -> Path:
    """Student files that hand every call to the reference (and count it, by function name): the reference,
    behind the switch."""
    dest.mkdir(parents=True)
    for p in exercises.PIECES.values():
        if p.func[0].isupper():                     # a class (ex6, ex7, ex12): the reference's, counting instances
            body = (f"class {p.func}(exercises.reference({p.name!r})):\n    def __init__(self, *args, **kwargs):\n"
                    f"        CALLS.append({p.func!r})\n        super().__init__(*args, **kwargs)\n")
        else:                                       # every function of the piece (ex8 has three)
            body = "\n\n".join(f"def {f}(*args, **kwargs):\n    CALLS.append({f!r})\n"
                                f"    return exercises.reference({p.name + '.' + f!r})(*args, **kwargs)\n"
                                for f in p.functions)
        (dest / f"{p.stem}.py").write_text(f"import exercises\n\nCALLS = []\n\n\n{body}")
    return dest


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Run every variant once; {variant: (exit code, [TestResult], log text)}."""
    tmp = tmp_path_factory.mktemp("honesty")
    jobs, names = [], []

    def add(name, student, directory, extra):
        junit = tmp / f"{name}.xml"
        jobs.append(_harness.Job([*COMMON, *extra, f"--junitxml={junit}"],
                                 {"MINIBATCH_STUDENT": student, "MINIBATCH_STUDENT_DIR": str(directory)},
                                 str(tmp / f"{name}.log")))
        names.append((name, junit))

    events = tmp / "collect.jsonl"                    # what the grader's trusted collection sees
    jobs.append(_harness.Job([*COMMON, "--collect-only", "-p", "exercises._grade_plugin"],
                             {"MINIBATCH_STUDENT": None, "MINIBATCH_GRADE_EVENTS": str(events)},
                             str(tmp / "collect.log")))
    names.append(("collect", events))
    add("stubs", "all", student_files(tmp / "stubs"), [])
    add("reference", "all", shim_files(tmp / "reference"), [])
    for m in MUTANTS:
        p = mutant_piece(m)
        if p is not None and m not in WRAPPERS:
            add(m.stem, p.name, student_files(tmp / m.stem, (p, m)), ["-x", "-m", p.part])
    for m in ENGINE_MUTANTS:             # only the mutant's piece is the student's: the others are the reference
        p = mutant_piece(m)
        if p is not None:
            d = student_files(tmp / f"engine-{m.stem}", (p, m))
            add(f"engine-{m.stem}", p.name, d, ["-x", "-m", ENGINE.part])
            if own_tests_pass(m):
                add(f"own-{m.stem}", p.name, d, ["-m", p.part])
    rcs = _harness.run(jobs)
    out = {}
    for (name, junit), rc, job in zip(names, rcs, jobs):
        if name == "collect":
            from exercises.grade import read_events
            out[name] = (rc, [e for e in read_events(junit) if e.get("e") == "collected"], "")
            continue
        results = _harness.parse_junit(junit) if junit.exists() else []
        out[name] = (rc, results, Path(job.log).read_text(errors="replace"))
    return out


def test_every_piece_has_at_least_four_mutants():
    assert all(mutant_piece(m) for m in MUTANTS), \
        f"mutants must be named <piece>_<bug>.py: {[m.name for m in MUTANTS if not mutant_piece(m)]}"
    for p in exercises.PIECES.values():
        assert sum(mutant_piece(m) == p for m in MUTANTS) >= 4, f"{p.name}: fewer than 4 mutants"


@pytest.mark.parametrize("mutant", [m.stem for m in MUTANTS])
def test_mutant_is_a_working_wrong_answer(mutant):
    """A mutant must be caught for its bug, not for failing to load: it compiles, defines the piece's functions,
    and its docstring names its exercise."""
    path = PKG / "mutants" / f"{mutant}.py"
    p = mutant_piece(path)
    tree = ast.parse(path.read_text(), str(path))                       # a SyntaxError fails here
    for f in p.functions:
        assert any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == f for n in tree.body), \
            f"no {f} in {path}"
    doc = ast.get_docstring(tree) or ""
    assert doc.startswith(f"Mutant (exercise {p.part[2:]})"), f"{path.name}: docstring must name the bug: {doc!r}"


def test_every_graded_test_carries_its_parts_marker(graded):
    """The grader counts a part's tests by marker, this file by file name: the two must agree, one part each."""
    rc, collected, _ = graded["collect"]
    assert rc == 0 and collected, "the collection of tests/exercises failed"
    parts = collected[-1]["parts"]
    # parts this machine cannot grade (no Triton) collect nothing
    assert {p for p in parts.values()} == {p for p in PARTS if not unavailable(p)}, parts
    for nodeid, part in parts.items():
        assert f"/test_{part}_" in nodeid, f"{nodeid}: marker {part!r} (want exactly one, the file's part)"


@pytest.mark.parametrize("part", PARTS)
def test_untouched_stubs_fail_every_graded_test(graded, part):
    if unavailable(part):
        pytest.skip(f"{part} {unavailable(part)}")
    p = exercises.BY_PART.get(part)
    if part in INTEGRATIONS:                        # the stubs of the parts it needs
        stubs = [exercises.piece(n) for n in INTEGRATIONS[part].needs if untouched(exercises.piece(n))]
        if len(stubs) < len(INTEGRATIONS[part].needs):
            pytest.skip(f"a part {part} needs is no longer the shipped stub (work in progress?)")
    elif not untouched(p):
        pytest.skip(f"exercises/{p.stem}.py is no longer the shipped stub (work in progress?); "
                    f"this check runs on a clean checkout")
    rc, results, log = graded["stubs"]
    mine = [r for r in results if r.part == part]
    assert len(mine) >= 3, f"{part}: only {len(mine)} graded tests collected\n{log[-3000:]}"
    passed = [r.name for r in mine if r.outcome != "failed"]
    assert not passed, f"{part}: the stub does not fail {passed}"
    assert rc == 1


def test_reference_passes_every_graded_test(graded):
    rc, results, log = graded["reference"]
    # a part this machine cannot grade (no Triton) has its test file skipped at collection: nothing else may be
    bad = [(r.part, r.name, r.output[:500]) for r in results if r.outcome != "passed"
           and not (r.part == "" and any(f"test_{p}_" in r.name for p in PARTS if unavailable(p)))]
    assert rc == 0 and results and not bad, f"{bad}\n{log[-3000:]}"
    assert {r.part for r in results if r.part} == {p for p in PARTS if not unavailable(p)}
    assert len(results) == len(graded["stubs"][1]), "the stub and reference sessions collected different tests"


def test_every_part_has_a_wrapper_mutant():
    """Issue 36: a release gives nothing away, so every part has a mutant that calls the in-release alternative
    (tests/test_release.py grades each in a built release, where it must fail)."""
    for p in exercises.PIECES.values():
        mine = [m.name for m in WRAPPERS if mutant_piece(m) == p]
        assert bool(mine) != (p.name in NO_WRAPPER), \
            f"{p.name}: wrapper mutants {mine}; NO_WRAPPER says {NO_WRAPPER.get(p.name)!r}"


@pytest.mark.parametrize("mutant", [m.stem for m in MUTANTS if m not in WRAPPERS])
def test_mutant_fails_a_graded_test(graded, mutant):
    part = mutant_piece(PKG / "mutants" / f"{mutant}.py").part
    if unavailable(part):
        pytest.skip(f"{part} {unavailable(part)}")
    rc, results, log = graded[mutant]
    failed = [r for r in results if r.outcome == "failed" and r.part == part]
    assert rc == 1 and failed, f"{mutant} passed every {part} test it ran (exit {rc}):\n{log[-3000:]}"
    assert not any(e in r.output for r in failed for e in ("SyntaxError", "IndentationError", "ModuleNotFoundError")), \
        f"{mutant} failed to load, not for its bug:\n{failed[0].output[:2000]}"


def test_the_integration_part_has_mutants_and_one_only_it_catches():
    """ex11 grades exercises 1, 6 and 7 together: a mutant in each of their files, and at least one that the
    separate part's own tests pass (what the integration part adds)."""
    pieces = {mutant_piece(m) for m in ENGINE_MUTANTS}
    assert None not in pieces and {p.name for p in pieces} == set(ENGINE.needs), \
        f"exercises/mutants/{ENGINE.name_}/: want <piece>_<bug>.py for each of {ENGINE.needs}"
    assert any(own_tests_pass(m) for m in ENGINE_MUTANTS), "no ex11 mutant that its own part's tests pass"
    for m in ENGINE_MUTANTS:
        p = mutant_piece(m)
        doc = ast.get_docstring(ast.parse(m.read_text())) or ""
        assert doc.startswith(f"Mutant (exercise {ENGINE.part[2:]}, in exercise {p.part[2:]}'s file"), doc
        assert any(isinstance(n, ast.ClassDef if p.func[0].isupper() else ast.FunctionDef) and n.name == p.func
                   for n in ast.parse(m.read_text()).body), f"no {p.func} in {m}"


@pytest.mark.parametrize("mutant", [m.stem for m in ENGINE_MUTANTS])
def test_an_integration_mutant_fails_the_integration_part(graded, mutant):
    rc, results, log = graded[f"engine-{mutant}"]
    failed = [r for r in results if r.outcome == "failed" and r.part == ENGINE.part]
    assert rc == 1 and failed, f"{mutant} passed every {ENGINE.part} test it ran (exit {rc}):\n{log[-3000:]}"
    assert not any(e in r.output for r in failed for e in ("SyntaxError", "IndentationError", "ModuleNotFoundError",
                                                            "NotImplementedError")), \
        f"{mutant} failed to load (or ran a stub), not for its bug:\n{failed[0].output[:2000]}"
    path = PKG / "mutants" / ENGINE.name_ / f"{mutant}.py"
    if own_tests_pass(path):                        # and its own part's tests do pass it, as it says
        rc, results, log = graded[f"own-{mutant}"]
        part = mutant_piece(path).part
        assert rc == 0 and any(r.part == part for r in results), \
            f"{mutant} says {part}'s own tests pass it, but they do not (exit {rc}):\n{log[-3000:]}"


# -- the switch ------------------------------------------------------------------------------------------

def test_switch_selects_per_piece(monkeypatch):
    import minibatch.kv.kv_cache
    import minibatch.sampling.sampler
    monkeypatch.delenv("MINIBATCH_STUDENT_DIR", raising=False)
    monkeypatch.delenv("MINIBATCH_STUDENT", raising=False)
    assert exercises.get("slot_mapping") is minibatch.kv.kv_cache.slot_mapping
    monkeypatch.setenv("MINIBATCH_STUDENT", " ex1, top_k_top_p ")
    assert exercises.selected() == {"slot_mapping", "top_k_top_p"}
    assert exercises.get("slot_mapping").__module__.endswith("ex1_slot_mapping")
    assert exercises.get("ex3") is not minibatch.sampling.sampler.apply_top_k_top_p
    assert exercises.get("ngram") is exercises.reference("ngram")
    monkeypatch.setenv("MINIBATCH_STUDENT", "ALL")
    assert exercises.selected() == set(exercises.PIECES)
    monkeypatch.setenv("MINIBATCH_STUDENT", "slot_mapping,attention")
    with pytest.raises(ValueError, match="unknown exercise piece 'attention'.*paged_attention"):
        exercises.get("ngram")


def test_student_dir_missing_file_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIBATCH_STUDENT", "ngram")
    monkeypatch.setenv("MINIBATCH_STUDENT_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="ex5_ngram.py"):
        exercises.get("ngram")


def test_patch_engine_rebinds_every_call_site_and_undoes(monkeypatch, tmp_path):
    import minibatch.engine.engine as engine
    import minibatch.kv.metadata as metadata
    import minibatch.sampling.sampler as sampler
    import minibatch.engine.scheduler as scheduler
    import minibatch.kv.attention as attention
    import minibatch.kv.backends.loop as loop
    import minibatch.kv.block_allocator as block_allocator
    import minibatch.kv.kv_cache as kv_cache
    import minibatch.spec_decode.draft_model as draft_model
    import minibatch.spec_decode.ngram as ngram
    import minibatch.spec_decode.rejection_sampler as speculative
    import minibatch.kv.tree as tree
    import minibatch.kv.radix_cache as radix_cache
    import minibatch.kv.radix_allocator as radix_allocator
    sites = [(kv_cache, "slot_mapping"), (metadata, "_slot_mapping"), (loop, "paged_attention_loop"),
             (sampler, "apply_top_k_top_p"), (engine, "TOP_K_TOP_P"), (speculative, "rejection_sample"),
             (engine, "REJECTION_SAMPLE"), (block_allocator, "BlockAllocator"), (engine, "BlockAllocator"),
             (draft_model, "BlockAllocator"), (scheduler, "Scheduler"), (engine, "Scheduler"),
             (tree, "ancestor_mask"), (tree, "positions"), (tree, "greedy_path"), (radix_cache, "RadixCache"),
             (radix_allocator, "RadixCache"), (ngram, "ngram_propose")]
    before = [getattr(m, a) for m, a in sites]
    static = engine.StaticScheduler
    monkeypatch.setenv("MINIBATCH_STUDENT_DIR", str(shim_files(tmp_path / "s")))
    with exercises.patch_engine("all") as patch:
        now = [getattr(m, a) for m, a in sites]
        assert all(n is not b and n.__module__.startswith("_minibatch_student_") for n, b in zip(now, before))
        assert exercises.reference("ngram") is before[-1]     # the reference stays reachable
        # static batching runs over the student's scheduler: its rules, the student's _schedule_running
        assert engine.StaticScheduler is not static and issubclass(engine.StaticScheduler, engine.Scheduler)
        assert engine.StaticScheduler._fill is static._fill
        assert len(patch.changes) >= len(sites)
        # the engine's own entry points now reach the student's code: metadata -> slot mapping
        md = attention.AttentionMetadata.build([[5, 2], [7]], [3, 0], [3, 2], 4)    # kv/metadata.py's
        assert md.slot_mapping.tolist() == [23, 8, 9, 28, 29]
    assert [getattr(m, a) for m, a in sites] == before and engine.StaticScheduler is static


def test_patch_engine_runs_the_engine_on_the_students_code(monkeypatch, tmp_path):
    """A tiny random GPT, n-gram speculation, one greedy and one top-k/top-p request: same text, every piece called."""
    import torch
    from minibatch import LLM, SamplingParams
    from minibatch.model.model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig("tiny", n_layer=1, n_head=2, n_embd=32, n_ctx=64)).eval()
    prompts = ["abcabcabcabcab", "xyzxyzxy"]
    params = [SamplingParams(temperature=0, max_tokens=10),
              SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=3, max_tokens=10)]

    def generate():
        llm = LLM(model, block_size=4, attention_backend="loop",
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        static = LLM(model, block_size=4, scheduling="static", num_gpu_blocks=12)    # forks nothing: n = 1
        radix = LLM(model, block_size=4, prefix_cache="radix")                     # the radix tree (ex12)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params) + static.generate(prompts, params)
                + radix.generate(prompts, params)]

    want = generate()
    monkeypatch.setenv("MINIBATCH_STUDENT_DIR", str(shim_files(tmp_path / "s")))
    with exercises.patch_engine("all"):
        got = generate()
    assert got == want
    for name in exercises.PIECES:
        if name in ("paged_decode", "tree_mask", "triton_warmup"):  # decode steps and token trees: below; the
            continue                                                 # puzzles are not in the engine
        calls = sys.modules[exercises.student(name).__module__].CALLS
        assert calls, f"the engine never called the student's {name}"


def test_patch_engine_runs_tree_speculation_on_the_students_functions(monkeypatch, tmp_path, target_model):
    """ex8: EAGLE-2's dynamic trees verified on the student's mask, positions and accepted path (each called, from
    the metadata, the head's passes and the verify): the same greedy text; undo puts the reference back."""
    from minibatch import LLM, SamplingParams
    from minibatch.kv import tree
    spec = {"method": "eagle", "tree": "dynamic", "num_draft_tokens": 6, "depth": 3, "topk": 2}

    def generate():
        llm = LLM(target_model, speculative_config=spec)
        return [o.outputs[0].token_ids for o in llm.generate(["def main():\n    ", "class Stack:"],
                                                             SamplingParams(temperature=0, max_tokens=12))]

    want = generate()
    before = tree.ancestor_mask, tree.positions, tree.greedy_path
    monkeypatch.setenv("MINIBATCH_STUDENT_DIR", str(shim_files(tmp_path / "s")))
    with exercises.patch_engine("tree_mask"):
        assert tree.greedy_path is exercises.student("tree_mask.greedy_path") is not before[2]
        assert exercises.reference("tree_mask.positions") is before[1]      # the reference stays reachable
        got = generate()
    assert (tree.ancestor_mask, tree.positions, tree.greedy_path) == before
    assert got == want
    calls = exercises.student("tree_mask").__globals__["CALLS"]
    assert {"ancestor_mask", "positions", "greedy_path"} <= set(calls), f"the engine called only {set(calls)}"


def test_a_piece_of_several_functions_names_each(monkeypatch):
    from minibatch.kv import tree
    monkeypatch.delenv("MINIBATCH_STUDENT", raising=False)
    assert exercises.get("tree_mask") is tree.ancestor_mask
    assert exercises.get("ex8.greedy_path") is exercises.reference("tree_mask.greedy_path") is tree.greedy_path
    with pytest.raises(ValueError, match="has no function 'depths'.*tree_mask.positions"):
        exercises.get("tree_mask.depths")
    monkeypatch.setenv("MINIBATCH_STUDENT", "ex8")
    assert exercises.get("tree_mask.positions").__module__.endswith("ex8_tree_mask")


@pytest.mark.interpreter
def test_patch_engine_sends_decode_steps_to_the_students_kernel(monkeypatch, tmp_path):
    """ex9: on the "triton" backend, decode-only steps run the student's paged decode kernel; the rest the reference."""
    import torch
    import kernels
    from minibatch import LLM, SamplingParams
    from minibatch.model.model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig("tiny", n_layer=1, n_head=2, n_embd=32, n_ctx=64)).eval()

    def generate():
        llm = LLM(model, block_size=4, attention_backend="triton")
        return [o.outputs[0].token_ids for o in llm.generate(["abcab", "xyz"], SamplingParams(temperature=0,
                                                                                              max_tokens=4))]

    want = generate()
    general = kernels.paged_attention
    monkeypatch.setenv("MINIBATCH_STUDENT_DIR", str(shim_files(tmp_path / "s")))
    with exercises.patch_engine("paged_decode"):
        assert kernels.paged_attention is not general and kernels.paged_attention.student is kernels.paged_decode
        got = generate()
    assert kernels.paged_attention is general
    assert got == want
    assert exercises.student("paged_decode").__globals__["CALLS"], "no decode step reached the student's kernel"


# -- the engine's other paths through a piece (what a release's fast paths and kernels compute with) -------------

def _tree_attention_helpers():
    """tests/test_tree_attention.py's step builder and oracle (one file of them for the suite)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_tree_attention_helpers",
                                                  Path(__file__).resolve().parent / "test_tree_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("shape", ["chain", "bushy", "random64"])
def test_attention_through_computes_trees_and_chunks_with_the_causal_loop_only(monkeypatch, shape):
    """ex2 in a release: "batched", "cpu" and the kernels compute through the student's causal function. A step
    with a prefill, a chunk, decodes and two token trees gives the oracle's answer, the loop never sees tree_bits,
    and it is the only attention that runs."""
    import torch
    from minibatch.kv import backends
    h = _tree_attention_helpers()
    md, kc, vc, q, K, V, parents = h.make_step(h.mixed(shape), 4, 2, 16, 8, seed=3)
    calls, loop = [], backends.loop.paged_attention_loop

    def causal_only(*args, **kwargs):
        calls.append(sorted(kwargs))
        return loop(*args, **kwargs)
    monkeypatch.setattr(backends.loop, "paged_attention_loop", causal_only)
    monkeypatch.setattr(backends.batched, "_batched", None)             # no other attention may run
    out = exercises.attention_through(q, kc, vc, md.block_tables, md.seq_lens, md.query_start_loc, 0.25,
                                      tree_bits=md.tree_bits, who="paged_attention_batched")
    torch.testing.assert_close(out.double(), h.oracle(md, q, K, V, parents, 0.25), atol=1e-5, rtol=1e-5)
    assert calls == [[]]
    with pytest.raises(ValueError, match="paged_attention_batched"):     # ``who``: the public function's checks
        exercises.attention_through(q, kc, vc, md.block_tables, md.seq_lens * 0, md.query_start_loc, 0.25,
                                    who="paged_attention_batched")


@pytest.mark.interpreter
def test_attention_through_decode_runs_a_general_step_on_the_decode_kernel():
    """ex9 in a release: the general kernel's launcher launches the decode kernel, one decode per query row."""
    import torch
    h = _tree_attention_helpers()
    md, kc, vc, q, K, V, parents = h.make_step(h.mixed("bushy", c=5), 4, 2, 16, 8, seed=4)
    out = torch.full_like(q, float("nan"))
    got = exercises.attention_through_decode(q, kc, vc, md.block_tables, md.seq_lens, md.query_start_loc, 0.25, out,
                                             tree_bits=md.tree_bits)
    assert got is out
    torch.testing.assert_close(out.double(), h.oracle(md, q, K, V, parents, 0.25), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("with_q", [False, True])
def test_tree_rejection_through_has_the_tree_rules_distribution(with_q):
    """ex4 in a release: a token tree verified child by child through the chain sampler draws (path, tokens) from
    the same distribution as the tree rule itself."""
    import collections
    import torch
    from minibatch.spec_decode.rejection_sampler import tree_rejection_sample
    g = torch.Generator().manual_seed(0)
    parents, tokens = [-1, 0, 0, 0, 1, 1, 4], [0, 1, 2, 1, 3, 0, 2]        # a repeated token among siblings too
    p = torch.softmax(torch.randn(7, 4, generator=g) * 1.5, -1).double()
    q = torch.softmax(torch.randn(7, 4, generator=g), -1).double() if with_q else None
    n = 3000
    counts = []
    for fn in (tree_rejection_sample, exercises.tree_rejection_through):
        gen = torch.Generator().manual_seed(1)
        counts.append(collections.Counter(tuple(map(tuple, fn(parents, tokens, p, q, gen))) for _ in range(n)))
    for key in set(counts[0]) | set(counts[1]):
        a, b = counts[0][key] / n, counts[1][key] / n
        assert abs(a - b) < 4 * ((a + b) / 2 * (1 - (a + b) / 2) * 2 / n) ** 0.5 + 2 / n, (key, a, b)


def test_a_student_function_that_calls_back_through_the_engine_is_a_clear_error(monkeypatch):
    """A student's function that asks an engine path for its answer, where that path computes through the same
    function (a release's stand-in, routed fast path or kernel), stops with a message, not a RecursionError."""
    calls = []

    def students(*args):
        calls.append(args)
        return exercises.call_student("ngram", *args)       # what a routed engine path does with it

    monkeypatch.setattr(exercises, "_checked_student", lambda name: students)
    with pytest.raises(RuntimeError, match="calls into the engine .* for its answer"):
        exercises.call_student("ngram", [1, 2, 1], 2)
    assert len(calls) == 1
    assert not exercises._running()                         # the guard is left clean for the next call
