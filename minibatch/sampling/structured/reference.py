"""The oracle of constrained decoding: the no-cache model (sampling/reference.py) under a matcher's mask, one byte
at a time. Slow on purpose and obviously right: every engine configuration (batching, chunked prefill,
preemption, speculation, the library backend) must give its greedy tokens exactly.
"""
from __future__ import annotations

import torch

from minibatch.sampling.sampler import SamplingParams, make_generator
from minibatch.model.model import GPT
from minibatch.sampling.reference import _finish, _next_token, check_request, next_logits
from minibatch.sampling.structured.matcher import advance


@torch.no_grad()
def constrained_generate(model: GPT, prompt_ids: list, params: SamplingParams, matcher) -> tuple[list, str]:
    """(output ids, finish reason): each step masks the logits [V] with matcher.allowed() [256] before choosing."""
    check_request(model, prompt_ids, params)
    gen = make_generator(params.seed)
    ids, out = list(prompt_ids), []
    while len(out) < params.max_tokens:
        logits = next_logits(model, ids).float()
        logits = logits.masked_fill(~matcher.allowed().to(logits.device), float("-inf"))
        tok = _next_token(logits, params, gen)
        kept, ended = advance(matcher, [tok])
        ids += kept
        out += kept
        if (done := _finish(out, params)) is not None:
            return done
        if ended is not None:
            return out, ended
    return out, "length"
