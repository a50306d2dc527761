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
"""
from __future__ import annotations

import bisect

from minibatch.engine.sequence import Sequence

POLICIES = ("fcfs", "priority")


def queue_key(seq: Sequence, policy: str) -> tuple:
    """Sort key of a sequence under a policy: smaller is served first."""
    r = seq.request
    fcfs = (r.arrival_time, r.arrival_order, seq.index)
    return (r.priority, *fcfs) if policy == "priority" else fcfs


class RequestQueue:
    def __init__(self, policy: str = "fcfs"):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {list(POLICIES)}")
        self.policy = policy
        self._keys: list = []
        self._seqs: list = []

    def key(self, seq: Sequence) -> tuple:
        return queue_key(seq, self.policy)

    def add(self, seq: Sequence) -> None:
        k = self.key(seq)
        i = bisect.bisect_right(self._keys, k)
        self._keys.insert(i, k)
        self._seqs.insert(i, seq)

    def peek(self) -> Sequence:
        return self._seqs[0]

    def remove(self, seq: Sequence) -> None:
        i = self._seqs.index(seq)
        del self._keys[i], self._seqs[i]

    def __contains__(self, seq) -> bool:
        return any(s is seq for s in self._seqs)

    def __iter__(self):
        return iter(list(self._seqs))

    def __len__(self) -> int:
        return len(self._seqs)
