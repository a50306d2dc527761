"""Load generator: Poisson arrivals against a running ``python -m minibatch serve``, through the ``openai`` client.

    python -m minibatch.bench serve --rate 20 --duration 30 --concurrency 32 [--base-url http://127.0.0.1:8000/v1]
    python -m minibatch.bench serve --peer vllm --rate 4 --num-requests 48 --duration 30 --repeats 3

Arrivals form a Poisson process (exponential gaps of mean 1 / rate), as users
sending requests at times nobody chooses do; that is the situation continuous
batching is for. At most ``--concurrency`` requests are in flight (the others
wait at the client, as behind a connection pool), and the run is bounded
twice: no arrival after ``--duration`` seconds or past ``--num-requests``, and
nothing waited for past ``--timeout`` seconds more. Every request streams, so
the time to first token (TTFT) is measured where a user feels it: the first
text chunk at the client. As vLLM's ``benchmark_serving``, it reports request
and output-token throughput, TTFT, time per output token (TPOT) and end-to-end
latency percentiles, and the errors by kind; and it plots them to a PNG.
Prompts are windows of held-out standard-library source, seeded.

Beside the client's means it prints the server's own, from its /metrics
histograms scraped before and after the run (vLLM's
``vllm:time_to_first_token_seconds`` and ``vllm:time_per_output_token_seconds``):
the server stamps a request's arrival when its handler starts and its first
token when it is sampled, so the client's TTFT can only be longer, by the HTTP
path and whatever the server makes it wait for (issue 35: with the engine in a
thread of the server's process, the event loop's wait for the GIL).

``--peer vllm`` measures that gap against vLLM's own on the same weights and machine (issue 47, item 5): it
starts ``python -m minibatch serve`` (or uses ``--base-url``) and vLLM's server on the exported target
(``minibatch/bench/vllm_serve.py``), sends each the same seeded load, alternating which goes first, for
``--repeats`` rounds (round i's load seeded seed + i: a fresh one, so neither server's prefix cache holds it),
and prints one table: per server, the client's TTFT mean, p50 and p90, the server's own TTFT mean, the gap,
both TPOTs, and minibatch's gap over vLLM's, medians over the rounds with their min-max.
"""
from __future__ import annotations

import argparse
import asyncio
import pathlib
import random
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass
class Result:
    arrival: float                   # planned arrival, seconds from the start
    sent: float = 0.0                # when it left the client (after waiting for a concurrency slot)
    first_token: Optional[float] = None
    end: Optional[float] = None
    output_tokens: int = 0
    error: Optional[str] = None
    chunk_times: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None


def make_prompts(n: int, seed: int = 0, min_len: int = 16, max_len: int = 96) -> list:
    from minibatch.model.data import val_documents
    docs = val_documents(16, min_len=max_len * 2, seed=seed)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = docs[rng.randrange(len(docs))]
        length = rng.randint(min_len, max_len)
        start = rng.randrange(len(d) - length)
        out.append(d[start:start + length].decode("utf-8", "ignore") or "def f(x):")
    return out


def arrival_times(rate: float, duration: float, max_requests: int, seed: int = 0) -> list:
    """A Poisson process on [0, duration): exponential gaps of mean 1 / rate; at most max_requests."""
    rng, t, out = random.Random(seed), 0.0, []
    while len(out) < max_requests:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        out.append(t)
    return out


async def _one(client, model, prompt, max_tokens, temperature, r: Result, t0: float, slots) -> None:
    async with slots:
        r.sent = time.perf_counter() - t0
        try:
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                     temperature=temperature, stream=True,
                                                     stream_options={"include_usage": True})
            async for chunk in stream:
                now = time.perf_counter() - t0
                if chunk.choices and chunk.choices[0].text:
                    if r.first_token is None:
                        r.first_token = now
                    r.chunk_times.append(now)
                if chunk.usage is not None:
                    r.output_tokens = chunk.usage.completion_tokens
            r.end = time.perf_counter() - t0
        except Exception as e:                                   # counted, by kind: the report says which
            r.error = f"{type(e).__name__}: {str(e)[:200]}"


