"""The latency-load curve: Poisson arrivals at a sweep of request rates, static vs continuous batching.

    python -m minibatch.bench online [--rates 2,4,8,16,32 --num-requests 64 --max-num-seqs 16 --out out/online.png]

Why: offline throughput hides what a user feels. Under a load that arrives over time, a static batch
makes every newcomer wait for the whole running batch to finish, and keeps finished members' slots
idle meanwhile (padding), so it saturates at a lower rate, and past that rate its queue, hence latency,
grows without bound. Continuous batching admits a request the step a slot frees (Yu et al., Orca, OSDI'22,
Sec. 3), so its latency stays flat up to a higher rate. This is the picture of Kwon et al. (vLLM, SOSP'23,
Fig. 12): normalised latency against request rate. Here, one PNG of three panels against the rate:
  normalised latency   mean over requests of e2e latency / output tokens (s per token; vLLM's metric);
  TTFT p50 and p99     arrival to first token: queueing plus prefill;
  throughput           output tokens/s over the run, beside the offered load (rate x mean output tokens).

Every rate draws the same requests (prompts, output lengths) and only rescales their arrival times
(``make_workload`` keeps its random streams apart). At each rate the schedulers run alternately
(static, continuous, static, ...) through ``run_workload`` on the real clock, ``--repeats`` times each;
a row keeps the run of lowest normalised latency (noise only slows) and shows the min-max spread.

``--simulate h100:llama-3-8b`` runs the arrivals on the simulated clock instead (``minibatch.perf``: each
step re-timed on that GPU and model; one run per point, since that clock does not vary), and
``--slo ttft=0.5,tpot=0.05`` adds goodput: requests/s that meet both SLOs, and per scheduler the highest
rate whose SLO attainment is >= 90 % (DistServe, Zhong et al., OSDI 2024, Sec. 2). Tables and the plot
say which clock they show.
"""
from __future__ import annotations

import argparse
import pathlib

import numpy as np

from minibatch.bench.run import run_workload
from minibatch.bench.workload import WORKLOADS, describe, make_workload
from minibatch.model.weights import load_model
from minibatch.stats import per_request, request_stats

SCHEDULERS = ("static", "continuous")
STYLE = {"static": dict(color="tab:orange", marker="s"), "continuous": dict(color="tab:blue", marker="o")}


