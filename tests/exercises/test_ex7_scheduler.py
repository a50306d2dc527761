"""Exercise 7, graded: one step of the continuous-batching scheduler (exercises/ex7_scheduler.py).

Exact schedules on small scenarios, step by step (which sequence runs with how many tokens, who is admitted
and who is preempted), in the style of vLLM's scheduler tests: the scheduler under test is driven through
``schedule()`` and ``update_from_output()`` with a model-free runner output (token 200 + i for a sequence's
i-th output token). Blocks come from ``ToyPool``, a plain stand-in for the block allocator (not exercise 6's:
it shares blocks after a fork and copies on write, but caches nothing), so this part needs only your scheduler. Then invariants over random workloads,
and the engine's greedy text on your scheduler, equal to generation without any cache.
"""
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import exercises
from minibatch import SamplingParams
from minibatch.engine.model_runner import ModelRunnerOutput
from minibatch.engine.scheduler import SchedulerOutput
from minibatch.engine.sequence import Request, Sequence
from minibatch.kv.block_allocator import NoFreeBlocksError, UnknownSequenceError

pytestmark = pytest.mark.ex7


class ToyPool:
    """What the scheduler asks of a block allocator, in plain Python: blocks handed out from a stack, ref counts,
    and copy-on-write: a forked child shares its parent's blocks, and a sequence about to write into a shared,
    partly filled last block gets a fresh one, ``append_slots`` returning the (shared, fresh) pair for the engine
    to copy (``returned`` keeps every pair handed out, for the checks). No prefix cache of its own:
    ``cached``: token lists whose leading whole blocks count as a prefix-cache hit for any prompt that starts
    with them (held outside the pool, as if another sequence kept them)."""

    def __init__(self, num_blocks, block_size, enable_prefix_caching=False, cached=()):
        self.num_blocks, self.block_size, self.enable_prefix_caching = num_blocks, block_size, False
        self.hits = self.queries = 0
        self.stack = list(range(num_blocks))[::-1]          # pop() hands out 0, 1, 2, ...
        self.ref, self.returned = [0] * num_blocks, []
        self.tables, self.slots, self.cached, self.outside = {}, {}, [list(c) for c in cached], num_blocks

    def blocks_needed(self, n):
        return -(-n // self.block_size)

    @property
    def num_free_blocks(self):
        return len(self.stack)

    def _hit_blocks(self, tokens):
        best = 0
        for c in self.cached:
            k = 0
            while k < min(len(c), len(tokens)) and c[k] == tokens[k]:
                k += 1
            best = max(best, k)
        return min(best // self.block_size, (len(tokens) - 1) // self.block_size)

    def can_allocate(self, tokens):
        return self.blocks_needed(len(tokens)) - self._hit_blocks(tokens) <= len(self.stack)

    def _take(self):
        b = self.stack.pop()
        self.ref[b] = 1
        return b

    def allocate(self, seq_id, tokens):
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already exists (allocated twice, never freed?)")
        if not self.can_allocate(tokens):
            raise NoFreeBlocksError(f"{seq_id!r} needs more blocks than the {len(self.stack)} free")
        hit = self._hit_blocks(tokens)
        table = list(range(self.outside, self.outside + hit))        # the cached blocks: not from the pool
        self.outside += hit
        table += [self._take() for _ in range(self.blocks_needed(len(tokens)) - hit)]
        self.tables[seq_id], self.slots[seq_id] = table, len(tokens)
        return hit * self.block_size

    def _seq(self, seq_id):
        if seq_id not in self.tables:
            raise UnknownSequenceError(f"unknown sequence {seq_id!r} (never allocated, or already freed)")
        return self.tables[seq_id]

    def _release(self, blocks):
        for b in reversed(blocks):
            if b < self.num_blocks:
                self.ref[b] -= 1
                if not self.ref[b]:
                    self.stack.append(b)

    def append_slots(self, seq_id, n):
        table = self._seq(seq_id)
        grow = self.blocks_needed(self.slots[seq_id] + n) - len(table)
        last = table[-1] if n and self.slots[seq_id] % self.block_size else None
        cow = last is not None and last < self.num_blocks and self.ref[last] > 1
        if grow + cow > len(self.stack):
            raise NoFreeBlocksError(f"{seq_id!r} needs {grow + cow} blocks, {len(self.stack)} are free")
        pairs = []
        if cow:                                              # shared and about to be written: a private copy
            table[-1] = self._take()
            self.ref[last] -= 1
            pairs.append((last, table[-1]))
        table += [self._take() for _ in range(grow)]
        self.slots[seq_id] += n
        self.returned += pairs
        return pairs

    def truncate(self, seq_id, n):
        table, keep = self._seq(seq_id), self.blocks_needed(n)
        self._release(table[keep:])
        del table[keep:]
        self.slots[seq_id] = n

    def mark_computed(self, seq_id, n, tokens):
        self._seq(seq_id)
        assert 0 <= n <= min(self.slots[seq_id], len(tokens)), f"{seq_id!r}: {n} computed of {self.slots[seq_id]}"

    def fork(self, parent_id, child_id):
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id!r} already exists")
        self.tables[child_id] = list(self._seq(parent_id))
        for b in self.tables[child_id]:
            if b < self.num_blocks:
                self.ref[b] += 1
        self.slots[child_id] = self.slots[parent_id]

    def free(self, seq_id):
        self._release(self._seq(seq_id))
        del self.tables[seq_id], self.slots[seq_id]

    def has_seq(self, seq_id):
        return seq_id in self.tables

    def block_table(self, seq_id):
        return list(self._seq(seq_id))

    def num_slots(self, seq_id):
        self._seq(seq_id)
        return self.slots[seq_id]

    def ref_counts(self):
        return list(self.ref)

    def cached_block_ids(self):
        return []

    def check_invariants(self, live_seq_ids=None):
        if live_seq_ids is not None:
            assert set(live_seq_ids) == set(self.tables), \
                f"sequences holding blocks {sorted(self.tables)}, running {sorted(live_seq_ids)}"
        used = Counter(b for t in self.tables.values() for b in t if b < self.num_blocks)
        assert [used[b] for b in range(self.num_blocks)] == self.ref, "ref counts differ from the tables"
        assert not set(used) & set(self.stack), "a block both used and free"
        assert len(used) + len(self.stack) == self.num_blocks, "blocks lost"
        for sid, t in self.tables.items():
            assert len(t) == self.blocks_needed(self.slots[sid]), f"{sid!r}: {len(t)} blocks, {self.slots[sid]} slots"


def make(prompt_len, max_tokens, order, rid, priority=0, prompt=None):
    prompt = list(range(1, prompt_len + 1)) if prompt is None else list(prompt)
    req = Request(rid, "", prompt, SamplingParams(temperature=0, max_tokens=max_tokens),
                  priority=priority, arrival_time=float(order), arrival_order=order)
    seq = Sequence(rid, req, 0, list(req.prompt_token_ids))
    req.seqs.append(seq)
    return seq


def model_free_output(out) -> ModelRunnerOutput:
    """What a model runner would return, without a model: token 200 + i for a sequence's i-th output token,
    wherever its chunk reaches its end (the runner samples exactly there); drafts are all rejected; a sequence
    with forks pending (n > 1) gets its children's first tokens (300, 301, ...) there too."""
    sampled = [[200 + s.seq.num_output_tokens] if s.samples else [] for s in out.scheduled]
    forked = [list(range(300, 300 + s.seq.num_forks_pending)) if s.samples else [] for s in out.scheduled]
    return ModelRunnerOutput(sampled, [0] * len(sampled), forked)


class Harness:
    """Your scheduler (or static batching over it) on a ToyPool; the model runner replaced by model_free_output."""

    def __init__(self, num_blocks, block_size, max_num_seqs, max_num_batched_tokens, policy="fcfs",
                 order="decode-first", static=False, cached=()):
        self.pool = ToyPool(num_blocks, block_size, cached=cached)
        cls = exercises.get("scheduler")
        cls = exercises.static_over(cls) if static else cls
        self.sched = cls(self.pool, max_num_seqs, max_num_batched_tokens, policy, order)
        self.budget, self.max_num_seqs = max_num_batched_tokens, max_num_seqs

    def add(self, *seqs):
        for s in seqs:
            self.sched.add(s)

    def schedule(self):
        done = len(self.pool.returned)
        out = self.sched.schedule()
        assert sorted(out.cow_copies) == sorted(self.pool.returned[done:]), \
            f"the allocator returned copy-on-write pairs {self.pool.returned[done:]} this step, out.cow_copies " \
            f"holds {out.cow_copies}: the engine copies only those, so a block left out is read uncopied"
        assert out.num_batched_tokens <= self.budget, \
            f"{out.num_batched_tokens} tokens scheduled, the budget is {self.budget}"
        assert len(self.sched.running) <= self.max_num_seqs, \
            f"{len(self.sched.running)} sequences running, max_num_seqs is {self.max_num_seqs}"
        ids = [s.seq.seq_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), f"a sequence scheduled twice in one step: {ids}"
        for s in out.scheduled:
            assert s.num_new_tokens >= 1 and s.seq in self.sched.running, f"{s.seq.seq_id}: {s.num_new_tokens} tokens"
            assert s.num_computed_before == s.seq.num_computed_tokens, f"{s.seq.seq_id}: num_computed_before"
            assert s.num_new_tokens - len(s.spec_token_ids) <= s.seq.num_uncomputed_tokens, \
                f"{s.seq.seq_id}: {s.num_new_tokens} new tokens, only {s.seq.num_uncomputed_tokens} uncomputed"
        self.pool.check_invariants(self.sched.live_seq_ids())
        return out

    def step(self):
        out = self.schedule()
        self.sched.update_from_output(out, model_free_output(out))
        self.pool.check_invariants(self.sched.live_seq_ids())
        return [(s.seq.seq_id, s.num_new_tokens, s.phase) for s in out.scheduled], [s.seq_id for s in out.preempted]


# -- budget, seats, chunks -------------------------------------------------------------------------------
def test_exact_schedule_with_chunked_prefill():
    h = Harness(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    h.add(*(make(p, m, i, "ABC"[i]) for i, (p, m) in enumerate([(6, 3), (3, 2), (10, 2)])))
    steps = [h.step()[0] for _ in range(6)]
    assert steps == [
        [("A", 6, "prefill"), ("B", 2, "prefill")],       # B's prompt does not fit the budget: a 2-token chunk
        [("A", 1, "decode"), ("B", 1, "prefill")],        # C waits: max_num_seqs = 2
        [("A", 1, "decode"), ("B", 1, "decode")],         # both finish here
        [("C", 8, "prefill")],                            # C admitted, chunked by the budget
        [("C", 2, "prefill")],
        [("C", 1, "decode")],
    ]
    assert not h.sched.has_unfinished() and h.pool.num_free_blocks == 8


def test_decode_first_gives_admissions_what_is_left():
    h = Harness(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    h.add(make(4, 5, 0, "A"), make(3, 5, 1, "B"))
    assert h.step()[0] == [("A", 4, "prefill"), ("B", 3, "prefill")]
    h.add(make(9, 2, 2, "C"), make(2, 2, 3, "D"))
    assert h.step()[0] == [("A", 1, "decode"), ("B", 1, "decode"), ("C", 6, "prefill")]   # D waits behind C
    assert h.step()[0] == [("A", 1, "decode"), ("B", 1, "decode"), ("C", 3, "prefill"), ("D", 2, "prefill")]
    out = h.step()[0]
    assert out == [("A", 1, "decode"), ("B", 1, "decode"), ("C", 1, "decode"), ("D", 1, "decode")]


def test_prefill_first_admits_before_decoding():
    h = Harness(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, order="prefill-first")
    h.add(make(4, 5, 0, "A"))
    assert h.step()[0] == [("A", 4, "prefill")]
    h.add(make(7, 2, 1, "B"))
    assert h.step()[0] == [("B", 7, "prefill"), ("A", 1, "decode")]
    h.add(make(10, 2, 2, "C"))
    assert h.step()[0] == [("C", 8, "prefill")]                       # the admission takes the whole budget
    assert h.step()[0] == [("A", 1, "decode"), ("B", 1, "decode"), ("C", 2, "prefill")]


def test_max_num_seqs_counts_running_sequences_and_pending_forks():
    h = Harness(num_blocks=32, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    a, b, c, d = make(3, 4, 0, "A"), make(3, 4, 1, "B"), make(3, 4, 2, "C"), make(3, 4, 3, "D")
    h.add(a, b, c, d)
    assert h.step()[0] == [("A", 3, "prefill"), ("B", 3, "prefill"), ("C", 3, "prefill")]   # D: no seat
    assert [s.seq_id for s in h.sched.waiting] == ["D"]
    h2 = Harness(num_blocks=32, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    p = make(3, 4, 0, "P")
    p.num_forks_pending = 1                                            # n = 2: two seats once it forks
    h2.add(p, make(3, 4, 1, "Q"), make(3, 4, 2, "R"))
    assert h2.step()[0] == [("P", 3, "prefill"), ("Q", 3, "prefill")]   # R would be the 4th sequence
    assert h2.step()[0] == [("P", 1, "decode"), ("P.1", 1, "decode"), ("Q", 1, "decode")]


def test_drafts_are_cut_to_the_budget():
    h = Harness(num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=4)
    a, b = make(3, 10, 0, "A"), make(2, 10, 1, "B")
    h.add(a, b)
    assert h.step()[0] == [("A", 3, "prefill"), ("B", 1, "prefill")]
    h.step()                                                           # A decodes, B's last prompt token
    a.spec_token_ids, b.spec_token_ids = [7, 8, 9, 10, 11], [5]
    out = h.schedule()
    (s,) = out.scheduled                                               # A spends the whole budget first
    assert (s.seq.seq_id, s.num_new_tokens, s.spec_token_ids, s.input_token_ids) == ("A", 4, [7, 8, 9], [201, 7, 8, 9])
    assert h.pool.num_slots("A") == 8                                  # slots for the last token and 3 drafts


def test_a_cached_prefix_is_computed_and_the_chunk_is_the_rest():
    prompt = list(range(50, 61))                                       # 11 tokens: 2 full blocks of 4 cached
    h = Harness(num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, cached=[prompt])
    b = make(0, 3, 0, "B", prompt=prompt + [7])
    h.add(b)
    out = h.schedule()
    (s,) = out.scheduled
    assert (s.num_computed_before, s.num_new_tokens, s.phase) == (8, 4, "prefill")
    assert b.num_cached_tokens == 8 and out.admitted == [b]


# -- preemption --------------------------------------------------------------------------------------------
def test_preemption_picks_the_latest_arrival_and_resumes_it():
    h = Harness(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=32)
    h.add(make(7, 4, 0, "A"), make(7, 4, 1, "B"))
    assert h.step() == ([("A", 7, "prefill"), ("B", 7, "prefill")], [])
    assert h.step() == ([("A", 1, "decode"), ("B", 1, "decode")], [])       # position 7 fits the 2nd block
    # A's 9th token needs a third block and none is free: B (the latest arrival) is preempted
    assert h.step() == ([("A", 1, "decode")], ["B"])
    assert h.step() == ([("A", 1, "decode")], [])                            # B cannot come back yet
    assert h.step() == ([("B", 9, "resumed")], [])                           # A finished; B recomputes 7 + 2
    assert h.step() == ([("B", 1, "decode")], [])
    assert not h.sched.has_unfinished() and h.pool.num_free_blocks == 4


def test_a_preempted_sequence_gives_its_blocks_back_and_goes_back_to_waiting():
    h = Harness(num_blocks=6, block_size=4, max_num_seqs=3, max_num_batched_tokens=32)
    a, b, c = make(4, 6, 0, "A"), make(4, 6, 1, "B"), make(4, 6, 2, "C")
    h.add(a, b, c)
    h.step()                                                             # 3 blocks used, 3 free
    h.step()                                                             # position 4: a 2nd block each
    assert h.pool.num_free_blocks == 0
    for _ in range(3):
        assert h.step() == ([("A", 1, "decode"), ("B", 1, "decode"), ("C", 1, "decode")], [])   # 5..7 fit
    out = h.schedule()                                                   # position 8: a 3rd block each
    assert [s.seq.seq_id for s in out.scheduled] == ["A", "B"] and out.preempted == [c]
    assert not h.pool.has_seq("C"), "the preempted sequence still holds its blocks"
    assert h.pool.block_table("A")[2:] and h.pool.block_table("B")[2:] and h.pool.num_free_blocks == 0
    assert c.num_computed_tokens == 0 and c in h.sched.waiting and c not in h.sched.running
    assert c.num_preemptions == 1


def test_priority_preempts_the_least_important():
    h = Harness(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, policy="priority")
    h.add(make(7, 4, 0, "A", priority=1), make(7, 4, 1, "B", priority=0))   # B later, but more important
    assert h.step()[0] == [("B", 7, "prefill"), ("A", 7, "prefill")]
    assert h.step()[0] == [("B", 1, "decode"), ("A", 1, "decode")]
    assert h.step() == ([("B", 1, "decode")], ["A"])


def test_the_victim_may_be_the_sequence_that_needs_the_block():
    # B (more important) got the last block at position 4; C, the least important, needs one at its position
    # 4 and none is free: C itself is the victim, and the step goes on without it
    h = Harness(num_blocks=3, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, policy="priority")
    h.add(make(2, 8, 0, "C", priority=1), make(4, 8, 1, "B", priority=0))
    assert h.step() == ([("B", 4, "prefill"), ("C", 2, "prefill")], [])
    assert h.step() == ([("B", 1, "decode"), ("C", 1, "decode")], [])    # B takes the last free block
    assert h.step() == ([("B", 1, "decode"), ("C", 1, "decode")], [])
    assert h.step() == ([("B", 1, "decode")], ["C"])
    assert h.pool.num_free_blocks == 1 and [s.seq_id for s in h.sched.waiting] == ["C"]


def test_prefill_first_never_lets_a_newcomer_push_out_a_running_sequence():
    h = Harness(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, order="prefill-first")
    h.add(make(7, 4, 0, "A"))
    assert h.step() == ([("A", 7, "prefill")], [])
    assert h.step() == ([("A", 1, "decode")], [])
    h.add(make(7, 4, 1, "B"))
    assert h.step() == ([("A", 1, "decode")], [])          # B took A's next block at admission, then gave it back
    assert [s.seq_id for s in h.sched.waiting] == ["B"] and h.sched.waiting.peek().num_preemptions == 0
    assert h.step() == ([("A", 1, "decode")], [])           # A finishes
    assert h.step() == ([("B", 7, "prefill")], [])
    # with priorities, the newcomer that matters more does push the running one out
    h = Harness(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, order="prefill-first",
                policy="priority")
    h.add(make(7, 4, 0, "A", priority=1))
    h.step()
    h.step()
    h.add(make(7, 4, 1, "B", priority=0))
    assert h.step() == ([("B", 7, "prefill")], ["A"])


def test_prefill_first_unadmits_the_newcomer_rather_than_preempt_an_older_sequence():
    h = Harness(num_blocks=5, block_size=4, max_num_seqs=3, max_num_batched_tokens=32, order="prefill-first")
    a, b = make(7, 6, 0, "A"), make(3, 8, 1, "B")
    h.add(a, b)
    assert h.step() == ([("A", 7, "prefill"), ("B", 3, "prefill")], [])      # 3 blocks, 2 free
    assert h.step() == ([("A", 1, "decode"), ("B", 1, "decode")], [])
    h.add(make(8, 2, 2, "C"))                                                 # takes the last 2 blocks ...
    assert h.step() == ([("A", 1, "decode"), ("B", 1, "decode")], [])       # ... and gives them back to A, B
    assert [s.seq_id for s in h.sched.waiting] == ["C"] and not h.pool.has_seq("C")
    assert b.num_preemptions == 0 and h.pool.num_free_blocks == 0



def test_an_unadmitted_newcomer_gives_its_budget_back():
    # budget 9: C's prompt takes 8 of it at admission; A's next block is the one C took, so C is un-admitted, and
    # the 8 tokens come back: A and B both decode (without them, B would be left out with budget to spare)
    h = Harness(num_blocks=5, block_size=4, max_num_seqs=3, max_num_batched_tokens=9, order="prefill-first")
    h.add(make(7, 6, 0, "A"), make(3, 8, 1, "B"))
    assert h.step() == ([("A", 7, "prefill"), ("B", 2, "prefill")], [])
    assert h.step() == ([("A", 1, "decode"), ("B", 1, "prefill")], [])
    h.add(make(8, 2, 2, "C"))
    assert h.step() == ([("A", 1, "decode"), ("B", 1, "decode")], [])
    assert [s.seq_id for s in h.sched.waiting] == ["C"] and not h.pool.has_seq("C")


def test_copy_on_write_pairs_reach_the_batch():
    # n = 2: after the prompt, the child shares the parent's blocks; the first to write into the shared, partly
    # filled block 1 gets a copy, and the pair must be in out.cow_copies (the engine copies only those)
    h = Harness(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    s = make(6, 3, 0, "A")
    s.num_forks_pending = 1
    h.add(s)
    assert h.step() == ([("A", 6, "prefill")], [])
    out = h.schedule()
    assert [(x.seq.seq_id, x.num_new_tokens) for x in out.scheduled] == [("A", 1), ("A.1", 1)]
    assert out.cow_copies == [(1, 2)], f"copy-on-write pairs {out.cow_copies}, the allocator returned [(1, 2)]"

# -- the waiting queue ------------------------------------------------------------------------------------
def test_the_head_of_the_queue_waits_and_nobody_overtakes_it():
    h = Harness(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    h.add(make(12, 3, 0, "A"))
    h.step()                                                           # A holds 3 of 6 blocks, soon 4
    h.add(make(16, 2, 1, "B"), make(2, 2, 2, "C"))                    # B needs 4: it waits; C would fit
    assert h.step()[0] == [("A", 1, "decode")]
    assert [s.seq_id for s in h.sched.waiting] == ["B", "C"]
    assert h.step()[0] == [("A", 1, "decode")]                          # A finishes
    assert h.step()[0] == [("B", 16, "prefill"), ("C", 2, "prefill")]


def test_the_most_important_running_sequence_is_served_first():
    h = Harness(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=4, policy="priority")
    h.add(make(3, 6, 0, "A", priority=2))
    assert h.step()[0] == [("A", 3, "prefill")]
    h.add(make(3, 6, 1, "B", priority=0), make(3, 6, 2, "C", priority=1))
    assert h.step()[0] == [("A", 1, "decode"), ("B", 3, "prefill")]
    assert h.step()[0] == [("B", 1, "decode"), ("A", 1, "decode"), ("C", 2, "prefill")]   # B started after A
    assert h.step()[0] == [("B", 1, "decode"), ("C", 1, "prefill"), ("A", 1, "decode")]


def test_priority_admits_the_most_important_first():
    h = Harness(num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, policy="priority")
    h.add(make(3, 2, 0, "A", priority=2), make(3, 2, 1, "B", priority=0), make(3, 2, 2, "C", priority=1))
    assert h.step()[0] == [("B", 3, "prefill"), ("C", 3, "prefill")]
    assert h.step()[0] == [("B", 1, "decode"), ("C", 1, "decode")]
    assert h.step()[0] == [("A", 3, "prefill")]


def test_static_batching_runs_on_your_scheduler():
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, static=True)
    h.add(*(make(4, m, i, "ABC"[i]) for i, m in enumerate([1, 4, 2])))
    assert h.step()[0] == [("A", 4, "prefill"), ("B", 4, "prefill")]
    assert h.step()[0] == [("B", 1, "decode")]              # A is done but keeps its slot: C must wait
    out = h.schedule()
    assert out.num_padding_slots == 1 and [s.seq.seq_id for s in out.scheduled] == ["B"]
    # preemption off (static batching reserved the blocks): a full cache is an error, not a victim
    h = Harness(num_blocks=2, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    h.add(make(4, 8, 0, "A"))
    h.step()
    h.pool.stack.clear()                                   # nothing left for A's next block
    with pytest.raises(NoFreeBlocksError):
        h.sched._schedule_running(SchedulerOutput(), 8, set(), preempt=False)
    assert h.sched.running and not h.sched.waiting


# -- invariants over random workloads -------------------------------------------------------------------------
@settings(max_examples=60, deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 2), st.integers(0, 12),
                               st.integers(1, 2)), min_size=1, max_size=8),
       block_size=st.sampled_from([2, 4, 8]), num_blocks=st.integers(4, 24), max_num_seqs=st.integers(1, 4),
       budget=st.sampled_from([4, 8, 16, 64]), policy=st.sampled_from(["fcfs", "priority"]),
       order=st.sampled_from(["decode-first", "prefill-first"]), drafts=st.booleans(), cached=st.booleans())
@example(reqs=[(7, 6, 0, 0, 1), (3, 8, 0, 0, 1), (8, 2, 0, 2, 1)], block_size=4, num_blocks=5, max_num_seqs=3,
         budget=9, policy="fcfs", order="prefill-first", drafts=False, cached=False)     # a newcomer un-admitted
@example(reqs=[(6, 3, 0, 0, 2), (5, 4, 1, 1, 2)], block_size=4, num_blocks=8, max_num_seqs=4, budget=16,
         policy="priority", order="decode-first", drafts=False, cached=False)            # forks, copy-on-write
def test_random_workloads_keep_the_invariants(reqs, block_size, num_blocks, max_num_seqs, budget, policy, order,
                                               drafts, cached):
    """Budget, seats, batch order (by importance), no one left out while budget is left, the queue's order,
    victims less important than every sequence left running, and every request finishes with its blocks back. Some
    requests have n = 2 samples, some prompts a prefix-cache hit (all prompts start 1, 2, 3, ...)."""
    h = Harness(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget, policy=policy, order=order, cached=[range(1, 41)] if cached else ())
    seqs = []
    for i, (p, m, prio, arrive, n) in enumerate(reqs):
        if h.pool.blocks_needed(p + m + 4) <= num_blocks and n <= max_num_seqs:   # could finish alone
            seqs.append((arrive, make(p, m, i, str(i), priority=prio)))
            seqs[-1][1].num_forks_pending = n - 1
    for step in range(3000):
        for arrive, s in seqs:
            if arrive == step:
                h.add(s)
        if step > 12 and not h.sched.has_unfinished():                 # every request has arrived, and finished
            break
        if drafts:
            for s in h.sched.running:
                if s.num_uncomputed_tokens == 1:
                    s.spec_token_ids = [9] * (len(s.token_ids) % 4)
        waiting = [s for s in h.sched.waiting]
        out = h.schedule()
        running = [s for s in h.sched.running]
        scheduled = {id(s.seq) for s in out.scheduled}
        key = h.sched.waiting.key
        new = [k for k, s in enumerate(out.scheduled) if s.seq in out.admitted]
        old = [k for k, s in enumerate(out.scheduled) if s.seq not in out.admitted]
        keys = [key(out.scheduled[k].seq) for k in old]
        assert keys == sorted(keys), "the running sequences are served most important first (their queue key)"
        for p in out.preempted:                                         # the least important goes first
            kept = [r.seq_id for r in h.sched.running if key(r) > key(p)]
            assert not kept, f"{p.seq_id} was preempted, but {kept} (less important) kept running"
        if order == "decode-first":
            assert all(k < j for k in old for j in new), "decode-first: the running sequences come before admissions"
        else:
            assert all(j < k for k in old for j in new), "prefill-first: admissions come before the running"
        if out.num_batched_tokens < budget:                             # budget left: nobody was left out
            assert all(id(s) in scheduled for s in running), "budget was left, but a running sequence did not run"
            if order == "decode-first" and len(h.sched.waiting) and not out.preempted:   # admissions came last
                head = h.sched.waiting.peek()
                assert h.sched._seats(running) + 1 + head.num_forks_pending > max_num_seqs or \
                    not h.pool.can_allocate(head.token_ids), "budget, a seat and blocks were left, but nobody was admitted"
        for a in out.admitted:                                          # the queue's order: nobody overtakes
            passed = [w.seq_id for w in h.sched.waiting if w in waiting and key(w) < key(a)]
            assert not passed, f"{a.seq_id} was admitted before {passed}, who came first ({policy})"
        h.sched.update_from_output(out, model_free_output(out))
        h.pool.check_invariants(h.sched.live_seq_ids())
        assert len(h.sched.running) <= max_num_seqs, f"{len(h.sched.running)} running after the forks"
    assert not h.sched.has_unfinished(), "every request finishes"
    assert h.pool.num_free_blocks == num_blocks
    assert all(s.num_output_tokens == s.params.max_tokens for _, r in seqs for s in r.request.seqs)


# -- the engine on your scheduler --------------------------------------------------------------------------
PROMPTS = ["def main():\n    ", "class Stack:\n    def push(self", "import os\nimport sys\n", "    def __init__(self",
           "for i in range(10):\n"]
LENGTHS = [24, 18, 20, 16, 22]


@pytest.fixture(scope="module")
def no_cache_text(target_model):
    from minibatch.sampling.reference import generate
    from minibatch.model.tokenizer import encode
    return [generate(target_model, encode(p), SamplingParams(temperature=0, max_tokens=m))[0]
            for p, m in zip(PROMPTS, LENGTHS)]


CONFIGS = {
    "tiny-cache-preempts": dict(block_size=8, num_gpu_blocks=12, max_num_seqs=5),
    "chunked-prefill": dict(block_size=8, max_num_batched_tokens=8, max_num_seqs=3),
    "priority": dict(policy="priority", block_size=8, num_gpu_blocks=12, max_num_seqs=4, _prio=[3, 0, 2, 1, 0]),
    "prefill-first": dict(order="prefill-first", block_size=8, num_gpu_blocks=12, max_num_seqs=5),
    "static": dict(scheduling="static", block_size=8, max_num_seqs=3),
}


def slots(block_tables, starts, counts, block_size, device="cpu"):
    """The engine's slot mapping (exercise 1's formula), here so that this part needs no other part of yours."""
    return torch.tensor([t[p // block_size] * block_size + p % block_size for t, s, n in zip(block_tables, starts, counts)
                         for p in range(s, s + n)], dtype=torch.int64).to(device)


def test_the_engine_generates_the_same_text_on_your_scheduler(target_model, no_cache_text):
    """Your scheduler in the engine, on a ToyPool: greedy, the "batched" attention, no speculation (nothing here
    needs another exercise of yours)."""
    import minibatch.engine.engine as engine
    import minibatch.kv.metadata as attention
    from minibatch import LLM
    from minibatch.trace import TraceRecorder
    saved = engine.BlockAllocator, engine.Scheduler, engine.StaticScheduler, attention._slot_mapping
    cls = exercises.get("scheduler")
    engine.BlockAllocator, engine.Scheduler, engine.StaticScheduler = ToyPool, cls, exercises.static_over(cls)
    attention._slot_mapping = slots
    try:
        for name, cfg in CONFIGS.items():
            cfg = dict(cfg)
            prio = cfg.pop("_prio", None)
            llm = LLM(target_model, enable_prefix_caching=False, **cfg)
            rec = TraceRecorder()
            llm.llm_engine.add_hook(rec)
            outs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=m) for m in LENGTHS],
                                priority=prio, use_tqdm=False)
            for o, want in zip(outs, no_cache_text):
                assert o.outputs[0].token_ids == want, f"{name}: request {o.request_id}'s text differs"
            budget, cap = llm.llm_engine.config.max_num_batched_tokens, llm.llm_engine.config.max_num_seqs
            assert all(t.num_batched_tokens <= budget and len(t.running) <= cap for t in rec.traces), name
            if "num_gpu_blocks" in cfg:
                assert sum(len(t.preempted) for t in rec.traces) >= 1, f"{name}: this cache is meant to preempt"
            assert llm.llm_engine.allocator.num_free_blocks == llm.llm_engine.allocator.num_blocks, f"{name}: leak"
    finally:
        engine.BlockAllocator, engine.Scheduler, engine.StaticScheduler, attention._slot_mapping = saved
