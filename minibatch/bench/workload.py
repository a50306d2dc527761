"""Synthetic serving workloads: named, seeded, reproducible lists of requests.

A workload fixes what a benchmark compares on: prompts, how many tokens each
request may generate (``max_tokens``), and when each arrives. What separates
batching policies is the *spread* of output lengths: a static batch runs as
long as its longest member, so a long tail of lengths wastes its slots, while
continuous batching refills a slot the step it frees (Yu et al., Orca, 2022).

Prompts are snippets of held-out standard-library code (``data.val_documents``,
files the model never saw in training), cut at line boundaries. The model is
byte-level, so a prompt's token count is ``len(prompt.encode())``. Every
request satisfies prompt tokens + max_tokens <= max_len (the model's context).

Randomness: one seed, split into independent streams for prompts, output
lengths, arrivals and priorities, so e.g. switching "offline" to "poisson"
changes the arrival times and nothing else.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from minibatch.model.data import val_documents
from minibatch.sampling.sampler import SamplingParams

# Short code prompts (the lecture demos'); their greedy continuations are predictable enough for a draft to guess.
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n", "def read_file(path):\n", "if __name__ == '__main__':\n",
           "try:\n    import json\n", "def __repr__(self):\n", "with open(path) as f:\n",
           "    def close(self):\n", "# Copyright 2001\n", "def main(argv=None):\n"]

WORKLOADS = {
    "uniform": "output lengths uniform in output_len = (lo, hi), default (16, 128): every request alike",
    "longtail": "output lengths log-normal, median 32, sigma 1.2 (mean ~66, p90 ~150): many short, a few very long",
    "shared-prefix": "every prompt = one fixed 118-byte preamble + its own snippet (prefix caching); "
                     "output lengths as 'uniform'",
}
ARRIVALS = ("offline", "poisson")

# A common header (licence line plus imports), the same bytes at the start of every "shared-prefix" prompt:
# 118 bytes, so 7 full blocks of 16 tokens that the prefix cache can share.
PREAMBLE = ("# Licensed under the PSF License Agreement; see LICENSE.\n"
            "import os\nimport re\nimport sys\nfrom typing import Optional\n\n\n")

_OPTIONS = {"uniform": {"output_len": (16, 128)},
            "longtail": {"median": 32.0, "sigma": 1.2},
            "shared-prefix": {"output_len": (16, 128), "preamble": PREAMBLE}}


@dataclass
class WorkloadRequest:
    request_id: str
    prompt: str
    max_tokens: int
    arrival_time: float               # seconds after the start of the run
    priority: int = 0                 # lower = more important (vLLM's convention)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt.encode("utf-8"))

    def sampling_params(self, temperature: float = 0.0, seed=None, **kw) -> SamplingParams:
        """The request's SamplingParams: its max_tokens, plus whatever else is asked for."""
        return SamplingParams(temperature=temperature, seed=seed, max_tokens=self.max_tokens, **kw)


@functools.lru_cache(maxsize=8)
def _documents(min_len: int) -> tuple:
    """Every held-out file of at least min_len bytes (val_documents in its own sorted order)."""
    return tuple(val_documents(10 ** 9, min_len=min_len, seed=0))


def _snippet(docs, lo: int, hi: int, length: int, rng: np.random.Generator) -> str:
    """lo..hi bytes of code (as near ``length`` as line breaks allow) from a line start to after a newline.

    A cut just after a newline is a valid UTF-8 boundary (0x0A never occurs inside a multibyte character).
    Tries a few random places; when no line break falls in [lo, hi] (a narrow range), cuts mid-line at
    ``length``, moved to the nearest character boundary.
    """
    for _ in range(32):
        doc = docs[rng.integers(len(docs))]
        start = doc.rfind(b"\n", 0, int(rng.integers(len(doc) - hi + 1))) + 1   # a line start
        window = doc[start:start + hi]
        cuts = [i + 1 for i, byte in enumerate(window) if byte == 0x0A and lo <= i + 1]
        cuts = [c for c in cuts if window[:c].strip()]                          # not just blank lines
        if cuts:
            return window[:min(cuts, key=lambda c: abs(c - length))].decode("utf-8")
    cut = length                                   # window[cut] is the first byte left out:
    while cut > lo and window[cut:cut + 1] and window[cut] & 0xC0 == 0x80:     # a continuation byte
        cut -= 1
    while cut < hi and window[cut:cut + 1] and window[cut] & 0xC0 == 0x80:
        cut += 1
    return window[:cut].decode("utf-8", errors="ignore")


