"""The waiting queue: who is admitted next when a seat and blocks free up.

Two policies, as in vLLM (``--scheduling-policy fcfs | priority``):

* **FCFS**: first come, first served, by arrival time (then by the order of
  ``add_request`` calls, then by sample index).
* **priority**: the lowest ``priority`` value first, FCFS among equals.

A preempted sequence goes back into the queue at its *original* place, so under
FCFS it is the next to be readmitted: preemption delays a request, it does not
send it to the back. The same order ranks running sequences when the scheduler
must preempt one: the last in queue order (least important) goes first.

The queue is a sorted list (bisect on the keys): inserting is O(n), which is
nothing next to a model step, and iterating in order (for the trace) is free.

Two more, SGLang's cache-aware policies (RadixAttention, Zheng et al. 2024, §3.3), which order the queue by what
the prefix cache already holds, so that requests sharing a prefix run while it is cached:

* **lpm** (longest prefix match): the longest cached prefix first (``num_cached_prefix_tokens``), FCFS among equals;
* **dfs-weight**: a depth-first walk over the tree of the waiting requests' cached prefixes, the heaviest subtree
  (most waiting requests) first, each request after the requests deeper in its subtree (SGLang's order; the paper's
  Theorem 3.1: with a cache that holds the longest request, this order is optimal).

Both need only what the allocator answers about a prompt (its cached prefix blocks), so they work over either prefix
cache (``prefix_cache="hash" | "radix"``). Their order changes as the cache does, so the scheduler calls
``reorder(allocator)`` at the start of every step; above ``cache_aware_max_waiting`` waiting requests (128, as
SGLang) the walk costs more than it saves and the order falls back to FCFS.

Fairness. A cache-aware order can pass a cold request over for ever under a stream of hot ones. So each waiting
request counts the admissions of requests that arrived after it (it was *passed over*); one passed over
``max_passed_over`` times (MAX_PASSED_OVER = 16 unless told) goes before every request that was not, FCFS among
such. Since the scheduler admits in queue order and the head waits when it does not fit, **no request is passed
over more than ``max_passed_over`` times during one stay in the queue** (a preempted request starts a new stay).
Running sequences are ranked FCFS under a cache-aware policy (preemption takes the latest arrival).
"""
from __future__ import annotations

import bisect

from minibatch.engine.sequence import Sequence

POLICIES = ("fcfs", "priority", "lpm", "dfs-weight")
CACHE_AWARE_POLICIES = ("lpm", "dfs-weight")
CACHE_AWARE_MAX_WAITING = 128        # SGLang's: above this many waiting requests, FCFS
MAX_PASSED_OVER = 16                 # the fairness bound of the cache-aware policies (see above)


def check_cache_aware(policy: str, allocator) -> None:
    """A cache-aware policy orders by what the prefix cache holds: with no cache it would be FCFS in disguise
    (SGLang falls back silently; this says so instead). ``allocator``: one, or its ``enable_prefix_caching``."""
    if policy in CACHE_AWARE_POLICIES and not getattr(allocator, "enable_prefix_caching", allocator):
        raise ValueError(f"policy {policy!r} orders the queue by the prefix cache, but enable_prefix_caching is "
                         f"False: turn prefix caching on, or choose 'fcfs' or 'priority'")


def queue_key(seq: Sequence, policy: str) -> tuple:
    """Sort key of a sequence under a policy: smaller is served first (cache-aware policies rank by FCFS here;
    ``RequestQueue.reorder`` puts their order in front of it)."""
    r = seq.request
    fcfs = (r.arrival_time, r.arrival_order, seq.index)
    return (r.priority, *fcfs) if policy == "priority" else fcfs


def dfs_weight_order(seqs: list, paths: dict) -> list:
    """``seqs`` (FCFS order) in SGLang's DFS-weight order. ``paths[seq_id]``: the tuple of blocks of its cached
    prefix; those are the nodes of a tree (a prefix is a node, its one block shorter prefix its parent). A node's
    weight is the number of requests at or below it; the walk visits children heaviest first (ties: the one a
    request reached first), then the node's own requests."""
    weight, own, children = {(): 0}, {}, {}
    for s in seqs:
        p = paths[s.seq_id]
        own.setdefault(p, []).append(s)
        for i in range(len(p) + 1):
            if p[:i] not in weight:
                weight[p[:i]] = 0
                children.setdefault(p[:i - 1], []).append(p[:i])
            weight[p[:i]] += 1
    order, stack = [], [((), False)]
    while stack:                                         # post-order, iteratively (paths can be long)
        node, expanded = stack.pop()
        if expanded:
            order += own.get(node, [])
            continue
        stack.append((node, True))
        kids = sorted(children.get(node, []), key=lambda c: -weight[c])     # stable: first reached first
        stack += [(c, False) for c in reversed(kids)]
    return order


