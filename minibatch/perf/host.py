"""The host CPU beside a simulated GPU: its time per engine step outside the forward, measured here.

A GPU does the forward; the CPU beside it schedules the step, prepares its inputs, does the sampler's
bookkeeping, updates every sequence from the output and builds the outputs. On a tiny model that CPU time is
most of a step (vLLM V1 made asynchronous scheduling its default for it, #27614). The simulated clock
(``perf/cost.py``) adds it to each step when the spec asks for the host, ``simulate="h100+cpu:target"``:

    cpu(step) = factor x (per_step + per_seq x scheduled sequences)
    synchronous:   step time = cpu + gpu                 (in series)
    asynchronous:  step time = max(cpu, gpu)             (the batch queue overlaps them; step 0 pays cpu + gpu)

``per_step`` and ``per_seq`` are measured on this machine by ``python -m minibatch.bench host-cpu``
(``bench/host_cpu.py``); ``factor`` scales them to a server's CPU and is an estimate, labelled as one.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class HostCpuProfile:
    name: str
    per_step: float            # s per engine step, measured here
    per_seq: float             # s per scheduled sequence per step, measured here
    factor: float              # a server CPU's time / this machine's
    sources: dict = field(default_factory=dict)

    def __post_init__(self):
        for k in ("per_step", "per_seq", "factor"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"{self.name}: {k} must be a number >= 0, got {v!r}")

    def step_time(self, num_seqs: int) -> float:
        """Seconds of the host's work in a step of ``num_seqs`` scheduled sequences, on the server's CPU."""
        return self.factor * (self.per_step + self.per_seq * num_seqs)


HOST_CPU = HostCpuProfile(
    "server-cpu", per_step=0.195e-3, per_seq=0.0255e-3, factor=0.5,
    sources={
        "per_step, per_seq": "measured 2026-12-07 on this machine (2 vCPUs, 'Intel(R) Xeon(R) Processor', shared: "
                             "load average 4-5) by `python -m minibatch.bench host-cpu`: the shipped target model "
                             "under asynchronous scheduling, one batch of r = 1, 4, 8, 16 sequences decoding 48 "
                             "tokens; per pure-decode step the schedule span + the update span (sampling, "
                             "update_from_output) + the outputs and trace after it; medians 0.21-0.23, 0.30, "
                             "0.39-0.41, 0.59-0.62 ms; least squares over two runs: 0.194-0.195 ms + "
                             "0.0248-0.0261 ms a sequence",
        "factor": "estimate: 0.5, a dedicated server core (e.g. an H100 host's Xeon Platinum 8480C, 3.8 GHz "
                  "turbo) against a vCPU of this machine shared with other jobs (load 4-5 on 2 cores, so a step's "
                  "Python waits for a core part of the time); not measured on a server",
    })
