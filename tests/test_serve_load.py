"""`python -m minibatch serve` as a user starts it (a subprocess), under the load generator's Poisson traffic.

200 requests through `python -m minibatch.bench serve` (the official openai client, every one streamed):
0 errors, and after the run no request left and every block back in the pool (the server checks its
allocator whenever it falls idle, and /health reports a failure). The figures are printed (pytest -s).
"""
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.serve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cli_server():
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen([sys.executable, "-m", "minibatch", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--device", "cpu", "--max-num-seqs", "32", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the server did not come up:\n{proc.stdout.read() if proc.poll() is not None else ''}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def metrics(url) -> dict:
    text = httpx.get(url + "/metrics").text
    return {(s.name, s.labels.get("finished_reason")): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_200_poisson_requests_no_errors_no_leaked_blocks(cli_server, tmp_path, capsys):
    pytest.importorskip("openai")
    from minibatch.bench import main as bench      # through run.py's OTHERS, as `python -m minibatch.bench serve`
    out = tmp_path / "serve-bench.png"
    rc = bench(["serve", "--base-url", cli_server + "/v1", "--rate", "20", "--duration", "30", "--num-requests", "200",
                     "--concurrency", "32", "--min-tokens", "4", "--max-tokens", "24", "--timeout", "120",
                     "--out", str(out)])
    report = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + report)
    assert rc == 0, report
    assert "200 completed of 200, 0 errors" in report
    for line in ("TTFT", "TPOT", "latency"):
        assert f"{line} " in report and "p99" in report
    assert out.exists() and out.stat().st_size > 10_000
    assert httpx.get(cli_server + "/health").status_code == 200, "the idle allocator check failed"
    m = metrics(cli_server)
    assert m[("vllm:request_success_total", "length")] == 200
    assert m[("vllm:num_requests_running", None)] == 0 and m[("vllm:num_requests_waiting", None)] == 0
    assert m[("vllm:kv_cache_usage_perc", None)] == 0, "blocks leaked"


def test_the_command_line_serves_the_page_and_still_generates(cli_server, capsys):
    page = httpx.get(cli_server + "/")
    assert page.status_code == 200 and "minibatch · live" in page.text and "#009E73" in page.text
    with httpx.stream("GET", cli_server + "/live/events", timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        first = next(r.iter_lines())
    assert first.startswith(": minibatch")
    from minibatch.__main__ import main
    assert main(["generate", "def f(x):", "--max-tokens", "4", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("def f(x):")