async def run_load(base_url: str, rate: float, duration: float, concurrency: int, num_requests: int = 1000,
                   max_tokens: tuple = (8, 48), temperature: float = 0.0, seed: int = 0,
                   timeout: float = 60.0) -> dict:
    """Drive the server; returns {"results": [Result], "wall": seconds, "model": name}."""
    import openai
    client = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=timeout)
    model = (await client.models.list()).data[0].id
    times = arrival_times(rate, duration, num_requests, seed)
    prompts = make_prompts(len(times), seed)
    rng = random.Random(seed + 1)
    results = [Result(a) for a in times]
    slots = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()
    tasks = []
    for r, p in zip(results, prompts):
        delay = r.arrival - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_one(client, model, p, rng.randint(*max_tokens), temperature, r, t0, slots)))
    done, late = await asyncio.wait(tasks, timeout=timeout) if tasks else (set(), set())
    for t in late:
        t.cancel()
    for r in results:
        if r.end is None and r.error is None:
            r.error = f"Timeout: unfinished {timeout:.0f} s after the last arrival"
    wall = time.perf_counter() - t0
    await client.close()
    return {"results": results, "wall": wall, "model": model}


def _pct(xs, qs=(50, 90, 99)) -> dict:
    return {f"p{q}": float(np.percentile(xs, q)) for q in qs} if len(xs) else {f"p{q}": float("nan") for q in qs}


def summarize(run: dict) -> dict:
    res, wall = run["results"], run["wall"]
    ok = [r for r in res if r.ok]
    ttft = [r.first_token - r.sent for r in ok if r.first_token is not None]
    e2e = [r.end - r.sent for r in ok]
    tpot = [(r.end - r.first_token) / (r.output_tokens - 1) for r in ok if r.first_token and r.output_tokens > 1]
    errors: dict = {}
    for r in res:
        if r.error:
            kind = r.error.split(":", 1)[0]
            errors[kind] = errors.get(kind, 0) + 1
    tokens = sum(r.output_tokens for r in ok)
    return {"requests": len(res), "completed": len(ok), "errors": errors, "num_errors": len(res) - len(ok),
            "wall_s": wall, "request_throughput": len(ok) / wall if wall else 0.0, "output_tokens": tokens,
            "output_token_throughput": tokens / wall if wall else 0.0,
            "ttft_s": _pct(ttft), "tpot_s": _pct(tpot), "e2e_latency_s": _pct(e2e),
            "mean_ttft_s": float(np.mean(ttft)) if ttft else float("nan"),
            "mean_tpot_s": float(np.mean(tpot)) if tpot else float("nan"),
            "mean_e2e_latency_s": float(np.mean(e2e)) if e2e else float("nan")}


def format_summary(s: dict) -> str:
    ms = lambda d: "  ".join(f"{k} {v * 1000:8.1f} ms" for k, v in d.items())   # noqa: E731
    lines = [f"requests     {s['completed']} completed of {s['requests']}, {s['num_errors']} errors "
             f"{s['errors'] or ''}".rstrip(),
             f"wall         {s['wall_s']:.2f} s",
             f"throughput   {s['request_throughput']:.2f} requests/s, "
             f"{s['output_token_throughput']:.1f} output tokens/s ({s['output_tokens']} tokens)",
             f"TTFT         {ms(s['ttft_s'])}",
             f"TPOT         {ms(s['tpot_s'])}",
             f"latency      {ms(s['e2e_latency_s'])}"]
    return "\n".join(lines)


