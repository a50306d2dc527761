"""The scheduler on its own (a model-free stand-in), then its invariants over random workloads."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from minibatch import LLM, SamplingParams
from minibatch.kv.block_allocator import BlockAllocator
from minibatch.model.model import GPT, GPTConfig
from minibatch.engine.scheduler import Scheduler
from minibatch.engine.sequence import Sequence


def make(prompt_len, max_tokens, order, rid, priority=0):
    return Sequence(rid, rid, 0, list(range(1, prompt_len + 1)), SamplingParams(temperature=0, max_tokens=max_tokens),
                    priority=priority, arrival_time=float(order), arrival_order=order)


class StandIn:
    """Plays the model runner: marks scheduled tokens computed and 'samples' a token when a sequence is done."""

    def __init__(self, **kw):
        self.alloc = BlockAllocator(kw.pop("num_blocks"), kw.pop("block_size"), kw.pop("prefix", False))
        self.sched = Scheduler(self.alloc, **kw)

    def step(self):
        out = self.sched.schedule()
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed += s.num_tokens
            self.alloc.mark_computed(seq.seq_id, seq.num_computed)
            if seq.num_computed == len(seq):
                seq.output_ids.append(200 + len(seq.output_ids))
                if len(seq.output_ids) >= seq.params.max_tokens:
                    self.sched.finish(seq)
        self.alloc.check_invariants()
        return [(s.seq.seq_id, s.num_tokens, s.phase) for s in out.scheduled], [s.seq_id for s in out.preempted]


def test_exact_schedule_with_chunked_prefill():
    r = StandIn(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
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
    r = StandIn(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, order="prefill-first")
    r.sched.add(make(4, 5, 0, "A"))
    assert r.step()[0] == [("A", 4, "prefill")]
    r.sched.add(make(7, 2, 1, "B"))
    assert r.step()[0] == [("B", 7, "prefill"), ("A", 1, "decode")]
    r2 = StandIn(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    r2.sched.add(make(4, 5, 0, "A"))
    r2.step()
    r2.sched.add(make(8, 2, 1, "B"))
    assert r2.step()[0] == [("A", 1, "decode"), ("B", 7, "prefill")]   # decode-first: B gets what is left


def test_preemption_picks_the_latest_arrival_and_resumes_it():
    r = StandIn(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=32)
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
    r = StandIn(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, order="prefill-first")
    r.sched.add(make(7, 4, 0, "A"))
    assert r.step() == ([("A", 7, "prefill")], [])
    assert r.step() == ([("A", 1, "decode")], [])
    r.sched.add(make(7, 4, 1, "B"))
    assert r.step() == ([("A", 1, "decode")], [])          # B took A's next block at admission, then gave it back
    assert [s.seq_id for s in r.sched.waiting] == ["B"] and r.sched.waiting[0].num_preemptions == 0
    assert r.step() == ([("A", 1, "decode")], [])           # A finishes
    assert r.step() == ([("B", 7, "prefill")], [])
    # with priorities, the newcomer that matters more does push the running one out
    r = StandIn(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, order="prefill-first",
                policy="priority")
    r.sched.add(make(7, 4, 0, "A", priority=1))
    r.step()
    r.step()
    r.sched.add(make(7, 4, 1, "B", priority=0))
    assert r.step() == ([("B", 7, "prefill")], ["A"])


def test_priority_preempts_the_least_important():
    r = StandIn(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, policy="priority")
    r.sched.add(make(7, 4, 0, "A", priority=1))
    r.sched.add(make(7, 4, 1, "B", priority=0))           # later, but more important
    r.step()
    r.step()
    assert r.step() == ([("B", 1, "decode")], ["A"])


def test_static_batch_admits_nobody_until_done():
    r = StandIn(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, scheduling="static")
    for i, m in enumerate([1, 4, 2]):
        r.sched.add(make(4, m, i, "ABC"[i]))
    assert r.step()[0] == [("A", 4, "prefill"), ("B", 4, "prefill")]
    assert r.step()[0] == [("B", 1, "decode")]              # A is done but keeps its slot: C must wait
    out = r.sched.schedule()
    assert out.num_padding_slots == 1 and [s.seq.seq_id for s in out.scheduled] == ["B"]


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