def parse_rates(text: str) -> list[float]:
    """"2,4,8" -> [2.0, 4.0, 8.0]: numbers > 0 (requests per second), no repeats, sorted."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates must be comma-separated numbers (requests/s), got {text!r}")
    if not rates or any(not (r > 0 and np.isfinite(r)) for r in rates) or len(set(rates)) != len(rates):
        raise argparse.ArgumentTypeError(f"rates must be distinct finite numbers > 0 (requests/s), got {text!r}")
    return sorted(rates)


def normalised_latency(outs: dict) -> float:
    """Mean over requests of e2e latency / output tokens (Kwon et al. 2023, Sec. 6.1), seconds per token."""
    xs = [o.metrics.e2e_latency / max(o.metrics.num_output_tokens, 1) for o in outs.values()]
    return float(np.mean(xs))


def parse_slo(text: str) -> dict:
    """'ttft=0.5,tpot=0.05' -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    try:
        slo = {k.strip(): float(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--slo takes ttft=SECONDS,tpot=SECONDS, got {text!r}") from None
    if not slo or set(slo) - {"ttft", "tpot"} or any(not v > 0 for v in slo.values()):
        raise argparse.ArgumentTypeError(f"--slo takes ttft and/or tpot, each > 0 seconds, got {text!r}")
    return slo


def sweep(model, rates, num_requests, seed, repeats, workload="longtail", slo=None, **engine_kwargs) -> dict:
    """{(scheduler, rate): summary of the kept run, with "norm_latency" and the spreads over repeats}."""
    results = {}
    for rate in rates:
        wl = make_workload(workload, num_requests=num_requests, seed=seed, arrival="poisson", rate=rate)
        runs = {s: [] for s in SCHEDULERS}
        for _ in range(repeats):
            for s in SCHEDULERS:
                summary, traces, outs = run_workload(model, wl, scheduling=s, **engine_kwargs)
                if engine_kwargs.get("simulate"):           # the simulated clock: per request from the traces
                    arr = {r.request_id: r.arrival_time for r in wl}
                    reqs = per_request(traces, "simulated", arr).values()
                    norm = float(np.mean([r["e2e"] / max(r["output_tokens"], 1) for r in reqs]))
                    if slo:
                        summary = {**summary, **{k: v for k, v in request_stats(traces, "simulated", arr, slo).items()
                                                 if k in ("goodput", "slo_attainment")}}
                else:
                    norm = normalised_latency(outs)
                    if slo:
                        summary = {**summary, **wall_goodput(outs, slo, summary["wall_time"])}
                runs[s].append({**summary, "norm_latency": norm})
        for s, rs in runs.items():
            best = min(rs, key=lambda r: r["norm_latency"])
            results[(s, rate)] = {**best, "rate": rate, "scheduler": s,
                                  "norm_latency_range": (min(r["norm_latency"] for r in rs),
                                                         max(r["norm_latency"] for r in rs)),
                                  "throughput_range": (min(r["output_tokens_per_s"] for r in rs),
                                                       max(r["output_tokens_per_s"] for r in rs))}
    return results


def _x(ratio: float) -> str:
    """A ratio with two decimals, or two significant digits below 0.1 (0.0031x, not 0.00x)."""
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.2g}x"


def wall_goodput(outs: dict, slo: dict, wall_time: float) -> dict:
    """SLO attainment and goodput on the wall clock, from the requests' measured TTFT and TPOT (the simulated
    clock's come from ``minibatch.stats.request_stats``, the same definition on the traces)."""
    good = sum(1 for o in outs.values() if o.metrics.ttft <= slo.get("ttft", float("inf"))
               and (o.metrics.tpot or 0.0) <= slo.get("tpot", float("inf")))
    return {"slo_attainment": good / len(outs), "goodput": good / wall_time}


def format_results(results: dict, slo=None) -> str:
    """One line per (rate, scheduler), then continuous/static per rate (and goodput with an SLO)."""
    table = [("rate", "scheduler", "out tok/s (min-max)", "norm lat ms/tok (min-max)", "TTFT p50", "TTFT p99",
              "e2e p99", "occupancy") + (("SLO met", "goodput req/s") if slo else ())]
    rates = sorted({r for _, r in results})
    for rate in rates:
        for s in SCHEDULERS:
            r = results[(s, rate)]
            (tlo, thi), (llo, lhi) = r["throughput_range"], r["norm_latency_range"]
            table.append((f"{rate:g}", s, f"{r['output_tokens_per_s']:.0f} ({tlo:.0f}-{thi:.0f})",
                          f"{1e3 * r['norm_latency']:.1f} ({1e3 * llo:.1f}-{1e3 * lhi:.1f})",
                          f"{r['ttft_p50']:.2f}s", f"{r['ttft_p99']:.2f}s", f"{r['e2e_p99']:.1f}s",
                          f"{r['mean_occupancy']:.0%}")
                         + ((f"{r['slo_attainment']:.0%}", f"{r['goodput']:.2f}") if slo else ()))
    widths = [max(len(row[j]) for row in table) for j in range(len(table[0]))]
    lines = ["  ".join(c.ljust(w) if j == 1 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths)))
             for row in table]
    lines.insert(1, "-" * len(lines[0]))
    clock = next(iter(results.values())).get("clock", "wall")
    lines.insert(0, f"clock: {clock}" + (" (minibatch.perf's cost model, not measured)" if clock == "simulated"
                                         else " (measured on this machine)"))
    lines.append("\ncontinuous / static, per rate (normalised latency and TTFT below 1: continuous is faster)")
    for rate in rates:
        c, s = results[("continuous", rate)], results[("static", rate)]
        lines.append(f"{rate:>6g} req/s: throughput {_x(c['output_tokens_per_s'] / s['output_tokens_per_s'])}, "
                     f"normalised latency {_x(c['norm_latency'] / s['norm_latency'])}, "
                     f"TTFT p99 {_x(c['ttft_p99'] / s['ttft_p99'])}")
    if slo:
        lines.append(f"\ngoodput (DistServe): the highest rate whose SLO attainment is >= 90% "
                     f"({', '.join(f'{k} <= {v:g} s' for k, v in slo.items())})")
        for s in SCHEDULERS:
            ok = [rate for rate in rates if results[(s, rate)]["slo_attainment"] >= 0.9]
            lines.append(f"  {s:<11} {max(ok):g} req/s" if ok else f"  {s:<11} none of the rates tried")
    return "\n".join(lines)


def _one_two_five(v, _pos=None) -> str:
    """Log-axis tick labels as plain numbers, on 1, 2 and 5 times a power of ten only (0.02, not 2e-2)."""
    mantissa = v / 10 ** np.floor(np.log10(v)) if v > 0 else 0
    return f"{v:g}" if any(abs(mantissa - m) < 1e-6 for m in (1, 2, 5)) else ""


