"""Runs inside the vLLM venv (its own python, torch and transformers): vLLM's offline ``LLM`` on request.

    <vllm-venv>/bin/python minibatch/bench/vllm_worker.py MODEL_DIR

minibatch is not installed there, so this file imports nothing of minibatch: ``vllm_peer.VLLMPeer`` starts
it and talks to it one JSON line at a time (stdin in; stdout lines starting with ``REPLY`` out, since vLLM
logs to stdout too). One process serves every case, so vLLM's start-up (imports, compiling the model)
is paid once and the bench can alternate timed runs with minibatch's:

    {"op": "load", "key": "plain", "speculative_config": null, "max_num_seqs": 16, ...}  -> {"ok": true}
    {"op": "run", "key": "plain", "prompts": [[100, 101], ...], "max_tokens": [8, ...]}  -> {"tokens": [[...]],
                                                                                             "seconds": 0.12}
vLLM V1 starts its engine core in a process of its own (``spawn``), so the script runs under a
``if __name__ == "__main__":`` guard: a spawned child re-imports it and must not start another engine.
"""
import json
import sys
import time

REPLY = "REPLY "


def reply(obj) -> None:
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(model_dir: str) -> None:
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except Exception as e:                       # a broken venv: said in one line, not vLLM's traceback
        reply({"error": f"import vllm failed: {type(e).__name__}: {e}"})
        return
    import vllm
    reply({"ok": True, "vllm": vllm.__version__})
    llms = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "load":
                # float32 like minibatch; token ids in and out (a byte model has no tokenizer files);
                # a small fixed KV cache instead of VLLM_CPU_KVCACHE_SPACE's default share of the RAM.
                llms[cmd["key"]] = LLM(
                    model=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0,
                    max_model_len=cmd.get("max_model_len", 512), max_num_seqs=cmd.get("max_num_seqs", 16),
                    max_num_batched_tokens=cmd.get("max_num_batched_tokens", 512),
                    kv_cache_memory_bytes=cmd.get("kv_bytes", 64 << 20),
                    speculative_config=cmd.get("speculative_config"),
                    distributed_executor_backend=cmd.get("executor"), enforce_eager=cmd.get("enforce_eager", False))
                reply({"ok": True})
            elif cmd["op"] == "run":
                prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]]
                params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
                          for n in cmd["max_tokens"]]
                t = time.perf_counter()
                outs = llms[cmd["key"]].generate(prompts, params, use_tqdm=False)
                dt = time.perf_counter() - t
                reply({"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": dt})
            else:
                reply({"error": f"unknown op {cmd['op']!r}"})
        except Exception as e:
            reply({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    serve(sys.argv[1])
