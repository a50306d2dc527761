"""``LLM``: vLLM's offline interface over the step-level engine.

    llm = LLM(model="target")
    outs = llm.generate(["def fib(n):", "import os\\n"], SamplingParams(temperature=0, max_tokens=64))
    print(outs[0].outputs[0].text)

Everything a lecture varies is a constructor argument (block size, cache size,
token budget, backend, scheduling, policy, speculation), so two ``LLM``s in one
process compare configurations on the same model and workload.
"""
from __future__ import annotations

import inspect
from typing import Optional, Sequence as Seq, Union

import torch
from tqdm import tqdm

from minibatch.engine.config import EngineConfig
from minibatch.engine.engine import LLMEngine
from minibatch.model.model import GPT
from minibatch.sampling.sampler import SamplingParams
from minibatch.engine.outputs import RequestOutput
from minibatch.model.weights import load_model


class LLM:
    def __init__(self, model: Union[str, GPT] = "target", device=None, dtype=torch.float32,
                 draft_model: Union[str, GPT, None] = None, **engine_kwargs):
        known = set(inspect.signature(EngineConfig).parameters)
        unknown = set(engine_kwargs) - known
        if unknown:
            raise TypeError(f"unknown LLM option(s) {sorted(unknown)}; known: {sorted(known)}")
        self.model = load_model(model, device=device, dtype=dtype) if isinstance(model, str) else model
        if isinstance(draft_model, str):
            draft_model = load_model(draft_model, device=self.model.device, dtype=self.model.dtype)
        config = EngineConfig(**engine_kwargs)
        if config.disaggregated:             # a prefill and a decode instance behind a router, LLMEngine's surface
            from minibatch.disagg.router import DisaggregatedEngine
            self.llm_engine = DisaggregatedEngine(self.model, config, draft_model)
        else:
            self.llm_engine = LLMEngine(self.model, config, draft_model)
        self._counter = 0

    @property
    def device(self) -> torch.device:
        return self.model.device

    def generate(self, prompts: Union[str, Seq], sampling_params: Union[SamplingParams, Seq, None] = None,
                 priority: Optional[Seq[int]] = None, use_tqdm: Optional[bool] = None) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in the prompts' order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        priority = list(priority) if priority is not None else [0] * len(prompts)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities")
        eng = self.llm_engine
        ids = []
        try:
            for p, sp, prio in zip(prompts, sampling_params, priority):
                rid = f"req-{self._counter}"
                self._counter += 1
                eng.add_request(rid, p, sp, priority=prio)
                ids.append(rid)
        except Exception:                     # one bad prompt: none of this call's prompts stays queued
            for rid in ids:
                eng.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        show = use_tqdm if use_tqdm is not None else len(prompts) >= 8
        with tqdm(total=len(prompts), desc="generate", disable=not show) as bar:
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished and out.request_id not in done:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[r] for r in ids]
