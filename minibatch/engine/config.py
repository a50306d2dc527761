"""Everything a lecture varies, in one place, checked once when it is made."""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional

from minibatch.engine.request_queue import POLICIES
from minibatch.engine.scheduler import ORDERS
from minibatch.kv.attention import check_backend
from minibatch.spec_decode.proposer import check_speculative_config
from minibatch.engine.threads import check_num_threads

SCHEDULINGS = ("continuous", "static")


def _int(name: str, value, lo: int) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


@dataclass
class EngineConfig:
    block_size: int = 16
    num_gpu_blocks: Optional[int] = None       # None: room for max_num_seqs full contexts
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512          # the token budget of one step
    enable_prefix_caching: bool = True
    attention_backend: str = "batched"         # "loop" (the teaching version), "batched" or "triton"
    scheduling: str = "continuous"             # or "static"
    policy: str = "fcfs"                       # or "priority"
    order: str = "decode-first"                # or "prefill-first"
    speculative_config: Optional[dict] = None  # {"method": "draft" | "ngram", "num_speculative_tokens": k}
    seed: int = 0                              # the generator of requests without a seed
    num_threads: Optional[int] = None          # CPU threads; None: from the model's size (engine/threads.py)

    def __post_init__(self):
        _int("block_size", self.block_size, 1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_gpu_blocks is not None:
            _int("num_gpu_blocks", self.num_gpu_blocks, 1)
        _int("max_num_seqs", self.max_num_seqs, 1)
        _int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than one block "
                             f"({self.block_size} tokens)")
        check_backend(self.attention_backend)
        for name, allowed in (("scheduling", SCHEDULINGS), ("policy", POLICIES), ("order", ORDERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; choose one of {list(allowed)}")
        if self.speculative_config is not None:
            check_speculative_config(self.speculative_config)
        _int("seed", self.seed, 0)
        check_num_threads(self.num_threads)

    def num_blocks_for(self, n_ctx: int) -> int:
        """The pool's size: num_gpu_blocks, or enough for max_num_seqs sequences at full context."""
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks
        return self.max_num_seqs * -(-n_ctx // self.block_size)
