"""A sequence's life in the engine, and what the engine reports back.

State machine (vLLM's, with preemption by recompute, Kwon et al. 2023 §4.5):

    WAITING --admit--> RUNNING --stop / length--> FINISHED
       ^                  |
       +----preempt-------+   (its blocks are freed; on readmission the prompt
                               *and* the tokens generated so far are prefilled again)

The invariant that makes chunked prefill, decode, preemption and speculation
one mechanism: ``num_computed`` tokens of ``token_ids`` have their K/V in the
cache; a step feeds the model some of the rest. Plain decode is the case
``len(token_ids) - num_computed == 1`` (the token sampled last step).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch

from minibatch.engine.sampler import SamplingParams, find_stop  # noqa: F401  (re-exported)
from minibatch.model.tokenizer import decode


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: str
    request_id: str
    index: int                               # which of the request's n samples
    prompt_ids: list
    params: SamplingParams
    priority: int = 0                        # lower value = served first (vLLM's convention)
    arrival_time: float = 0.0
    arrival_order: int = 0                   # tie-break: order of add_request calls
    generator: Optional[torch.Generator] = None
    output_ids: list = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0                    # leading tokens whose K/V is in the cache
    num_cached_prefix: int = 0               # of those, how many came from the prefix cache at admission
    num_preemptions: int = 0
    spec_token_ids: list = field(default_factory=list)   # draft tokens to verify in the next step
    finish_reason: Optional[str] = None
    fork_pending: int = 0                    # n > 1: children to fork off when the prompt is done

    @property
    def token_ids(self) -> list:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self, policy: str):
        """Queue order: FCFS by arrival; priority by (priority, arrival)."""
        if policy == "priority":
            return (self.priority, self.arrival_time, self.arrival_order, self.index)
        return (self.arrival_time, self.arrival_order, self.index)
