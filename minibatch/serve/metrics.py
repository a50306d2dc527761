"""Prometheus metrics under vLLM's names, so a Grafana board made for ``vllm serve`` reads minibatch too.

Everything is computed from what the engine already reports: the ``StepTrace``
of each step (running and waiting requests, blocks in use, preemptions, prefix
cache counts, tokens in the batch) and the ``RequestMetrics`` of each request
(TTFT, time per output token, end-to-end latency). Every metric carries vLLM's
``model_name`` label. Each server has its own registry, so two servers in one
process (tests, a notebook) never mix their counts.

Units follow vLLM: seconds for times, tokens for the prefix-cache counters
(minibatch counts full blocks, so hits and queries are multiples of the block
size), a fraction in [0, 1] for ``vllm:kv_cache_usage_perc``.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's bucket edges (vllm/v1/metrics/loggers.py), trimmed to what a CPU toy can reach
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]


def request_id_of(seq_id: str) -> str:
    """A sequence id is "<request id>" (n = 1) or "<request id>.<i>"; the server's ids hold no dot."""
    return seq_id.split(".", 1)[0]


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, lab = self.registry, ["model_name"]

        def gauge(name, doc):
            return Gauge(name, doc, lab, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, lab, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.hit_rate = gauge("vllm:gpu_prefix_cache_hit_rate",
                              "Prefix cache hit rate since start: hits / queries (vLLM V0's name).")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.success = Counter("vllm:request_success", "Count of finished requests, by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.", TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                             LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS)
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)         # present at 0 from the start
        self._hits = self._queries = 0

    # -- called on the engine thread (thread mode) or the engine core's reader thread (process mode) ----
    def observe_step(self, trace) -> None:
        """A StepTrace hook: the per-step gauges and counters."""
        self.running.set(len({request_id_of(s) for s in trace.running}))
        self.waiting.set(len({request_id_of(s) for s in trace.waiting}))
        self.kv_usage.set(1.0 - trace.num_free_blocks / trace.num_blocks)
        if trace.preempted:
            self.preemptions.inc(len(trace.preempted))
        self.iteration_tokens.observe(trace.num_batched_tokens)
        bs = trace.block_size
        if trace.prefix_cache_queries > self._queries:
            self.prefix_queries.inc((trace.prefix_cache_queries - self._queries) * bs)
            self.prefix_hits.inc((trace.prefix_cache_hits - self._hits) * bs)
            self._hits, self._queries = trace.prefix_cache_hits, trace.prefix_cache_queries
            self.hit_rate.set(self._hits / self._queries)

    def observe_first_token(self, metrics) -> None:
        """On the engine thread, at a request's first output (generation tokens are counted there too,
        from the outputs: a parallel-sampling fork's first token is in no SeqStep)."""
        self.prompt_tokens.inc(metrics.num_prompt_tokens)
        if metrics.ttft is not None:
            self.ttft.observe(metrics.ttft)

    def observe_output(self, out, seen) -> int:
        """A RequestOutput reached the front end; ``seen``: its output tokens counted so far (None: its first
        output). Returns the new count (a stop string can cut tokens off, so it never goes down)."""
        total = sum(len(o.token_ids) for o in out.outputs)
        if seen is None:
            self.observe_first_token(out.metrics)
        if total > (seen or 0):
            self.generation_tokens.inc(total - (seen or 0))
        if out.finished:
            self.observe_finished(out.metrics, out.outputs[0].finish_reason)
        return max(total, seen or 0)

    def observe_finished(self, metrics, finish_reason: str) -> None:
        self.success.labels(self.model_name, finish_reason or "abort").inc()
        if metrics.e2e_latency is not None:
            self.e2e.observe(metrics.e2e_latency)
        if metrics.tpot is not None:
            self.tpot.observe(metrics.tpot)
        if metrics.queue_time is not None:
            self.queue_time.observe(metrics.queue_time)

    def observe_idle(self, num_free_blocks: int, num_blocks: int) -> None:
        """Nothing left to step (e.g. the last request was aborted between steps): no step will reset these."""
        self.running.set(0)
        self.waiting.set(0)
        self.kv_usage.set(1.0 - num_free_blocks / num_blocks)

    def render(self) -> bytes:
        return generate_latest(self.registry)
