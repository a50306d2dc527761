"""The scheduler on its own, through schedule() and update_from_output() with a model-free runner output;
then its invariants over random workloads with a real (tiny) model."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from minibatch import LLM, SamplingParams
from minibatch.engine.model_runner import ModelRunnerOutput
from minibatch.engine.scheduler import Scheduler
from minibatch.engine.sequence import Request, Sequence
from minibatch.engine.static_scheduler import StaticScheduler
from minibatch.kv.block_allocator import BlockAllocator
from minibatch.model.model import GPT, GPTConfig


def make(prompt_len, max_tokens, order, rid, priority=0):
    req = Request(rid, "", list(range(1, prompt_len + 1)), SamplingParams(temperature=0, max_tokens=max_tokens),
                  priority=priority, arrival_time=float(order), arrival_order=order)
    seq = Sequence(rid, req, 0, list(req.prompt_token_ids))
    req.seqs.append(seq)
    return seq


def model_free_output(out) -> ModelRunnerOutput:
    """What a model runner would return, without a model: token 200 + i for a sequence's i-th output token,
    wherever its chunk reaches its end (the runner samples exactly there)."""
    sampled = [[200 + s.seq.num_output_tokens] if s.samples else [] for s in out.scheduled]
    return ModelRunnerOutput(sampled, [0] * len(sampled), [[] for _ in sampled])


class Harness:
    """The real scheduler and allocator; the model runner replaced by model_free_output."""

    def __init__(self, scheduling="continuous", **kw):
        self.alloc = BlockAllocator(kw.pop("num_blocks"), kw.pop("block_size"), kw.pop("prefix", False))
        self.sched = (StaticScheduler if scheduling == "static" else Scheduler)(self.alloc, **kw)

    def step(self):
        out = self.sched.schedule()
        self.sched.update_from_output(out, model_free_output(out))
        self.alloc.check_invariants(self.sched.live_seq_ids())
        for s in out.scheduled:                   # the scheduler's one invariant, held after every step
            seq = s.seq
            assert seq.is_finished or seq.num_computed_tokens == s.num_computed_before + s.num_new_tokens
        return [(s.seq.seq_id, s.num_new_tokens, s.phase) for s in out.scheduled], [s.seq_id for s in out.preempted]


def test_exact_schedule_with_chunked_prefill():
    r = Harness(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    for i, (p, m) in enumerate([(6, 3), (3, 2), (10, 2)]):
        r.sched.add(make(p, m, i, "ABC"[i]))
    steps = [r.step()[0] for _ in range(6)]
    assert steps == [
        [("A", 6, "prefill"), ("B", 2, "prefill")],       # B's prompt does not fit the budget: a 2-token chunk
        [("A", 1, "decode"), ("B", 1, "prefill")],        # C waits: max_num_seqs = 2
        [("A", 1, "decode"), ("B", 1, "decode")],         # both finish here
        [("C", 8, "prefill")],                            # C admitted, chunked by the budget
        [("C", 2, "prefill")],
        [("C", 1, "decode")],
    ]
    assert not r.sched.has_unfinished() and r.alloc.num_free_blocks == 8


def test_prefill_first_admits_before_decoding():
    r = Harness(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, order="prefill-first")
    r.sched.add(make(4, 5, 0, "A"))
    assert r.step()[0] == [("A", 4, "prefill")]
    r.sched.add(make(7, 2, 1, "B"))
    assert r.step()[0] == [("B", 7, "prefill"), ("A", 1, "decode")]
    r2 = Harness(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    r2.sched.add(make(4, 5, 0, "A"))
    r2.step()
    r2.sched.add(make(8, 2, 1, "B"))
    assert r2.step()[0] == [("A", 1, "decode"), ("B", 7, "prefill")]   # decode-first: B gets what is left


def test_preemption_picks_the_latest_arrival_and_resumes_it():
    r = Harness(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=32)
    r.sched.add(make(7, 4, 0, "A"))
    r.sched.add(make(7, 4, 1, "B"))
    assert r.step() == ([("A", 7, "prefill"), ("B", 7, "prefill")], [])
    assert r.step() == ([("A", 1, "decode"), ("B", 1, "decode")], [])     # position 7 fits the 2nd block
    # A's 9th token needs a third block and none is free: B (latest arrival) is preempted
    assert r.step() == ([("A", 1, "decode")], ["B"])
    assert r.step() == ([("A", 1, "decode")], [])                           # B cannot come back yet
    assert r.step() == ([("B", 9, "resumed")], [])                          # A finished; B recomputes 7 + 2
    assert r.step() == ([("B", 1, "decode")], [])
    assert not r.sched.has_unfinished()


def test_prefill_first_never_lets_a_newcomer_push_out_a_running_sequence():
    """Prefill-first admits B before A decodes; when A then needs a block, the least important of the two
    (B, the later arrival) gives way: its admission is undone and it waits, and A keeps running."""
    r = Harness(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, order="prefill-first")
    r.sched.add(make(7, 4, 0, "A"))
    assert r.step() == ([("A", 7, "prefill")], [])
    assert r.step() == ([("A", 1, "decode")], [])
    r.sched.add(make(7, 4, 1, "B"))
    assert r.step() == ([("A", 1, "decode")], [])          # B took A's next block at admission, then gave it back
    assert [s.seq_id for s in r.sched.waiting] == ["B"] and r.sched.waiting.peek().num_preemptions == 0
    assert r.step() == ([("A", 1, "decode")], [])           # A finishes
    assert r.step() == ([("B", 7, "prefill")], [])
    # with priorities, the newcomer that matters more does push the running one out
    r = Harness(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, order="prefill-first",
                policy="priority")
    r.sched.add(make(7, 4, 0, "A", priority=1))
    r.step()
    r.step()
    r.sched.add(make(7, 4, 1, "B", priority=0))
    assert r.step() == ([("B", 7, "prefill")], ["A"])


def test_priority_preempts_the_least_important():
    r = Harness(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, policy="priority")
    r.sched.add(make(7, 4, 0, "A", priority=1))
    r.sched.add(make(7, 4, 1, "B", priority=0))           # later, but more important
    r.step()
    r.step()
    assert r.step() == ([("B", 1, "decode")], ["A"])


def test_static_batch_admits_nobody_until_done():
    r = Harness(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, scheduling="static")
    for i, m in enumerate([1, 4, 2]):
        r.sched.add(make(4, m, i, "ABC"[i]))
    assert r.step()[0] == [("A", 4, "prefill"), ("B", 4, "prefill")]
    assert r.step()[0] == [("B", 1, "decode")]              # A is done but keeps its slot: C must wait
    out = r.sched.schedule()
    assert out.num_padding_slots == 1 and [s.seq.seq_id for s in out.scheduled] == ["B"]


@pytest.mark.parametrize("scheduling", ["continuous", "static"])
def test_pending_forks_take_their_seats_before_they_fork(scheduling):
    # P (n = 2) is admitted first; its child forks off only after the prompt. Q and R arrive with it: with
    # max_num_seqs 3, only Q joins (P, P's child to come, Q). Counting P as one seat let R in too: 4 ran.
    r = Harness(num_blocks=32, block_size=4, max_num_seqs=3, max_num_batched_tokens=64, scheduling=scheduling)
    p = make(3, 4, 0, "P")
    p.num_forks_pending = 1
    for s in (p, make(3, 4, 1, "Q"), make(3, 4, 2, "R")):
        r.sched.add(s)
    out = r.sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == ["P", "Q"]
    sampled, forked = [[200] for _ in out.scheduled], [[300] * s.seq.num_forks_pending for s in out.scheduled]
    r.sched.update_from_output(out, ModelRunnerOutput(sampled, [0] * len(sampled), forked))
    assert [s.seq_id for s in r.sched.running] == ["P", "Q", "P.1"]


def test_update_rolls_back_rejected_drafts():
    h = Harness(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    seq = make(5, 10, 0, "A")
    h.sched.add(seq)
    h.step()                                                   # prefill: 5 computed, token 200 appended
    seq.spec_token_ids = [7, 8, 9]                             # a proposer's three drafts
    out = h.sched.schedule()
    (s,) = out.scheduled
    assert (s.num_new_tokens, s.input_token_ids, s.samples) == (4, [200, 7, 8, 9], True)
    assert h.alloc.num_slots("A") == 9                         # slots for the last token and every draft
    h.sched.update_from_output(out, ModelRunnerOutput([[7, 42]], [1], [[]]))   # 7 accepted, 42 corrects 8
    assert seq.token_ids[5:] == [200, 7, 42] and seq.num_computed_tokens == 7
    assert h.alloc.num_slots("A") == 7 and h.alloc.block_table("A") == [0, 1]   # rejected drafts rolled back
    assert seq.spec_token_ids == [] and seq.spec_stats.to_dict()["accepted"] == 1
    h.alloc.check_invariants(["A"])


def test_update_forks_parallel_samples_sharing_the_prompt_blocks():
    h = Harness(num_blocks=8, block_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    seq = make(6, 3, 0, "R")
    seq.num_forks_pending = 2
    h.sched.add(seq)
    out = h.sched.schedule()
    h.sched.update_from_output(out, ModelRunnerOutput([[50]], [0], [[51, 52]]))
    kids = seq.request.seqs
    assert [k.seq_id for k in kids] == ["R", "R.1", "R.2"] and [k.token_ids[6:] for k in kids] == [[50], [51], [52]]
    assert all(h.alloc.block_table(k.seq_id) == [0, 1] for k in kids) and h.alloc.ref_counts()[:2] == [3, 3]
    assert [s.seq_id for s in h.sched.running] == ["R", "R.1", "R.2"] and seq.num_forks_pending == 0
    h.step()                                                   # all three decode: two copy-on-write block 1
    assert len({h.alloc.block_table(k.seq_id)[1] for k in kids}) == 3


def test_update_cuts_at_a_stop_string_and_frees_the_blocks():
    h = Harness(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    seq = make(3, 10, 0, "A")
    seq.request.params.stop = ["\n"]
    h.sched.add(seq)
    out = h.sched.schedule()
    changed, finished = h.sched.update_from_output(out, ModelRunnerOutput([[ord("x")]], [0], [[]]))
    out = h.sched.schedule()
    changed, finished = h.sched.update_from_output(out, ModelRunnerOutput([[ord("\n")]], [0], [[]]))
    assert finished == [seq] and seq.finish_reason == "stop" and seq.output_token_ids == [ord("x")]
    assert changed == [seq.request] and seq.request.finished and h.alloc.num_free_blocks == 8


# -- invariants over random workloads, with a real (tiny, random) model ---------------------------
@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return GPT(GPTConfig("tiny", n_layer=1, n_head=2, n_embd=16, n_ctx=64)).eval()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 20), st.integers(0, 2)), min_size=1, max_size=8),
       block_size=st.sampled_from([4, 8]), num_blocks=st.integers(8, 24), max_num_seqs=st.integers(1, 4),
       budget=st.sampled_from([8, 16, 64]), policy=st.sampled_from(["fcfs", "priority"]),
       scheduling=st.sampled_from(["continuous", "static"]), prefix=st.booleans(),
       order=st.sampled_from(["decode-first", "prefill-first"]))
def test_scheduler_invariants(tiny_model, reqs, block_size, num_blocks, max_num_seqs, budget, policy, scheduling,
                              prefix, order):
    budget = max(budget, block_size)
    llm = LLM(tiny_model, block_size=block_size, num_gpu_blocks=num_blocks, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=budget, policy=policy, scheduling=scheduling, enable_prefix_caching=prefix,
              order=order)
    eng = llm.llm_engine
    admitted, traces = [], []

    def hook(t):
        eng.allocator.check_invariants()
        assert t.num_batched_tokens <= budget and len(t.running) <= max_num_seqs
        admitted.extend(t.admitted)
        traces.append(t)

    eng.add_hook(hook)
    ids = []
    for i, (p, m, prio) in enumerate(reqs):
        if block_size * num_blocks < p + m or eng.allocator.blocks_needed(p + m) > num_blocks:
            continue
        eng.add_request(str(i), [(7 * i + j) % 256 for j in range(p)], SamplingParams(temperature=0, max_tokens=m),
                        priority=prio)
        ids.append(i)
    finished = set()
    for _ in range(2000):
        if not eng.has_unfinished_requests():
            break
        finished |= {o.request_id for o in eng.step() if o.finished}
    assert finished == {str(i) for i in ids}, "every admitted request finishes"
    assert eng.allocator.num_free_blocks == num_blocks
    first = list(dict.fromkeys(admitted))
    if policy == "fcfs":
        assert first == sorted(first, key=int), "FCFS admits in arrival order (no one is skipped or starved)"
    else:
        key = {str(i): (reqs[i][2], i) for i in ids}
        assert first == sorted(first, key=key.get), "priority admits in (priority, arrival) order"