def _output_lengths(name, n, rng, opts) -> np.ndarray:
    if name == "longtail":
        # log-normal: median = exp(mu) = `median`, mean = median * exp(sigma^2 / 2)
        return np.maximum(1, np.rint(rng.lognormal(np.log(opts["median"]), opts["sigma"], size=n))).astype(int)
    lo, hi = opts["output_len"]
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ValueError(f"output_len must be integers 1 <= lo <= hi, got {opts['output_len']}")
    return rng.integers(lo, hi + 1, size=n)


def make_workload(name: str = "longtail", num_requests: int = 64, seed: int = 0, arrival: str = "offline",
                  rate: float | None = None, prompt_len=(32, 192), max_len: int = 512, num_priorities: int = 1,
                  **kw) -> list[WorkloadRequest]:
    """``num_requests`` requests of workload ``name`` (see WORKLOADS), the same list for the same arguments.

    prompt_len = (lo, hi): prompt bytes drawn uniformly from it (for "shared-prefix", the snippet after
    the preamble); arrival "offline" = everyone at t = 0, "poisson" = exponential gaps of mean 1/rate s;
    num_priorities > 1 draws priorities uniformly from 0..num_priorities-1. Workload options in **kw:
    uniform/shared-prefix: output_len=(lo, hi); longtail: median, sigma; shared-prefix: preamble.
    Every max_tokens is capped so that prompt tokens + max_tokens <= max_len.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {list(WORKLOADS)}")
    unknown = set(kw) - set(_OPTIONS[name])
    if unknown:
        raise TypeError(f"workload {name!r} has no option(s) {sorted(unknown)}; it takes {sorted(_OPTIONS[name])}")
    opts = {**_OPTIONS[name], **kw}
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be an integer >= 1, got {num_requests!r}")
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
    if arrival == "poisson" and not (rate is not None and rate > 0):
        raise ValueError(f"Poisson arrivals need a rate > 0 (requests per second), got {rate!r}")
    if arrival == "offline" and rate is not None:
        raise ValueError("rate only applies to arrival='poisson'; offline requests all arrive at t = 0")
    if not isinstance(num_priorities, int) or num_priorities < 1:
        raise ValueError(f"num_priorities must be an integer >= 1, got {num_priorities!r}")
    preamble = opts.get("preamble", "")
    if not isinstance(preamble, str):
        raise TypeError(f"preamble must be a str, got {type(preamble).__name__}")
    lo, hi = prompt_len
    fixed = len(preamble.encode("utf-8"))
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi and fixed + hi < max_len):
        raise ValueError(f"prompt_len must be integers 1 <= lo <= hi with preamble ({fixed} bytes) + hi < "
                         f"max_len = {max_len} (room for at least one output token), got {prompt_len}")
    if name == "longtail" and not (opts["median"] >= 1 and opts["sigma"] > 0):
        raise ValueError(f"longtail needs median >= 1 and sigma > 0, got {opts['median']}, {opts['sigma']}")

    r_prompt, r_len, r_arrival, r_prio = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4))
    docs = _documents(max(2 * hi, 256))
    prompts = [preamble + _snippet(docs, lo, hi, int(r_prompt.integers(lo, hi + 1)), r_prompt) for _ in range(num_requests)]
    wanted = _output_lengths(name, num_requests, r_len, opts)
    if arrival == "offline":
        arrivals = np.zeros(num_requests)
    else:
        arrivals = np.cumsum(r_arrival.exponential(1.0 / rate, size=num_requests))
    priorities = r_prio.integers(num_priorities, size=num_requests)
    return [WorkloadRequest(f"r{i}", p, int(min(w, max_len - len(p.encode("utf-8")))), float(t), int(pr))
            for i, (p, w, t, pr) in enumerate(zip(prompts, wanted, arrivals, priorities))]


def _stats(xs) -> str:
    xs = np.asarray(xs, dtype=float)
    p50, p90 = np.percentile(xs, [50, 90])
    return f"mean {xs.mean():.1f}, p50 {p50:.0f}, p90 {p90:.0f}, max {xs.max():.0f}"


def describe(workload: list[WorkloadRequest]) -> str:
    """One paragraph: how many requests, when they arrive, prompt and output length statistics."""
    if not workload:
        return "empty workload: no requests."
    n = len(workload)
    arrivals = sorted(r.arrival_time for r in workload)
    if arrivals[-1] == 0:
        when = "all arriving at t = 0 (offline)"
    else:
        when = f"arriving over {arrivals[-1]:.2f} s (mean rate {n / arrivals[-1]:.2f} requests/s)"
    prompt = [r.num_prompt_tokens for r in workload]
    out = [r.max_tokens for r in workload]
    prios = sorted({r.priority for r in workload})
    return (f"{n} requests, {when}; prompt tokens: {_stats(prompt)}; output tokens (max_tokens): {_stats(out)}; "
            f"{sum(prompt) + sum(out)} tokens in all" + (f"; priorities {prios}." if len(prios) > 1 else "."))


# -- a multi-turn chat (the host tier's workload: bench offload, demo hierarchy) --------------------------------------
@dataclass
class ChatTurn(WorkloadRequest):
    conversation: int = 0
    turn: int = 0
    after: str | None = None          # the request id of this conversation's previous turn (None: the first)


def multi_turn_chat(num_conversations: int = 8, num_turns: int = 4, seed: int = 0, user_len=(24, 48),
                    reply_len=(48, 80), max_tokens: int = 16, max_len: int = 512) -> list[ChatTurn]:
    """A multi-turn chat: ``num_conversations`` conversations of ``num_turns`` turns, each turn's prompt the
    conversation so far (every earlier user turn and its reply) plus a new user turn, so turn k + 1's prompt
    starts with all of turn k's (what a prefix cache can reuse). Replies are recorded text (held-out code, as
    ShareGPT replays use recorded replies), not the model's output, so the list is fixed before any run.

    Arrivals interleave across conversations: the list is turn-major (every conversation's turn 1, then every
    turn 2, ...), and a turn is sent once its conversation's previous turn (``after``) has finished: a closed loop
    of users with no think time, so between two turns of one conversation the others' turns pass through the
    device pool. ``arrival_time`` is 0 for all; the driver releases a turn after its ``after``.
    Request ids are ``c{conversation}t{turn}``. Every prompt + max_tokens <= max_len (a ValueError otherwise)."""
    for name, v in (("num_conversations", num_conversations), ("num_turns", num_turns), ("max_tokens", max_tokens)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    r_user, r_reply = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    docs = _documents(256)
    history, out = [""] * num_conversations, []
    for t in range(num_turns):
        for c in range(num_conversations):
            user = _snippet(docs, *user_len, int(r_user.integers(user_len[0], user_len[1] + 1)), r_user)
            prompt = history[c] + "# user:\n" + user + "# assistant:\n"
            if len(prompt.encode("utf-8")) + max_tokens > max_len:
                raise ValueError(f"multi_turn_chat: conversation {c}'s turn {t} is {len(prompt.encode())} bytes, "
                                 f"over max_len = {max_len} with max_tokens = {max_tokens}; use fewer turns or "
                                 f"shorter user_len / reply_len")
            out.append(ChatTurn(f"c{c}t{t}", prompt, max_tokens, 0.0, conversation=c, turn=t,
                                after=f"c{c}t{t - 1}" if t else None))
            reply = _snippet(docs, *reply_len, int(r_reply.integers(reply_len[0], reply_len[1] + 1)), r_reply)
            history[c] = prompt + reply
    return out


# -- prefix-heavy workloads (bench prefix: RadixAttention's few-shot and tree-of-thought, Zheng et al. 2024, §6) -----
def few_shot(num_templates: int = 8, num_questions: int = 6, seed: int = 0, template_len=(224, 256),
             question_len=(16, 40), max_tokens: int = 8, max_len: int = 512) -> list[WorkloadRequest]:
    """Few-shot prompting: ``num_templates`` templates (a long run of held-out code, the shared "examples") x
    ``num_questions`` questions each (a short snippet after the template), every prompt = template + question.
    Arrivals interleave the templates: the list is question-major (question 0 of every template, then question 1,
    ...), all at t = 0, so FCFS runs them round-robin across templates while a cache-aware order can group them.
    Request ids are ``t{template}q{question}``. Every prompt + max_tokens <= max_len (a ValueError otherwise)."""
    _check_counts(num_templates=num_templates, num_questions=num_questions, max_tokens=max_tokens)
    if template_len[1] + question_len[1] + max_tokens > max_len:
        raise ValueError(f"few_shot: template_len {template_len} + question_len {question_len} + max_tokens "
                         f"{max_tokens} exceeds max_len = {max_len}")
    r_tpl, r_q = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    docs = _documents(max(2 * template_len[1], 256))
    templates = [_snippet(docs, *template_len, int(r_tpl.integers(template_len[0], template_len[1] + 1)), r_tpl)
                 for _ in range(num_templates)]
    return [WorkloadRequest(f"t{k}q{m}", templates[k] + "# question:\n" + _snippet(
                docs, *question_len, int(r_q.integers(question_len[0], question_len[1] + 1)), r_q), max_tokens, 0.0)
            for m in range(num_questions) for k in range(num_templates)]


def tree_of_thought(num_trees: int = 4, branches: int = 3, seed: int = 0, root_len=(160, 192),
                    thought_len=(32, 64), max_tokens: int = 8, max_len: int = 512) -> list[WorkloadRequest]:
    """Tree-of-thought: ``num_trees`` problems, each a root prompt; then ``branches`` thoughts on it (root +
    thought i), then ``branches`` thoughts on each of those (root + thought i + thought j): 1 + b + b^2 requests a
    tree. Thoughts are recorded text (held-out code), so the list is fixed before any run. Arrivals interleave the
    trees level by level (every root, then every first-level branch, ...), all at t = 0. Request ids are
    ``x{tree}``, ``x{tree}.{i}``, ``x{tree}.{i}.{j}``."""
    _check_counts(num_trees=num_trees, branches=branches, max_tokens=max_tokens)
    if root_len[1] + 2 * (thought_len[1] + 12) + max_tokens > max_len:
        raise ValueError(f"tree_of_thought: root_len {root_len} + two thoughts of {thought_len} + max_tokens "
                         f"{max_tokens} exceeds max_len = {max_len}")
    r_root, r_th = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    docs = _documents(256)

    def text(lo_hi, rng):
        return _snippet(docs, *lo_hi, int(rng.integers(lo_hi[0], lo_hi[1] + 1)), rng)

    levels = [[(f"x{t}", text(root_len, r_root)) for t in range(num_trees)]]
    for _ in range(2):                      # each level: every node of the one above grows `branches` thoughts
        levels.append([(f"{rid}.{i}", prompt + f"# thought {i}:\n" + text(thought_len, r_th))
                       for rid, prompt in levels[-1] for i in range(branches)])
    by_tree = [[[(rid, p) for rid, p in lvl if rid.split(".")[0] == f"x{t}"] for t in range(num_trees)]
               for lvl in levels]
    out = []
    for lvl in by_tree:                     # level-major, trees interleaved within a level
        for i in range(max(len(nodes) for nodes in lvl)):
            out += [WorkloadRequest(nodes[i][0], nodes[i][1], max_tokens, 0.0) for nodes in lvl if i < len(nodes)]
    return out


def _check_counts(**counts) -> None:
    for name, v in counts.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


PREFIX_WORKLOADS = {"few-shot": few_shot, "tree-of-thought": tree_of_thought, "multi-turn": multi_turn_chat}
