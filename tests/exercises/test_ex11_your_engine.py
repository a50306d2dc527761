"""Exercise 11, graded: your engine. Exercise 1's slot mapping, exercise 6's block allocator and exercise 7's
scheduler run the real engine together (``exercises.patch_engine``; in a student release the engine calls yours
anyway), on workloads where they meet: prefix-cache hits, chunked prefill and preemption in the same run.

There is no file to write for this part: it grades the three you wrote, together. The separate parts each run the
engine with stand-ins for the other two (exercise 6 with a one-request-at-a-time scheduler that never chunks or
preempts, exercise 7 on a toy pool with no prefix cache), so what only this part sees is where they meet:

* a prompt chunked over several steps registers its blocks in your prefix cache chunk by chunk, and a request
  admitted in a later step finds them (one admitted in the same step as the first cannot: a block is registered
  only after the step that computes it);
* a sequence your scheduler preempts gives its blocks back to your allocator, which keeps the computed ones cached;
  readmitted, it finds its own prompt and output there and resumes from them, its slots mapped into whatever
  blocks your allocator hands out by then;
* at the end every block is back: free, ref count 0, cached ones evictable, the allocator's invariants whole (they
  are checked after every step too).

The answer each request must give is the greedy text of generation without any cache
(``minibatch/sampling/reference.py``): no part of the engine, yours or the reference's, computes it.

Run the tests:  MINIBATCH_STUDENT=ex1,ex6,ex7 python -m pytest tests/exercises -m ex11
Grade the part:  python -m exercises.grade --parts ex11   (or your_engine)
"""
import pytest

import exercises
from minibatch import SamplingParams

pytestmark = pytest.mark.ex11

NEEDS = ("slot_mapping", "block_allocator", "scheduler")      # exercises 1, 6 and 7
HEADER = "import os\nimport sys\n\n# a header shared by several files\n"     # 57 bytes: 7 full blocks of 8


def _spec() -> str:
    """The parts of this one that are the student's (MINIBATCH_STUDENT), for patch_engine; in a student release the
    engine calls the held-out ones without a patch."""
    return ",".join(n for n in NEEDS if n in exercises.selected())


# Each workload: the engine's settings and waves of (prompt, max_tokens), a wave added to the engine before the
# step of that index. Small budgets chunk every prompt; small pools preempt.
WORKLOADS = {
    # one header, prompts sharing it arriving in three waves; the pool holds about two of them at a time
    "shared-header": dict(
        engine=dict(block_size=8, num_gpu_blocks=22, max_num_seqs=4, max_num_batched_tokens=16),
        waves={0: [(HEADER + "def main():\n", 20), (HEADER + "class Stack:\n", 16), ("for i in range(10):\n", 18)],
               5: [(HEADER + "def load(path", 18), (HEADER + "def main():\n", 20)],
               12: [("for i in range(10):\n    print(", 14), (HEADER + "x = 1\n", 16)],
               20: [(HEADER + "class Stack:\n    def push(self", 12)]}),
    # two families of prompts, a tighter pool and a budget of three blocks: the first two share two blocks but are
    # admitted in the same step (so the second misses); preempted requests come back through the cache
    "two-families": dict(
        engine=dict(block_size=8, num_gpu_blocks=16, max_num_seqs=3, max_num_batched_tokens=24),
        waves={0: [("class Node:\n    def", 22), ("class Node:\n    def __init__(self", 18),
                   ("def fib(n):\n    if n < 2:\n        return n\n", 22)],
               2: [("def fib(n):\n    if n < 2:\n        return 1\n", 20)],
               6: [("class Node:\n    def __init__(self, value", 16), ("def fib(n):\n    if n < 2:\n", 18)],
               14: [("class Node:\n    def __init__(self", 18)]}),
}

_RUNS: dict = {}


def run(name: str, model) -> dict:
    """The workload on the engine with your three parts (once per session: each test reads what it needs); an
    error of your code is raised again in every test that asks, so each fails on its own."""
    if name not in _RUNS:
        try:
            _RUNS[name] = _run(WORKLOADS[name], model)
        except Exception as e:                        # noqa: BLE001 -- the student's error, shown in each test
            _RUNS[name] = e
    got = _RUNS[name]
    if isinstance(got, Exception):
        raise got
    return got


def _run(workload: dict, model) -> dict:
    from minibatch import LLM
    from minibatch.model.tokenizer import encode
    from minibatch.trace import TraceRecorder
    with exercises.patch_engine(_spec()):
        llm = LLM(model, enable_prefix_caching=True, **workload["engine"])
        eng = llm.llm_engine
        rec, broken = TraceRecorder(), []

        def check(trace):                              # the allocator whole after every step
            try:
                eng.allocator.check_invariants(eng.scheduler.live_seq_ids())
            except AssertionError as e:
                broken.append(f"step {trace.step}: {e}")
        eng.add_hook(rec)
        eng.add_hook(check)
        waves, prompts, texts, step = workload["waves"], {}, {}, 0
        while step <= max(waves) or eng.has_unfinished_requests():
            for prompt, max_tokens in waves.get(step, []):
                rid = f"r{len(prompts)}"
                prompts[rid] = (encode(prompt), max_tokens)
                eng.add_request(rid, prompts[rid][0], SamplingParams(temperature=0, max_tokens=max_tokens))
            if eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        texts[o.request_id] = list(o.outputs[0].token_ids)
            step += 1
            assert step < 2000, "more than 2000 steps: the engine does not finish the workload"
        a = eng.allocator
        return {"prompts": prompts, "texts": texts, "traces": rec.traces, "broken": broken,
                "free": a.num_free_blocks, "num_blocks": a.num_blocks, "refs": list(a.ref_counts()),
                "cached": list(a.cached_block_ids()), "free_ids": list(a.free_block_ids()), "allocator": a,
                "live": [s for s in eng.scheduler.live_seq_ids()]}