def plot(results: dict, path, title: str, mean_output: float) -> pathlib.Path:
    """Three panels against the request rate (log 2 axis): normalised latency, TTFT p50/p99, throughput."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter
    rates = sorted({r for _, r in results})
    fig = Figure(figsize=(15, 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax_lat, ax_ttft, ax_thr = fig.subplots(1, 3)
    for s in SCHEDULERS:
        rs = [results[(s, r)] for r in rates]
        st = STYLE[s]
        lo, hi = zip(*(r["norm_latency_range"] for r in rs))
        ax_lat.plot(rates, [r["norm_latency"] for r in rs], label=s, **st)
        ax_lat.fill_between(rates, lo, hi, color=st["color"], alpha=0.15, linewidth=0)
        ax_ttft.plot(rates, [r["ttft_p50"] for r in rs], label=f"{s} p50", **st)
        ax_ttft.plot(rates, [r["ttft_p99"] for r in rs], label=f"{s} p99", linestyle="--",
                     markerfacecolor="white", **st)
        ax_thr.plot(rates, [r["output_tokens_per_s"] for r in rs], label=s, **st)
    top = 1.35 * max(r["output_tokens_per_s"] for r in results.values())
    ax_thr.plot(rates, [r * mean_output for r in rates], color="grey", linestyle=":",
                label="offered load (rate x mean output)")                   # leaves the panel once saturated
    for ax, ylabel, name in ((ax_lat, "normalised latency (s / output token)", "Normalised latency"),
                             (ax_ttft, "time to first token (s)", "TTFT, p50 (solid) and p99 (dashed)"),
                             (ax_thr, "throughput (output tokens / s)", "Throughput")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.set_xlabel("request rate (requests / s, Poisson)")
        ax.set_ylabel(ylabel)
        ax.set_title(name)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=9)
    for ax in (ax_lat, ax_ttft):                       # latencies span decades: log, with plain numbers
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(_one_two_five))
        ax.yaxis.set_minor_formatter(FuncFormatter(_one_two_five))
    ax_thr.set_ylim(0, top)
    fig.suptitle(title)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minibatch.bench online", description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=parse_rates, default=[2.0, 4.0, 8.0, 16.0, 32.0], help="requests/s, e.g. 2,4,8")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--workload", default="longtail", choices=list(WORKLOADS))
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per scheduler and rate")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default="out/online.png", help="the PNG to write")
    ap.add_argument("--simulate", default=None, metavar="HW:MODEL",
                    help="run the arrivals on a simulated clock, e.g. h100:llama-3-8b (minibatch.perf)")
    ap.add_argument("--slo", type=parse_slo, default=None, metavar="ttft=S,tpot=S",
                    help="goodput at these SLOs (seconds), e.g. ttft=0.5,tpot=0.05")
    args = ap.parse_args(argv)
    for name in ("num_requests", "max_num_seqs", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.out.lower().endswith(".png"):
        ap.error(f"--out must name a .png file, got {args.out!r}")
    model = load_model("target", device=args.device)
    kw = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              block_size=args.block_size, simulate=args.simulate)
    if args.simulate:
        args.repeats = 1                               # the simulated clock does not vary
    wl = make_workload(args.workload, num_requests=args.num_requests, seed=args.seed, arrival="poisson",
                       rate=args.rates[0])
    print(f"device: {model.device}; {args.max_num_seqs} slots; rates {args.rates} requests/s, Poisson; "
          f"best of {args.repeats} alternating runs (min-max)\nthe same requests at every rate, arrivals "
          f"compressed by the rate; at {args.rates[0]:g} requests/s: {describe(wl)}")
    run_workload(model, make_workload(args.workload, num_requests=4, seed=args.seed), **kw)   # warm-up, offline
    results = sweep(model, args.rates, args.num_requests, args.seed, args.repeats, args.workload, args.slo, **kw)
    print(format_results(results, args.slo))
    mean_out = float(np.mean([r.max_tokens for r in wl]))
    title = (f"{args.num_requests} {args.workload} requests (mean {mean_out:.0f} output tokens), Poisson arrivals, "
             f"{args.max_num_seqs} slots, " + (f"simulated clock: {args.simulate}" if args.simulate
                                               else f"wall clock: {model.device.type}"))
    print(f"\nwrote {plot(results, args.out, title, mean_out)}")
    return 0