def server_histograms(base_url: str) -> Optional[dict]:
    """{"ttft": (sum, count), "tpot": (sum, count)} of the server's histograms (None: it has no /metrics)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    try:
        r = httpx.get(base_url.rstrip("/").removesuffix("/v1") + "/metrics", timeout=10)
    except httpx.TransportError:
        return None
    if r.status_code != 200:
        return None
    out = {"ttft": [0.0, 0.0], "tpot": [0.0, 0.0]}
    names = {"vllm:time_to_first_token_seconds": "ttft", "vllm:time_per_output_token_seconds": "tpot",
             "vllm:request_time_per_output_token_seconds": "tpot"}        # vLLM 0.32's name of the same
    for fam in text_string_to_metric_families(r.text):
        for smp in fam.samples:
            base, _, part = smp.name.rpartition("_")
            if base in names and part in ("sum", "count"):
                out[names[base]][part == "count"] += smp.value
    return {k: tuple(v) for k, v in out.items()}


def server_means(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """The server's mean TTFT and TPOT (seconds) over the requests between two scrapes."""
    if before is None or after is None:
        return None
    means = {}
    for k in ("ttft", "tpot"):
        n = after[k][1] - before[k][1]
        means[f"mean_{k}_s"] = (after[k][0] - before[k][0]) / n if n else float("nan")
    return means


def format_comparison(s: dict, server: Optional[dict]) -> str:
    line = f"client       TTFT mean {s['mean_ttft_s'] * 1e3:8.1f} ms  TPOT mean {s['mean_tpot_s'] * 1e3:8.2f} ms"
    if server is None:
        return line + "   (the server has no /metrics)"
    return (line + f"\nserver       TTFT mean {server['mean_ttft_s'] * 1e3:8.1f} ms  TPOT mean "
                   f"{server['mean_tpot_s'] * 1e3:8.2f} ms   (its /metrics histograms, over the same requests)\n"
                   f"client/server TTFT {s['mean_ttft_s'] / server['mean_ttft_s']:.2f}x  TPOT "
                   f"{s['mean_tpot_s'] / server['mean_tpot_s']:.2f}x")


