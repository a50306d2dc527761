"""The project: a scheduling policy for goodput (exercises/project.md says what is graded and how).

Write ``ProjectScheduler``: the scheduler's choice of each step's batch (admission, order, preemption), behind
the same interface as exercise 7's ``Scheduler`` (``SchedulerBase`` gives the queues and the moves between
them; read ``exercises/ex7_scheduler.py``'s docstring for what ``_fill`` must produce). It starts as the
engine's own continuous scheduler: it already finishes every request and leaks no block, the correctness
floor. Make it serve more requests within their latency targets (time to the first token, time per output
token, on the simulated H100 clock: the same score on every run) on the workloads the grader generates (three
hidden ones, larger than the practice ones): the score is the share of the engine's scheduler's misses you turn
into hits, averaged (exercises/project.md); ``python -m exercises.project`` scores it on the practice workloads,
against the engine's scheduler, in a process of its own, and prints each one's figures.

Ideas to measure, not to trust: admit short prompts first (and how not to starve long ones), cap the chunk of
a long prefill so decodes keep their pace, preempt the request that has the least work done, give up early on
a request that cannot meet its target any more (it still has to finish).
"""
from __future__ import annotations

from minibatch.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput  # noqa: F401
from minibatch.kv.block_allocator import NoFreeBlocksError  # noqa: F401


class ProjectScheduler(Scheduler):
    """Your policy. As shipped: the engine's continuous batching (decode-first, FCFS), unchanged."""
