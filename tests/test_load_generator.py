"""guidellm, the load generator vLLM's ecosystem uses, drives `python -m minibatch serve` on 127.0.0.1.

guidellm (vllm-project/guidellm) runs in a venv of its own (it brings Hugging Face's `kernels` package, whose
import name is our Triton package's): .ci/run makes it, and the test finds it through $GUIDELLM, the PATH or
~/.cache/minibatch/guidellm-venv. It streams /v1/completions (with vLLM's `ignore_eos` and
`stream_options.continuous_usage_stats`) at 4 concurrent streams, from a local jsonl of code prompts.

Checked against the server's own /metrics histograms, over the same requests (scraped before and after):
every request succeeds; the client's mean inter-token latency and the server's mean TPOT agree within 10 %;
the client's mean TTFT is the server's plus the HTTP path (the server stamps a request's arrival when its
handler starts and its first token when it is sampled, so the client can only see more). Both tables are
printed (pytest -s).
"""
import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_serve_load import cli_server  # noqa: F401 (the fixture: `python -m minibatch serve` on 127.0.0.1)

pytestmark = [pytest.mark.serve, pytest.mark.slow]
VENV_GUIDELLM = Path("~/.cache/minibatch/guidellm-venv/bin/guidellm").expanduser()
PROMPTS = ["def fib(n):\n", "import os\nimport sys\n", "class Stack:\n    def push(self, x):\n",
           "for i in range(10):\n", "with open(path) as f:\n"]
NUM_REQUESTS = 40


def guidellm():
    for cand in (os.environ.get("GUIDELLM"), shutil.which("guidellm"), VENV_GUIDELLM):
        if cand and Path(cand).exists():
            return str(cand)
    return None


def server_means(url) -> dict:
    """(sum, count) of the server's TTFT and TPOT histograms."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            for key in ("time_to_first_token", "time_per_output_token"):
                if s.name in (f"vllm:{key}_seconds_sum", f"vllm:{key}_seconds_count"):
                    out[(key, s.name.rsplit("_", 1)[1])] = s.value
    return out


def test_guidellm_agrees_with_the_servers_metrics(cli_server, tmp_path, capsys):  # noqa: F811
    exe = guidellm()
    if exe is None:
        pytest.skip("guidellm is not installed (.ci/run makes ~/.cache/minibatch/guidellm-venv; or set GUIDELLM)")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": PROMPTS[i % 5] + "    " * (i // 5)}) + "\n" for i in range(50)))
    for p in PROMPTS:                                       # warm the server up: the figures compare steady state
        httpx.post(cli_server + "/v1/completions", json={"prompt": p, "max_tokens": 4}, timeout=60)
    before = server_means(cli_server)
    out = tmp_path / "guidellm.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([exe, "run", "--backend", f"kind=openai_http,target={cli_server},model=target,"
                          "request_format=/v1/completions,http2=false",
                          "--profile", "kind=concurrent,streams=4",
                          "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
                          "--data", f"kind=json_file,path={data}", "--output", f"kind=json,path={out}",
                          "--disable-console"], env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    after = server_means(cli_server)
    bench = json.loads(out.read_text())["benchmarks"][0]
    assert len(bench["requests"]["successful"]) == NUM_REQUESTS and not bench["requests"]["errored"]
    m = bench["metrics"]
    client = {"ttft": m["time_to_first_token_ms"]["successful"], "itl": m["inter_token_latency_ms"]["successful"]}
    server = {k: 1000 * (after[(k, "sum")] - before[(k, "sum")]) / (after[(k, "count")] - before[(k, "count")])
              for k in ("time_to_first_token", "time_per_output_token")}
    assert after[("time_to_first_token", "count")] - before[("time_to_first_token", "count")] == NUM_REQUESTS
    with capsys.disabled():
        print(f"\nguidellm, {NUM_REQUESTS} requests at 4 streams (ms):  TTFT mean {client['ttft']['mean']:.1f} "
              f"p50 {client['ttft']['median']:.1f} p90 {client['ttft']['percentiles']['p90']:.1f};  ITL mean "
              f"{client['itl']['mean']:.2f} p50 {client['itl']['median']:.2f} p90 "
              f"{client['itl']['percentiles']['p90']:.2f}\nserver /metrics (ms):  TTFT mean "
              f"{server['time_to_first_token']:.1f};  TPOT mean {server['time_per_output_token']:.2f}")
    tpot, itl = server["time_per_output_token"], client["itl"]["mean"]
    assert abs(itl - tpot) <= 0.10 * tpot, f"client ITL {itl:.2f} ms vs server TPOT {tpot:.2f} ms: over 10 % apart"
    assert client["ttft"]["mean"] >= server["time_to_first_token"], "the client saw a first token before the server"