class RequestQueue:
    def __init__(self, policy: str = "fcfs", cache_aware_max_waiting: int = CACHE_AWARE_MAX_WAITING,
                 max_passed_over: int = MAX_PASSED_OVER):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {list(POLICIES)}")
        self.policy = policy
        self.cache_aware = policy in CACHE_AWARE_POLICIES
        self.cache_aware_max_waiting, self.max_passed_over = cache_aware_max_waiting, max_passed_over
        self._keys: list = []
        self._seqs: list = []
        self._rank: dict = {}                            # seq_id -> place in the last cache-aware order
        self.passed_over: dict = {}                      # seq_id -> admissions of later arrivals during its stay

    def key(self, seq: Sequence) -> tuple:
        """Importance (the running sequences' order, for preemption): the policy's, FCFS for a cache-aware one."""
        return queue_key(seq, "fcfs" if self.cache_aware else self.policy)

    def _order_key(self, seq: Sequence) -> tuple:
        if not self.cache_aware:
            return self.key(seq)
        starved = self.passed_over.get(seq.seq_id, 0) >= self.max_passed_over
        rank = 0 if starved else self._rank.get(seq.seq_id, len(self._rank))     # a newcomer: after the ranked
        return (not starved, rank, *self.key(seq))

    def reorder(self, allocator) -> None:
        """The cache-aware order of this step, from what ``allocator`` has cached now (other policies: nothing)."""
        if not self.cache_aware:
            return
        fcfs = sorted(self._seqs, key=self.key)
        if len(fcfs) > self.cache_aware_max_waiting:     # too long a queue to walk every step: FCFS
            order = fcfs
        elif self.policy == "lpm":
            cached = {s.seq_id: allocator.num_cached_prefix_tokens(s.token_ids) for s in fcfs}
            order = sorted(fcfs, key=lambda s: -cached[s.seq_id])                 # stable: FCFS among equals
        else:
            order = dfs_weight_order(fcfs, {s.seq_id: tuple(allocator.cached_prefix_blocks(s.token_ids))
                                            for s in fcfs})
        self._rank = {s.seq_id: i for i, s in enumerate(order)}
        self._resort()

    def _resort(self) -> None:
        pairs = sorted(((self._order_key(s), i, s) for i, s in enumerate(self._seqs)), key=lambda t: t[:2])
        self._keys, self._seqs = [k for k, _, _ in pairs], [s for _, _, s in pairs]

    def add(self, seq: Sequence) -> None:
        k = self._order_key(seq)
        i = bisect.bisect_right(self._keys, k)
        self._keys.insert(i, k)
        self._seqs.insert(i, seq)

    def peek(self) -> Sequence:
        return self._seqs[0]

    def remove(self, seq: Sequence, admitted: bool = False) -> None:
        """Take ``seq`` out; ``admitted``: it was admitted, so each earlier arrival still waiting was passed over."""
        i = self._seqs.index(seq)
        del self._keys[i], self._seqs[i]
        self.passed_over.pop(seq.seq_id, None)
        self._rank.pop(seq.seq_id, None)
        if admitted and self.cache_aware:
            k, starved = self.key(seq), False
            for s in self._seqs:
                if self.key(s) < k:
                    self.passed_over[s.seq_id] = self.passed_over.get(s.seq_id, 0) + 1
                    starved |= self.passed_over[s.seq_id] == self.max_passed_over
            if starved:                                  # to the front now, not at the next step's reorder
                self._resort()

    def __contains__(self, seq) -> bool:
        return any(s is seq for s in self._seqs)

    def __iter__(self):
        return iter(list(self._seqs))

    def __len__(self) -> int:
        return len(self._seqs)