def plot(run: dict, summary: dict, path) -> pathlib.Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from minibatch.viz.common import PHASE_COLORS
    res = run["results"]
    ok = [r for r in res if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    ax = axes[0]                                          # each request: client wait, to first token, to end
    for i, r in enumerate(res):
        if r.sent > r.arrival:
            ax.plot([r.arrival, r.sent], [i, i], color=PHASE_COLORS["waiting"], lw=1.2)
        if r.ok:
            ax.plot([r.sent, r.first_token or r.end], [i, i], color=PHASE_COLORS["prefill"], lw=1.2)
            ax.plot([r.first_token or r.end, r.end], [i, i], color=PHASE_COLORS["decode"], lw=1.2)
        else:
            ax.plot([r.sent], [i], "x", color=PHASE_COLORS["preempted"])
    ax.set(xlabel="seconds since start", ylabel="request (by arrival)",
           title="each request: client queue (grey),\nwaiting for its first token (blue), streaming (green)")
    ax = axes[1]                                          # CDFs of TTFT and latency
    for name, xs, c in (("TTFT", [r.first_token - r.sent for r in ok if r.first_token], PHASE_COLORS["prefill"]),
                        ("end-to-end latency", [r.end - r.sent for r in ok], PHASE_COLORS["decode"])):
        xs = np.sort(xs)
        if len(xs):
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", color=c, label=name)
    ax.set(xlabel="seconds", ylabel="fraction of requests", ylim=(0, 1.02),
           title=f"TTFT p50 {summary['ttft_s']['p50'] * 1e3:.0f} ms, p99 {summary['ttft_s']['p99'] * 1e3:.0f} ms\n"
                 f"latency p50 {summary['e2e_latency_s']['p50']:.2f} s, p99 {summary['e2e_latency_s']['p99']:.2f} s")
    ax.legend(loc="lower right")
    ax = axes[2]                                          # output tokens per second, 0.5 s bins, and in flight
    end = max([r.end for r in ok] + [1.0])
    bins = np.arange(0, end + 0.5, 0.5)
    chunks = np.concatenate([r.chunk_times for r in ok]) if ok else np.array([])
    counts, _ = np.histogram(chunks, bins)
    ax.bar(bins[:-1], counts / 0.5, width=0.5, align="edge", color=PHASE_COLORS["decode"], label="text chunks / s")
    ax2 = ax.twinx()
    inflight = [sum(1 for r in ok if r.sent <= t < r.end) for t in bins]
    ax2.plot(bins, inflight, color="#332288", label="requests in flight")
    ax2.set_ylabel("requests in flight")
    ax.set(xlabel="seconds since start", ylabel="streamed chunks (tokens) / s",
           title=f"{summary['output_token_throughput']:.0f} output tokens/s over the run\n"
                 f"{summary['num_errors']} errors")
    fig.suptitle(f"minibatch serve under Poisson load: {summary['requests']} requests, "
                 f"{summary['request_throughput']:.1f} req/s completed, model {run['model']}")
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minibatch.bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None,
                    help="the server (default http://127.0.0.1:8000/v1; with --peer, one started here)")
    ap.add_argument("--rate", type=float, default=10.0, help="mean arrivals per second (Poisson)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds during which requests arrive")
    ap.add_argument("--concurrency", type=int, default=32, help="most requests in flight at once")
    ap.add_argument("--num-requests", type=int, default=1000, help="most requests in all")
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait past the last arrival")
    ap.add_argument("--out", default="out/serve-bench.png")
    ap.add_argument("--peer", choices=["vllm"], default=None,
                    help="also vLLM's server on the same weights: the client/server TTFT gaps side by side")
    ap.add_argument("--repeats", type=int, default=1, help="--peer: rounds, alternating the servers")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="--peer: both servers' (minibatch serve's default)")
    ap.add_argument("--threads", type=int, default=1, help="--peer: model threads of both servers")
    args = ap.parse_args(argv)
    for name in ("rate", "duration", "concurrency", "num_requests", "min_tokens", "timeout", "repeats",
                 "max_num_seqs", "threads"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if args.max_tokens < args.min_tokens:
        ap.error("--max-tokens must be >= --min-tokens")
    if args.peer:                  # the servers are started there; the load is this module's, handed down
        from minibatch.bench.vllm_serve import compare
        return compare(args, lambda *a, **kw: measure(args, *a, **kw))
    args.base_url = args.base_url or "http://127.0.0.1:8000/v1"
    import openai
    try:
        s = run_and_report(args)
    except openai.APIConnectionError:
        print(f"error: no server answers at {args.base_url}; start one with `python -m minibatch serve`")
        return 2
    return 1 if s["num_errors"] else 0


def run_and_report(args) -> dict:
    before = server_histograms(args.base_url)
    run = asyncio.run(run_load(args.base_url, args.rate, args.duration, args.concurrency, args.num_requests,
                               (args.min_tokens, args.max_tokens), args.temperature, args.seed, args.timeout))
    s = summarize(run)
    s["server"] = server_means(before, server_histograms(args.base_url))
    print(f"Poisson arrivals at {args.rate}/s for {args.duration} s (at most {args.num_requests}), concurrency "
          f"{args.concurrency}, against {args.base_url} (model {run['model']})")
    print(format_summary(s))
    print(format_comparison(s, s["server"]))
    print(f"plot: {plot(run, s, args.out)}")
    return s



def measure(args, url: str, seed: int, num_requests: Optional[int] = None, rate: Optional[float] = None) -> dict:
    """One seeded load on `url` (args' settings): its summary, with the server's own means over those requests."""
    before = server_histograms(url)
    s = summarize(asyncio.run(run_load(url, rate or args.rate, args.duration, args.concurrency,
                                       num_requests or args.num_requests, (args.min_tokens, args.max_tokens),
                                       args.temperature, seed, args.timeout)))
    s["server"] = server_means(before, server_histograms(url))
    return s
