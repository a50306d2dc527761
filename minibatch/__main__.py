"""Command line:  python -m minibatch generate "def fib(n):" --max-tokens 80
                 python -m minibatch generate "def fib(n):" --speculative eagle -k 4
                 python -m minibatch demo continuous --out demo.gif
                 python -m minibatch serve --port 8000      (OpenAI-compatible, like `vllm serve`)
                 python -m minibatch slides --out out/slides (reveal.js decks of the notebooks)
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def _generate(args) -> int:
    from minibatch.llm import LLM
    from minibatch.sampling.sampler import SamplingParams

    from minibatch.engine import memory_hierarchy
    from minibatch.kv import quant

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or [], n=args.n)
    spec = args.speculative_config
    if args.speculative:
        if spec is not None:
            raise ValueError("give --speculative (with -k) or --speculative-config, not both")
        spec = {"method": args.speculative, "num_speculative_tokens": args.k}
    try:
        llm = LLM(args.preset, device=args.device, attention_backend=args.backend, speculative_config=spec,
                  tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
                  cuda_graph_mode=args.cuda_graph_mode, num_gpu_blocks=args.num_gpu_blocks_override,
                  async_scheduling=args.async_scheduling, prefix_cache=args.prefix_cache,
                  scheduling_policy=args.scheduling_policy, **memory_hierarchy.config_kwargs(args),
                  **quant.config_kwargs(args))
        t = time.perf_counter()
        outs = llm.generate(list(args.prompt), params)
    except NotImplementedError as e:          # a student release whose engine exercises are not written yet
        return _generate_without_the_engine(args, params, e)
    dt = time.perf_counter() - t
    out = outs[0]
    comp = out.outputs[0]
    print(f"# minibatch · model {args.preset} ({llm.model.num_params():,} parameters) · device {llm.device} · "
          f"backend {llm.llm_engine.config.attention_backend}", file=sys.stderr)
    print(args.prompt[0] + comp.text)
    print(f"# {len(comp.token_ids)} tokens in {dt:.2f} s ({len(comp.token_ids) / dt:.1f} tokens/s), "
          f"finish reason: {comp.finish_reason}", file=sys.stderr)
    if comp.spec and comp.spec["num_steps"]:
        print(f"# speculative decoding ({spec['method']}): {comp.spec['accepted']} of {comp.spec['proposed']} drafts "
              f"accepted (acceptance rate {comp.spec['acceptance_rate']:.2f}), {comp.spec['mean_tokens_per_step']:.2f} "
              f"tokens per verify step" + ("" if comp.spec["lossless"] else "; typical acceptance: LOSSY"),
              file=sys.stderr)
    if memory_hierarchy.summary(llm.llm_engine):
        print(memory_hierarchy.summary(llm.llm_engine), file=sys.stderr)
    for prompt, o in zip(args.prompt, outs):              # more prompts, --n > 1: the other samples
        for c in o.outputs[1:] if o is out else o.outputs:
            print(f"# prompt {args.prompt.index(prompt) + 1}, sample {c.index}:\n{prompt}{c.text}")
    return 0


def _generate_without_the_engine(args, params, why) -> int:
    """The same model, one request, a contiguous KV cache (minibatch/sampling/reference.py): no serving engine."""
    from minibatch.sampling.reference import generate_with_cache
    from minibatch.model.tokenizer import decode, encode
    from minibatch.model.weights import load_model
    print(f"# the serving engine cannot run yet: {why}\n# generating without it (minibatch/sampling/reference.py: "
          f"one request, a contiguous KV cache)", file=sys.stderr)
    model = load_model(args.preset, device=args.device)
    t = time.perf_counter()
    ids, reason = generate_with_cache(model, encode(args.prompt[0]), params)
    dt = time.perf_counter() - t
    print(args.prompt[0] + decode(ids))
    print(f"# {len(ids)} tokens in {dt:.2f} s, finish reason: {reason}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minibatch", description="minibatch: LLM serving, step by step")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="complete a prompt with the shipped model")
    g.add_argument("prompt", nargs="+", help="one prompt, or several (batched together)")
    g.add_argument("--max-tokens", type=int, default=80)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    g.add_argument("--model", "--preset", dest="preset", default="target",
                   help="the shipped model: target (GPT-2), llama (RoPE, GQA), draft (--preset: the older name)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps (vLLM's flag)")
    g.add_argument("--cuda-graph-mode", default="auto", choices=["auto", "eager-replay", "compile"],
                   help="decode steps: auto (CUDA graphs on a GPU, plain on a CPU), compile (on a CPU: compiled "
                        "per batch size at start-up), eager-replay (the graphs' buffers, eagerly)")
    g.add_argument("--attention-backend", "--backend", dest="backend", default=None,
                   help="cpu, batched, loop (the teaching version) or triton (vLLM's flag; --backend, the older "
                        "name; default: cpu on a CPU where it builds, batched on a GPU)")
    from minibatch.spec_decode.config import METHODS
    g.add_argument("--speculative", choices=METHODS, default=None,
                   help="speculative decoding with this method and -k drafts a step")
    g.add_argument("-k", type=int, default=3, help="speculative tokens per step")
    g.add_argument("--speculative-config", type=json.loads, default=None,
                   help='JSON, as vLLM takes it, e.g. \'{"method": "eagle", "tree": "dynamic", "num_draft_tokens": 16, '
                        '"depth": 5, "topk": 4}\'')
    g.add_argument("--n", type=int, default=1, help="samples of the prompt (parallel sampling, sharing its blocks)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="KV cache size in blocks (vLLM's flag; small, it makes the scheduler preempt)")
    from minibatch.engine import memory_hierarchy
    from minibatch.kv import quant
    memory_hierarchy.add_arguments(g)
    quant.add_arguments(g)
    g.add_argument("--async-scheduling", action="store_true",
                   help="schedule step N+1 while step N's forward runs (vLLM's flag; engine/async_scheduler.py)")
    from minibatch.engine.request_queue import POLICIES
    from minibatch.kv.radix_allocator import PREFIX_CACHES
    g.add_argument("--prefix-cache", choices=PREFIX_CACHES, default="hash",
                   help="the prefix cache: vLLM's hash chain, or SGLang's radix tree")
    g.add_argument("--scheduling-policy", choices=POLICIES, default="fcfs",
                   help="the waiting queue's order (lpm, dfs-weight: SGLang's cache-aware orders)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model's heads over this many processes (vLLM's flag; minibatch/distributed/)")
    d = sub.add_parser("demo", help="lecture demos: continuous, static, paged, speculative, tree, "
                                           "hierarchy, structured, disaggregated, async")
    d.add_argument("scenario", help="continuous, static, paged, speculative, tree (token trees), hierarchy "
                                    "(swapping and the host tier), structured (structured outputs' masks), "
                                    "disaggregated, async (sync vs async scheduling's lanes), or a saved trace "
                                    "(.json) to replay")
    d.add_argument("--out", default=None, help="animation file (.gif, .html, .mp4); default out/demo/<scenario>.gif")
    d.add_argument("--text", action="store_true", help="print the per-step text view only (no graphics)")
    d.add_argument("--small", action="store_true", help="a smaller run (for CI)")
    d.add_argument("--simulate", default=None, metavar="HW:MODEL",
                   help="also print each run re-timed on a simulated GPU and model, e.g. h100:llama-3-8b")
    from minibatch.engine import threads
    threads.add_argument(g)
    threads.add_argument(d)
    s = sub.add_parser("serve", help="an OpenAI-compatible server (/v1/completions) with a live view at /")
    from minibatch.serve.server import add_arguments    # argparse only; the server loads on use
    add_arguments(s)
    sl = sub.add_parser("slides", help="reveal.js lecture decks of the notebooks, with their figures and demo animations")
    from minibatch import slides
    slides.add_arguments(sl)
    threads.add_argument(sl)
    args = ap.parse_args(argv)
    try:
        threads.use_cli(args.threads)            # serve's --threads comes from add_arguments
        if args.cmd == "generate":
            return _generate(args)
        if args.cmd == "slides":
            return slides.main(args)
        if args.cmd == "serve":
            from minibatch.serve.server import serve
            return serve(args)
        from minibatch.bench.demo import run_demo
        return run_demo(args.scenario, out=args.out, text_only=args.text, small=args.small, simulate=args.simulate)
    except NotImplementedError:      # an exercise not finished yet (a student release): said below
        raise
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    try:
        sys.exit(main())
    except NotImplementedError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
