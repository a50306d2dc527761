"""The engine: one iteration of continuous batching per ``step()``.

    step():  propose drafts (speculation) -> schedule -> copy-on-write copies
             -> build the flat batch -> model forward through paged attention
             -> sample / verify -> update sequences, free finished ones -> StepTrace

The step-level interface is vLLM's ``LLMEngine``: ``add_request``,
``abort_request``, ``step`` (returns the ``RequestOutput``s that changed),
``has_unfinished_requests``. ``minibatch.llm.LLM`` drives it for whole prompt lists.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from minibatch.kv.attention import BACKENDS, AttentionMetadata, PagedAttention
from minibatch.kv.block_allocator import BlockAllocator
from minibatch.kv.kv_cache import KVCache
from minibatch.engine.outputs import RequestMetrics
from minibatch.model.model import GPT
from minibatch.spec_decode.proposer import make_proposer
from minibatch.engine.sampler import Sampler, SamplingParams, find_stop, make_generator, probabilities
from minibatch.engine.scheduler import Scheduler
from minibatch.engine.outputs import RequestOutput, completion_of
from minibatch.engine.sequence import Sequence
from minibatch.spec_decode.rejection_sampler import rejection_sample
from minibatch.spec_decode.stats import SpecStats
from minibatch.model.tokenizer import decode, encode
from minibatch.trace import SeqStep, StepTrace


@dataclass
class EngineConfig:
    block_size: int = 16
    num_gpu_blocks: Optional[int] = None       # None: room for max_num_seqs full contexts
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512          # the token budget of one step
    enable_prefix_caching: bool = True
    attention_backend: str = "torch"           # "dense", "torch" or "triton"
    scheduling: str = "continuous"             # or "static"
    policy: str = "fcfs"                       # or "priority"
    order: str = "decode-first"                # or "prefill-first"
    speculative_config: Optional[dict] = None  # {"method": "draft" | "ngram", "num_speculative_tokens": k}
    seed: int = 0                              # the generator of requests without a seed


@dataclass
class _Request:
    request_id: str
    prompt: str
    prompt_ids: list
    params: SamplingParams
    seqs: list
    metrics: RequestMetrics
    spec: SpecStats
    finished: bool = False


class LLMEngine:
    def __init__(self, model: GPT, config: EngineConfig = EngineConfig(), draft_model: Optional[GPT] = None):
        c, mc = config, model.config
        if c.attention_backend not in BACKENDS:
            raise ValueError(f"unknown attention_backend {c.attention_backend!r}; choose one of {list(BACKENDS)}")
        if not isinstance(c.max_num_seqs, int) or c.max_num_seqs < 1:    # before it sizes the cache below
            raise ValueError(f"max_num_seqs must be an int >= 1, got {c.max_num_seqs!r}")
        if c.num_gpu_blocks is None:
            num_blocks = c.max_num_seqs * math.ceil(mc.n_ctx / c.block_size)
        else:
            num_blocks = c.num_gpu_blocks
        if num_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {num_blocks}")
        self.model, self.config = model, c
        self.allocator = BlockAllocator(num_blocks, c.block_size, c.enable_prefix_caching)
        # Static batching runs a rectangle: a finished member still computes a padding token every step
        # (as in HF generate or FasterTransformer). Those tokens write their K/V into scratch blocks
        # past the allocator's pool (ids num_blocks, ...), which no sequence ever owns: one slot each.
        self.scratch_block = num_blocks
        num_scratch = math.ceil(c.max_num_seqs / c.block_size) if c.scheduling == "static" else 0
        self.kv_cache = KVCache(mc.n_layer, num_blocks + num_scratch, c.block_size,
                                mc.num_kv_heads, mc.head_dim,
                                dtype=model.dtype, device=model.device)
        self.scheduler = Scheduler(self.allocator, c.max_num_seqs, c.max_num_batched_tokens,
                                   c.policy, c.order, c.scheduling)
        self.proposer = make_proposer(c.speculative_config, model, draft_model, c)
        self.sampler = Sampler(c.seed)
        self.requests: dict[str, _Request] = {}
        self.hooks: list[Callable] = []
        self.step_count, self.t0 = 0, time.perf_counter()
        self._arrivals = 0

    # -- requests -----------------------------------------------------------------
    def add_hook(self, fn: Callable[[StepTrace], None]) -> None:
        self.hooks.append(fn)

    def add_request(self, request_id: str, prompt, params: Optional[SamplingParams] = None,
                    priority: int = 0, arrival_time: Optional[float] = None) -> None:
        params = params or SamplingParams()
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if isinstance(prompt, str):
            prompt_ids = encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and 0 <= t < 256 for t in prompt):
            prompt_ids, prompt = list(prompt), decode(prompt)
        else:
            raise TypeError("prompt must be a str or a list of token ids in [0, 256)")
        n_ctx = self.model.config.n_ctx
        if not prompt_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if len(prompt_ids) + params.max_tokens > n_ctx:
            raise ValueError(f"request {request_id!r}: prompt ({len(prompt_ids)} tokens) + max_tokens "
                             f"({params.max_tokens}) exceeds the context length {n_ctx}")
        need = self.allocator.blocks_needed(len(prompt_ids) + params.max_tokens)
        if need > self.allocator.num_blocks:
            raise ValueError(f"request {request_id!r} needs {need} blocks even alone, but the cache has only "
                             f"{self.allocator.num_blocks}: it could never finish")
        if self.config.scheduling == "static":
            probe = Sequence("probe", request_id, 0, prompt_ids, params, fork_pending=params.n - 1)
            need = self.scheduler.static_reservation(probe)
            if need > self.allocator.num_blocks:
                raise ValueError(f"request {request_id!r}: static batching reserves {need} blocks for its "
                                 f"n={params.n} sequences at full length, but the cache has only "
                                 f"{self.allocator.num_blocks}: it could never run")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"request {request_id!r}: n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        now = time.perf_counter()
        arrival = now if arrival_time is None else arrival_time
        seq = Sequence(request_id if params.n == 1 else f"{request_id}.0", request_id, 0, prompt_ids, params,
                       priority, arrival, self._arrivals, make_generator(params.seed), fork_pending=params.n - 1)
        self._arrivals += 1
        self.requests[request_id] = _Request(request_id, prompt, prompt_ids, params, [seq],
                                             RequestMetrics(arrival_time=arrival, num_prompt_tokens=len(prompt_ids)),
                                             SpecStats())
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(str(request_id))
        if req is None or req.finished:
            raise KeyError(f"no unfinished request with id {request_id!r}")
        for seq in req.seqs:
            seq.fork_pending = 0                  # n > 1 aborted before its prompt was done: no forks will come
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self._finish(seq)
        self._maybe_finish_request(req, time.perf_counter())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one iteration ------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        t_start = time.perf_counter()
        if self.proposer is not None:
            self.proposer.propose_for(self.scheduler.running)
        out = self.scheduler.schedule()
        for seq in out.preempted:
            self.requests[seq.request_id].metrics.num_preemptions += 1
            if self.proposer is not None:
                self.proposer.free(seq)
        if not out.scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could schedule nothing while requests wait: the cache or the "
                                   "token budget is too small for any of them")
            return []
        if out.cow_copies:
            self.kv_cache.copy_blocks(out.cow_copies)
        logits, rows = self._forward(out.scheduled, out.num_padding_slots)
        changed = self._update(out.scheduled, logits, rows, t_start)
        self._emit_trace(out, t_start)
        self.step_count += 1
        return [self._output(self.requests[rid]) for rid in changed]

    def _forward(self, scheduled, num_padding: int = 0):
        """Build the flat batch (input_ids[T], positions[T], metadata) and run the model once.

        ``num_padding`` (static batching): that many padding rows of one dummy token each, computed
        and thrown away, so the baseline pays for its idle slots as a rectangular batch does."""
        ids, pos, rows, logit_idx = [], [], [], []
        for s in scheduled:
            seq, start = s.seq, s.num_computed_before
            toks = seq.token_ids[start:start + s.num_tokens - len(s.spec_token_ids)] + s.spec_token_ids
            ids += toks
            pos += range(start, start + s.num_tokens)
            completes = start + s.num_tokens >= len(seq)            # reaches the end: sample
            n_rows = (1 + len(s.spec_token_ids)) if completes else 0   # decode: verify 1 + k positions
            rows.append(list(range(len(logit_idx), len(logit_idx) + n_rows)))
            logit_idx += range(len(ids) - n_rows, len(ids))
        dev = self.model.device
        tables = [self.allocator.block_table(s.seq.seq_id) for s in scheduled]
        computed, new = [s.num_computed_before for s in scheduled], [s.num_tokens for s in scheduled]
        bs = self.config.block_size
        for i in range(num_padding):          # padding row i: token 0 at scratch slot i, attending to the
            ids.append(0)                     # padding rows before it in its block (written this step)
            pos.append(i % bs)
            tables.append([self.scratch_block + i // bs])
            computed.append(i % bs)
            new.append(1)
        meta = AttentionMetadata.build(tables, computed, new, bs, dev)
        attn = PagedAttention(self.kv_cache, meta, self.config.attention_backend)
        logits = self.model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), attn,
                            logits_indices=torch.tensor(logit_idx, dtype=torch.long, device=dev))
        return logits.float(), rows

    def _update(self, scheduled, logits, rows, now) -> list:
        spec_batch = [(s, r) for s, r in zip(scheduled, rows) if r and s.phase == "decode" and self.proposer]
        plain = [(s, r) for s, r in zip(scheduled, rows) if r and not (s.phase == "decode" and self.proposer)]
        new_tokens = {}                                               # id(ScheduledSeq) -> tokens appended
        if plain:
            toks = self.sampler(logits[[r[0] for _, r in plain]], [s.seq.params for s, _ in plain],
                                [s.seq.generator for s, _ in plain])
            new_tokens.update({id(s): [t] for (s, _), t in zip(plain, toks)})
        if spec_batch:
            new_tokens.update(self._verify(spec_batch, logits))
        changed, t_now = [], time.perf_counter()
        for s in scheduled:
            seq, req = s.seq, self.requests[s.seq.request_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            toks = s.new_token_ids = new_tokens.get(id(s), [])
            # K/V now holds the fed tokens, minus rejected drafts (rolled back below)
            seq.num_computed = s.num_computed_before + s.num_tokens - len(s.spec_token_ids) + max(0, len(toks) - 1)
            if s.spec_token_ids:
                self.allocator.truncate(seq.seq_id, seq.num_computed)
            self.allocator.mark_computed(seq.seq_id, seq.num_computed)
            seq.spec_token_ids = []
            if not toks:
                continue
            if seq.fork_pending:                                      # n > 1: the prompt is done, fork
                self._fork(seq, logits[rows[scheduled.index(s)][0]])
            changed.append(seq.request_id)
            self._append(seq, toks)
        for rid in dict.fromkeys(changed):
            req = self.requests[rid]
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = t_now
            self._maybe_finish_request(req, t_now)
        return list(dict.fromkeys(changed))

    def _verify(self, spec_batch, logits) -> dict:
        """Speculative decoding: accept a prefix of the drafts, plus one target token (Leviathan et al. §2.3)."""
        k = max(len(s.spec_token_ids) for s, _ in spec_batch)
        V = logits.shape[-1]
        B = len(spec_batch)
        drafts = torch.full((B, max(k, 1)), -1, dtype=torch.long)[:, :k]
        target = torch.zeros(B, k + 1, V)
        for b, (s, r) in enumerate(spec_batch):
            drafts[b, :len(s.spec_token_ids)] = torch.tensor(s.spec_token_ids, dtype=torch.long)
            target[b, :len(r)] = probabilities(logits[r].cpu(), s.seq.params)
        q = self.proposer.draft_probs([s.seq for s, _ in spec_batch], k)
        toks, n_acc = rejection_sample(drafts, q, target, [s.seq.generator for s, _ in spec_batch],
                                       num_draft_tokens=[len(s.spec_token_ids) for s, _ in spec_batch],
                                       greedy=[s.seq.params.greedy for s, _ in spec_batch])
        result = {}
        for b, (s, _) in enumerate(spec_batch):
            a = int(n_acc[b])
            result[id(s)] = [int(t) for t in toks[b, :a + 1]]
            s.num_accepted = a
            self.requests[s.seq.request_id].spec.add(len(s.spec_token_ids), a, a + 1)
            self.proposer.on_verified(s.seq, s.num_computed_before + 1 + a)
        return result

    def _append(self, seq: Sequence, toks: list) -> None:
        seq.output_ids += toks[: seq.params.max_tokens - len(seq.output_ids)]
        cut = find_stop(seq.output_ids, seq.params.stop)
        if cut is not None:
            del seq.output_ids[cut:]
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= seq.params.max_tokens:
            seq.finish_reason = "length"
        if seq.finish_reason:
            self._finish(seq)

    def _fork(self, parent: Sequence, logits_row: torch.Tensor) -> None:
        req = self.requests[parent.request_id]
        for i in range(1, parent.fork_pending + 1):
            seed = None if parent.params.seed is None else parent.params.seed + i
            child = Sequence(f"{parent.request_id}.{i}", parent.request_id, i, parent.prompt_ids, parent.params,
                             parent.priority, parent.arrival_time, parent.arrival_order, make_generator(seed),
                             num_computed=parent.num_computed)
            self.allocator.fork(parent.seq_id, child.seq_id)           # share every block, ref counts up
            self.scheduler.on_fork(child)
            req.seqs.append(child)
            tok = self.sampler(logits_row[None], [child.params], [child.generator])
            self._append(child, tok)
        parent.fork_pending = 0

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if self.proposer is not None:
            self.proposer.free(seq)

    def _maybe_finish_request(self, req: _Request, now: float) -> None:
        req.metrics.num_output_tokens = sum(len(s.output_ids) for s in req.seqs)
        if not req.finished and all(s.is_finished for s in req.seqs) and not req.seqs[0].fork_pending:
            req.finished = True
            req.metrics.finished_time = now
            req.metrics.num_cached_tokens = req.seqs[0].num_cached_prefix

    def _output(self, req: _Request) -> RequestOutput:
        spec = req.spec.to_dict() if self.proposer is not None else None
        outs = [completion_of(s, spec) for s in sorted(req.seqs, key=lambda s: s.index)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, outs, req.finished, req.metrics)

    # -- the trace: data only, for recorders and renderers -------------------------
    def _emit_trace(self, out, t_start: float) -> None:
        if not self.hooks:
            return
        a, sched = self.allocator, self.scheduler
        steps = [SeqStep(s.seq.seq_id, s.seq.request_id, s.phase, s.num_tokens, s.num_computed_before,
                         len(s.seq.prompt_ids), len(s.seq.output_ids), s.seq.priority,
                         proposed=len(s.spec_token_ids), accepted=getattr(s, "num_accepted", 0),
                         bonus=int(bool(s.spec_token_ids) and getattr(s, "num_accepted", 0) == len(s.spec_token_ids)),
                         new_token_ids=list(getattr(s, "new_token_ids", []))) for s in out.scheduled]
        live = [s for s in sched.running if a.has_seq(s.seq_id)]
        trace = StepTrace(
            step=self.step_count, time=t_start - self.t0, duration=time.perf_counter() - t_start,
            scheduling=self.config.scheduling, scheduled=steps,
            admitted=[s.seq_id for s in out.admitted], preempted=[s.seq_id for s in out.preempted],
            finished=[s.seq.seq_id for s in out.scheduled if s.seq.is_finished],
            waiting=[s.seq_id for s in sched.waiting], running=[s.seq_id for s in sched.running],
            block_tables={s.seq_id: a.block_table(s.seq_id) for s in live},
            num_blocks=a.num_blocks, block_size=a.block_size, ref_counts=a.ref_counts(),
            cached_blocks=a.cached_block_ids(), num_free_blocks=a.num_free_blocks,
            num_batched_tokens=out.num_batched_tokens, token_budget=sched.token_budget,
            max_num_seqs=sched.max_num_seqs, num_padding_slots=out.num_padding_slots,
            prefix_cache_hits=a.hits, prefix_cache_queries=a.queries)
        for fn in self.hooks:
            fn(trace)