_ORACLE: dict = {}


def no_cache_text(model, prompt_ids: list, max_tokens: int) -> list:
    """The prompt's greedy text from generation without any cache: no paged KV, no allocator, no scheduler.
    (Asked only once the engine has run, so a part that fails there costs no oracle time.)"""
    from minibatch.sampling.reference import generate
    key = (tuple(prompt_ids), max_tokens)
    if key not in _ORACLE:
        _ORACLE[key] = generate(model, list(prompt_ids), SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    return _ORACLE[key]


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_your_engine_generates_the_text_of_generation_without_a_cache(target_model, name):
    """Every request's greedy tokens equal generation without any cache, while prefixes hit, prompts are chunked
    and sequences are preempted in the same run."""
    from minibatch.model.tokenizer import decode
    r = run(name, target_model)
    assert sorted(r["texts"]) == sorted(r["prompts"]), f"finished {sorted(r['texts'])} of {sorted(r['prompts'])}"
    for rid, (ids, m) in r["prompts"].items():
        want = no_cache_text(target_model, ids, m)
        assert r["texts"][rid] == want, (f"{name}: request {rid} ({decode(ids)!r}) generated "
                                         f"{decode(r['texts'][rid])!r}; without a cache: {decode(want)!r}")
    traces = r["traces"]
    hits = traces[-1].prefix_cache_hits
    chunked = sum(1 for t in traces for s in t.scheduled if s.phase != "decode" and
                  s.num_computed_before + s.num_tokens < s.num_prompt_tokens + s.num_output_tokens)
    preempted = sum(len(t.preempted) for t in traces)
    assert hits >= 4 and chunked >= 4 and preempted >= 1, \
        f"{name} is meant to hit the prefix cache, chunk prompts and preempt: {hits} hits, {chunked} chunks, " \
        f"{preempted} preemptions"


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_every_block_comes_back_and_the_allocator_stays_whole(target_model, name):
    """After every step your allocator's invariants hold for the sequences your scheduler runs; at the end no
    sequence holds a block, every ref count is 0, and every block (the cached ones too) is free to be taken."""
    r = run(name, target_model)
    assert not r["broken"], "the allocator's invariants broke: " + "; ".join(r["broken"][:3])
    assert not r["live"], f"sequences still holding blocks after every request finished: {r['live']}"
    leaked = [b for b, c in enumerate(r["refs"]) if c]
    assert not leaked, f"blocks with a ref count after every request finished (leaked): {leaked}"
    assert r["free"] == r["num_blocks"], f"{r['num_blocks'] - r['free']} of {r['num_blocks']} blocks never came back"
    assert sorted(r["free_ids"]) == list(range(r["num_blocks"])), "a block is missing from the free queue"
    r["allocator"].check_invariants([])


def test_a_preempted_request_resumes_from_its_own_cached_blocks(target_model):
    """A sequence preempted by your scheduler keeps its computed blocks cached in your allocator: readmitted, it
    resumes from them, past every prefix it shares with another request (its own prompt and output, which nobody
    else holds), and its text is still right (the first test)."""
    r = run("shared-header", target_model)
    full = {rid: list(ids) + r["texts"].get(rid, []) for rid, (ids, _) in r["prompts"].items()}

    def shared(rid):                             # the longest prefix, in whole blocks, another request also has
        def lcp(a, b):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            return n
        return max(lcp(full[rid], full[o]) for o in full if o != rid) // 8 * 8

    resumed = [(t.step, s.request_id, s.num_computed_before, shared(s.request_id)) for t in r["traces"]
               for s in t.scheduled if s.phase == "resumed" and s.seq_id in t.admitted]
    assert resumed, "no preempted sequence was readmitted"
    assert any(before > other for _, _, before, other in resumed), \
        f"readmitted (step, request, tokens it resumed from, tokens it shares with another request): {resumed}: " \
        f"none resumed from its own blocks. Those it computed before the preemption stay in the prefix cache when " \
        f"freed (until a fresh block is needed), and the allocator finds them when the sequence starts again; " \
        f"they must not be computed again"


def test_a_prefix_is_found_only_after_the_step_that_computes_it(target_model):
    """Requests admitted in the same step share nothing yet (a block is registered after the step that computes
    it); a request admitted after the header's blocks were computed finds every one of them."""
    from minibatch.model.tokenizer import encode
    r = run("shared-header", target_model)
    first = {}
    for t in r["traces"]:
        for s in t.scheduled:
            if s.seq_id in t.admitted and s.request_id not in first:
                first[s.request_id] = (t.step, s.num_computed_before)
    header = len(encode(HEADER)) // 8 * 8
    later = {rid: first[rid][1] for rid in ("r1", "r3", "r4", "r6", "r7")}
    assert all(c >= header for c in later.values()), \
        f"requests admitted after the header's blocks were computed found {later} of its {header} tokens"
    pair = run("two-families", target_model)
    first = {}
    for t in pair["traces"]:
        for s in t.scheduled:
            if s.seq_id in t.admitted and s.request_id not in first:
                first[s.request_id] = (t.step, s.num_computed_before)
    assert first["r0"][0] == first["r1"][0] and first["r1"][1] == 0, \
        f"r1 shares two blocks with r0 but was admitted in the same step, before r0 computed them: it must miss " \
        f"(admitted at step, tokens found: {first['r0']}, {first['r1']})"
