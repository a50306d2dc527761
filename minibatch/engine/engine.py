"""The engine: one iteration of continuous batching per ``step()``.

    step():  scheduler.schedule()                      who runs, with how many tokens
          -> model_runner.execute(scheduler_output)    one flat batch, one forward, sampled tokens
          -> scheduler.update_from_output(...)         append, roll back drafts, stop, free blocks
          -> proposer.propose(...)                      drafts for the *next* step (speculation)
          -> StepTrace to every hook                   recorders, renderers, live views

The step-level interface is vLLM's ``LLMEngine``: ``add_request``,
``abort_request``, ``step`` (returns the ``RequestOutput``s that changed),
``has_unfinished_requests``. ``minibatch.llm.LLM`` drives it for whole prompt lists.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
import weakref
from typing import Callable, Optional

import torch

from minibatch.sampling import logprobs
from minibatch.engine.config import EngineConfig
from minibatch.engine.cuda_graphs import make_graph_runner
from minibatch.engine.async_scheduler import PLACEHOLDER, AsyncScheduler
from minibatch.engine.memory_hierarchy import MemoryHierarchy
from minibatch.engine.model_runner import ModelRunner
from minibatch.engine.outputs import RequestOutput, request_output
from minibatch.sampling.sampler import Sampler, SamplingParams
from minibatch.engine.scheduler import Scheduler
from minibatch.engine.sequence import Request, Sequence, SequenceStatus
from minibatch.engine.static_scheduler import StaticScheduler
from minibatch.engine import threads
from minibatch.distributed.kv_transfer import KVPayload, scatter_prompt
from minibatch.kv.attention import default_backend
from minibatch.kv.block_allocator import BlockAllocator
from minibatch.kv.host_pool import HostBlockPool
from minibatch.kv.radix_allocator import RadixBlockAllocator
from minibatch.kv.kv_cache import KVCache
from minibatch.model.model import GPT
from minibatch.model.tokenizer import decode, encode
from minibatch.engine.proposers import make_proposer
from minibatch.spec_decode.typical import typical_params
from minibatch.trace import make_trace


def check_prompt(request_id: str, prompt, params: SamplingParams, n_ctx: int) -> tuple[str, list[int]]:
    """(the prompt as text, as token ids), or the error a prompt no engine could serve gets: not a str or a list
    of byte token ids, empty, or longer with its max_tokens than the context. ``LLMEngine.add_request`` and the
    disaggregated router (``disagg/router.py``) both check a request with this."""
    if isinstance(prompt, str):
        prompt_ids = encode(prompt)
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and 0 <= t < 256 for t in prompt):
        prompt_ids, prompt = list(prompt), decode(prompt)
    else:
        raise TypeError("prompt must be a str or a list of token ids in [0, 256)")
    if not prompt_ids:
        raise ValueError(f"request {request_id!r}: the prompt is empty")
    if len(prompt_ids) + params.max_tokens > n_ctx:
        raise ValueError(f"request {request_id!r}: prompt ({len(prompt_ids)} tokens) + max_tokens "
                         f"({params.max_tokens}) exceeds the context length {n_ctx}")
    return prompt, prompt_ids


# The sampling parts an engine is built with unless it is given its own (``LLMEngine(..., top_k_top_p=f,
# rejection_sample=g)``): None is the reference (the batched filter; the batched rejection sampler, greedy rows by
# argmax). ``exercises.patch_engine`` puts a student's function here, so that every engine built while it holds
# samples (exercise 3) or verifies (exercise 4) with it. Read once per engine, never per step.
TOP_K_TOP_P = None
REJECTION_SAMPLE = None


class LLMEngine:
    def __init__(self, model: GPT, config: EngineConfig = EngineConfig(), draft_model: Optional[GPT] = None, *,
                 top_k_top_p=None, rejection_sample=None):
        if config.attention_backend is None:       # chosen from the device, once (a copy: a config may be shared)
            config = dataclasses.replace(config, attention_backend=default_backend(model.device,
                                                                                   config.cuda_graph_mode))
        c, mc = config, model.config
        threads.apply(c.num_threads, model)        # CPU: threads from the model's size, or as asked
        num_blocks = c.num_blocks_for(mc.n_ctx)
        self.model, self.config = model, c
        radix = c.prefix_cache == "radix" and c.enable_prefix_caching
        self.allocator = (RadixBlockAllocator if radix else BlockAllocator)(num_blocks, c.block_size,
                                                                           c.enable_prefix_caching)
        # Static batching runs a rectangle: a finished member still computes a padding token every step
        # (as in HF generate or FasterTransformer). When that token starts a new block, its K/V goes to a
        # scratch block past the allocator's pool (ids num_blocks, ...), which no sequence ever owns.
        num_scratch = c.max_num_seqs if c.scheduling == "static" else 0
        self.tp_group = tp_cache = None
        if c.tensor_parallel_size > 1:             # the model split by heads over worker processes (distributed/)
            from minibatch.distributed.tp_engine import start
            model, tp_cache, self.tp_group = start(model, c, num_blocks + num_scratch)
            self.model = model
            weakref.finalize(self, self.tp_group.close)      # the workers stop with the engine, or at exit
        self.proposer = make_proposer(c.speculative_config, model, draft_model, c)
        # A proposer that drafts inside this cache (early exit, EAGLE) gets its scratch blocks after those,
        # and EAGLE one cache layer of its own after the target's (spec_decode/scratch.py).
        p = self.proposer
        num_draft = p.num_scratch_blocks(c.max_num_seqs, c.block_size) if p else 0
        self.kv_cache = tp_cache if tp_cache is not None else \
            KVCache(mc.n_layer + (p.extra_kv_layers if p else 0), num_blocks + num_scratch + num_draft,
                    c.block_size, mc.num_kv_heads, mc.head_dim, dtype=model.dtype, device=model.device,
                    kv_cache_dtype=c.kv_cache_dtype, scale_granularity=c.scale_granularity,
                    calculate_kv_scales=c.calculate_kv_scales)
        if p:
            p.bind(self.allocator, self.kv_cache, num_blocks + num_scratch, num_draft)
        sched = StaticScheduler if c.scheduling == "static" else AsyncScheduler if c.async_scheduling else Scheduler
        self.scheduler = sched(self.allocator, c.max_num_seqs, c.max_num_batched_tokens, c.policy, c.order,
                               c.cache_aware_max_waiting)
        self._build_hierarchy(num_blocks)
        if p:
            self.scheduler.num_lookahead_slots = p.num_lookahead_slots
            if p.tree_nodes and p.tree_nodes + 1 > min(c.max_num_batched_tokens, mc.n_ctx):
                raise ValueError(f"a token tree of {p.tree_nodes} drafts (+ its root) does not fit the token budget "
                                 f"max_num_batched_tokens={c.max_num_batched_tokens} or the context {mc.n_ctx}")
        self.model_runner = ModelRunner(model, self.kv_cache, c.block_size, c.attention_backend, c.seed,
                                        scratch_block=num_blocks,
                                        hidden_states=self.proposer.hidden_states if self.proposer else (),
                                        all_hidden=bool(self.proposer and self.proposer.all_hidden),
                                        typical=typical_params(c.speculative_config), proposer=self.proposer,
                                        sampler=Sampler(c.seed, top_k_top_p or TOP_K_TOP_P),
                                        rejection_sampler=rejection_sample or REJECTION_SAMPLE,
                                        graphs=make_graph_runner(c, model, self.kv_cache,
                                                                 bool(self.proposer and self.proposer.hidden_states)))
        self.requests: dict[str, Request] = {}     # unfinished requests only: a finished one is forgotten
        self._num_added = 0
        self.hooks: list[Callable] = []
        self.step_count, self.t0 = 0, time.perf_counter()
        # The simulated clock (EngineConfig.simulate): the cost model times each step's trace; the engine only
        # stamps the result on it and keeps the running sum (a driver may move it forward to the next arrival).
        self.cost_model, self.simulated_time = c.cost_model(), 0.0
        # Asynchronous scheduling's batch queue (vLLM V1's step_with_batch_queue, two deep): the step in flight,
        # (its scheduler output, its prepared batch, the future of its forward on the model's thread).
        self._in_flight = None
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="minibatch-model") if c.async_scheduling \
            else None

    def _build_hierarchy(self, num_blocks: int) -> None:
        """The host pool, its tensor and the scheduler's memory hierarchy, when swapping or a host tier is asked for."""
        c, kv = self.config, self.kv_cache
        per = KVCache.bytes_per_block(kv.num_layers, c.block_size, kv.num_kv_heads, kv.head_dim, kv.model_dtype,
                                      kv.kv_cache_dtype, kv.scale_granularity)
        swap, offload = c.host_blocks(per, num_blocks)
        self.host_pool, self.bytes_per_block = None, per
        if c.preemption_mode != "swap" and not offload:
            return
        self.host_pool = HostBlockPool(swap, offload, c.block_size)   # a swap space of 0 blocks: each swap recomputes
        if swap + offload:
            kv.allocate_host(swap + offload)
        self.scheduler.hierarchy = MemoryHierarchy(self.host_pool, c.preemption_mode, c.kv_offload_write_policy)
        self.scheduler.hierarchy.bind(self.allocator)

    # -- requests -----------------------------------------------------------------
    def add_hook(self, fn: Callable) -> None:
        """fn(StepTrace) after every step (``minibatch.trace``)."""
        self.hooks.append(fn)

    def add_request(self, request_id: str, prompt, params: Optional[SamplingParams] = None,
                    priority: int = 0, arrival_time: Optional[float] = None) -> None:
        params = params or SamplingParams()
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        prompt, prompt_ids = check_prompt(request_id, prompt, params, self.model.config.n_ctx)
        req = Request(request_id, prompt, prompt_ids, params, priority,
                      time.perf_counter() if arrival_time is None else arrival_time, self._num_added)
        seq = Sequence(request_id if params.n == 1 else f"{request_id}.0", req, 0, list(prompt_ids),
                       num_forks_pending=params.n - 1)
        self.scheduler.check_request(seq)             # one that could never run is refused now
        req.seqs.append(seq)
        self.requests[request_id] = req
        self._num_added += 1
        self.scheduler.add(seq)

    def admit_prefilled(self, request_id: str, prompt: str, prompt_ids: list, first_token: int,
                        params: SamplingParams, kv: KVPayload, arrival_time: float, first_token_time: float,
                        generator_state: Optional[torch.Tensor] = None) -> Optional[list]:
        """A request whose prompt was prefilled elsewhere (a disaggregated prefill instance, ``disagg/``) joins
        the running batch with its first token, its prompt's K/V ``kv`` (a ``KVPayload``: [L, 2, n, Hkv, D] and the
        scales of a quantized cache) written here into fresh
        (or prefix-cached) blocks; a seeded request's generator goes on from ``generator_state``. Returns the
        request's block table; None: no room now (a seat or the blocks), try again after a step."""
        sched, alloc = self.scheduler, self.allocator
        if len(sched.running) >= self.config.max_num_seqs or not alloc.can_allocate(prompt_ids):
            return None
        req = Request(request_id, prompt, list(prompt_ids), params, arrival_time=arrival_time,
                      arrival_order=self._num_added)
        if generator_state is not None:                    # a seeded request draws on where the first draw left it
            req.generators[0].set_state(generator_state)
        req.metrics.first_scheduled_time = req.metrics.first_token_time = first_token_time
        seq = Sequence(request_id, req, 0, list(prompt_ids) + [first_token], status=SequenceStatus.RUNNING)
        cached = alloc.allocate(request_id, prompt_ids)    # prefix hits hold the same K/V already: not rewritten
        table = alloc.block_table(request_id)
        scatter_prompt(self.kv_cache, table, cached, kv, self.config.block_size)
        seq.num_computed_tokens, seq.num_cached_tokens = len(prompt_ids), cached
        alloc.mark_computed(request_id, len(prompt_ids), seq.token_ids)
        req.seqs.append(seq)
        self.requests[request_id] = req
        self._num_added += 1
        sched.running.append(seq)
        return list(table)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also at exit); an engine without them has nothing to stop."""
        if self.tp_group is not None:
            self.tp_group.close()

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(str(request_id), None)
        if req is None:
            raise KeyError(f"no unfinished request with id {request_id!r}")
        for seq in req.seqs:
            seq.num_forks_pending = 0             # n > 1 aborted before its prompt was done: no forks will come
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                if self.proposer is not None:
                    self.proposer.free(seq)
        req.metrics.finished_time = time.perf_counter()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # -- one iteration ------------------------------------------------------------
    # inference_mode, not no_grad (as vLLM's runner): tensors made here carry no version counter or view
    # tracking, a few per cent of a small model's step on a CPU. The KV cache, made outside, is written in place.
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        if self._model_thread is not None:
            return self._step_async()
        t_start, cpu_start = time.perf_counter(), time.process_time()
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could schedule nothing while requests wait: the cache or the "
                                   "token budget is too small for any of them")
            return []
        t_scheduled = time.perf_counter()
        runner_output = self.model_runner.execute(scheduler_output)
        t_executed = time.perf_counter()
        changed, finished = self.scheduler.update_from_output(scheduler_output, runner_output)
        if runner_output.logprobs or runner_output.prompt_logprobs:       # only when a request asked
            logprobs.record(scheduler_output, runner_output)
        t_propose = time.perf_counter()
        if self.proposer is not None:
            for seq in scheduler_output.preempted + scheduler_output.swapped_out + finished:
                self.proposer.free(seq)
            self.proposer.propose([s for s in self.scheduler.running if s.is_decoding], runner_output,
                                  scheduler_output)
        t_propose = time.perf_counter() - t_propose
        return self._after_update(scheduler_output, runner_output, changed, finished, t_start, cpu_start, t_propose,
                                  {"schedule_span": (t_start, t_scheduled), "forward_span": (t_scheduled, t_executed),
                                   "update_span": (t_executed, time.perf_counter())})

    def _after_update(self, scheduler_output, runner_output, changed, finished, t_start, cpu_start, t_propose,
                      spans=None) -> list[RequestOutput]:
        """The step's trace to every hook (and on the simulated clock), its outputs; finished requests forgotten."""
        if self.hooks or self.cost_model is not None:
            trace = make_trace(self, scheduler_output, runner_output, t_start, t_propose)
            trace.cpu_duration = time.process_time() - cpu_start
            for name, span in (spans or {}).items():
                setattr(trace, name, [span[0] - self.t0, span[1] - self.t0])
            if self.cost_model is not None:
                trace.simulated_time = self.simulated_time
                trace.simulated_duration = self.cost_model.step_time(trace)
                self.simulated_time += trace.simulated_duration
            for fn in self.hooks:
                fn(trace)
        self.step_count += 1
        lossless = self.model_runner.typical is None
        outputs = [request_output(req, self.proposer is not None, lossless) for req in changed]
        for req in changed:
            if req.finished:                      # its final output is in hand: a server runs for ever
                del self.requests[req.request_id]
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        """One turn of the batch queue: schedule N+1 (N's forward still running), sample N, resolve N's
        placeholders, launch N+1's forward on the model's thread, then update with N while it runs. Returns step
        N's outputs; N+1's come with the next call. An exception in a forward is raised by the call that waits
        for it, as that step's error.

        Where step N's tokens are greedy and need no sequence to take (``ModelRunner.greedy_on_worker``), the
        model's thread takes them right after N's forward and N+1 is queued behind N before the CPU waits for
        it: N+1's placeholders are filled there from N's tokens (vLLM's worker scatters its sampled tokens into
        the next step's inputs on the device), so N+1's forward starts as soon as N's ends."""
        sched, runner = self.scheduler, self.model_runner
        t0, cpu0 = time.perf_counter(), time.process_time()
        if self._in_flight is not None and self._needs_grammar():
            return self._drain()          # structured outputs: the next mask needs the grammar after step N
        nxt = sched.schedule()
        prepared = runner.prepare(nxt) if nxt.scheduled else None
        t1 = time.perf_counter()
        done, self._in_flight = self._in_flight, None
        launched, greedy = None, bool(nxt.scheduled) and runner.greedy_on_worker(nxt)
        chain = bool(nxt.scheduled) and done is not None and done[4]
        ids = [t for s in nxt.scheduled for t in s.input_token_ids] if chain else None
        fill = self._fill_from(done[0], nxt, ids) if chain else None
        if fill is not None:                          # N+1 behind N on the model's thread, its tokens from N's
            launched = self._launch(nxt, prepared, ids, greedy, (fill, done[2]))
        sampled = self._sample_in_flight(done) if done is not None else None
        if nxt.scheduled:
            if launched is None:                      # its placeholders resolved by the CPU: read them again
                ids = [t for s in nxt.scheduled for t in s.input_token_ids]
                launched = self._launch(nxt, prepared, ids, greedy)
            self._in_flight = (nxt, prepared, launched, (t0, t1), greedy)
        elif done is None and sched.has_unfinished():
            raise RuntimeError("the scheduler could schedule nothing while requests wait: the cache or the "
                               "token budget is too small for any of them")
        return [] if sampled is None else self._update_in_flight(*sampled, cpu0)

    @staticmethod
    def _fill_from(prev, nxt, ids: list) -> Optional[list]:
        """[(position in N+1's flat input ids, row of N's batch)] for each of N+1's placeholders, all of which
        must be tokens step N samples; None where one is not (then N+1 waits for the CPU's resolve)."""
        where = {s.seq.seq_id: b for b, s in enumerate(prev.scheduled) if s.placeholder_index is not None}
        fill, pos = [], 0
        for s in nxt.scheduled:
            for j in range(s.num_new_tokens):         # the sequence's input ids: ids[pos:pos + num_new_tokens]
                if ids[pos + j] == PLACEHOLDER:
                    b = where.get(s.seq.seq_id)
                    if b is None or s.num_computed_before + j != prev.scheduled[b].placeholder_index:
                        return None
                    fill.append((pos + j, b))
            pos += s.num_new_tokens
        return fill

    def _sample_in_flight(self, done) -> tuple:
        """Wait for a step in flight (its error, if any, is raised here), sample it and resolve its placeholders.
        Returns (its scheduler output, its runner output, (schedule span, forward span, update start))."""
        out, prep, future, t_sched, _ = done
        result, greedy, t_forward = future.result()
        t2 = time.perf_counter()                      # the update span starts here: sampling is the CPU's work
        runner_output = self.model_runner.finish(out, prep, result, greedy)
        self.scheduler.resolve(out, runner_output)
        return out, runner_output, (t_sched, t_forward, t2)

    def _update_in_flight(self, out, runner_output, spans, cpu0) -> list[RequestOutput]:
        """The rest of the step's update (while the next forward runs), its trace and outputs."""
        t_sched, t_forward, t2 = spans
        changed, finished = self.scheduler.update_from_output(out, runner_output)
        if runner_output.logprobs or runner_output.prompt_logprobs:
            logprobs.record(out, runner_output)
        return self._after_update(out, runner_output, changed, finished, t_sched[0], cpu0, 0.0,
                                  {"schedule_span": t_sched, "forward_span": t_forward,
                                   "update_span": (t2, time.perf_counter())})

    def _launch(self, out, prepared, ids, greedy: bool, fill=None):
        """Step N+1's copies and forward on the model's thread; its future gives (result, its greedy tokens or
        None, (start, end)). With ``fill`` = (positions, step N's future), N+1's placeholders are first filled
        from N's greedy tokens (N ran before it on this thread, so its future is done)."""
        def run():
            start = time.perf_counter()
            if fill is not None:
                prev = fill[1].result()[1]
                for pos, b in fill[0]:
                    ids[pos] = prev[b]
            result = self.model_runner.launch(out, prepared, ids)
            tokens = self.model_runner.greedy_tokens(prepared, result) if greedy else None
            return result, tokens, (start, time.perf_counter())
        return self._model_thread.submit(run)

    def _needs_grammar(self) -> bool:
        return any(s.grammar is not None for s in self.scheduler.running)

    def _drain(self) -> list[RequestOutput]:
        """Finish the step in flight before anything else is scheduled (no overlap for this one)."""
        done, self._in_flight = self._in_flight, None
        cpu0 = time.process_time()
        return self._update_in_flight(*self._sample_in_flight(done), cpu0)
