"""The engine core in a process of its own (engine/core.py, serve/async_llm.py), behind a real server on 127.0.0.1.

What the split must keep: the same greedy tokens as the in-process engine, streamed; a client that hangs up
aborts its request in the core (no request, no block left there); every step's trace reaches /metrics and the
live view; a bad engine config fails at start-up with the engine's own message. And what it adds: a core
killed with SIGKILL makes every request, open or new, end with a 503 naming the engine core, at once, and
`python -m minibatch serve` then exits with status 1, as its docstring says.

Every spawned core imports torch and loads the weights (seconds on a 2-core CI machine): one server serves
the module, and only the fault tests start their own.
"""
import asyncio
import functools
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minibatch import LLM, SamplingParams
from minibatch.engine.config import EngineConfig
from minibatch.engine.core import engine_state
from minibatch.serve import ServerThread

pytestmark = pytest.mark.serve

PROMPTS = ["def fib(n):\n", "import os\nimport sys\n", "class Stack:\n    def push(self, x):\n", "for i in range("]
MAX_TOKENS = [24, 40, 17, 33]


def make_llm():
    return LLM("target", device="cpu", num_gpu_blocks=30, max_num_seqs=16)


@pytest.fixture(scope="module")
def server():
    # The core runs asynchronous scheduling and swaps (serve --async-scheduling --preemption-mode swap): every test
    # below then also holds that core to the in-process, synchronous engine's tokens.
    with ServerThread(functools.partial(LLM, "target", device="cpu", num_gpu_blocks=30, max_num_seqs=16,
                                        async_scheduling=True, preemption_mode="swap"),
                      max_pending_requests=64) as srv:
        assert srv.engine_loop.process.is_alive()
        yield srv


def core_state(srv, timeout=20.0) -> dict:
    """The core's own count of requests and blocks, once it has none left (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        st = srv.engine_loop.call(engine_state).result(10)
        if not st["has_unfinished"] or time.monotonic() > deadline:
            return st
        time.sleep(0.02)


def scrape(url) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, s.labels.get("finished_reason")): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def stream_ids(c, prompt, **kw) -> list:
    s = await c.post("/v1/completions", json={"prompt": prompt, "stream": True, "return_token_ids": True, **kw})
    assert s.status_code == 200, s.text
    ids = []
    for line in s.text.splitlines():
        if line.startswith("data: {"):
            for ch in httpx.Response(200, content=line[6:]).json()["choices"]:
                ids += ch["token_ids"]
    return ids


def test_streamed_completions_equal_the_in_process_engine(server):
    llm = make_llm()
    want = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS], use_tqdm=False)]
    sampled = llm.generate(PROMPTS[:1], SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12, logprobs=2),
                           use_tqdm=False)[0]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            greedy = asyncio.gather(*[stream_ids(c, p, max_tokens=m, temperature=0)
                                      for p, m in zip(PROMPTS, MAX_TOKENS)])
            plain = c.post("/v1/completions", json={"prompt": PROMPTS[0], "n": 2, "temperature": 0.8, "seed": 7,
                                                    "max_tokens": 12, "logprobs": 2})
            return await asyncio.gather(greedy, plain)
    got, plain = asyncio.run(run())
    assert got == want
    choices = plain.json()["choices"]                  # n > 1, seeded, with logprobs: as the engine made them
    assert [c["text"] for c in choices] == [o.text for o in sampled.outputs]
    for c, o in zip(choices, sampled.outputs):
        assert c["logprobs"]["token_logprobs"] == pytest.approx([lp[t].logprob for lp, t in zip(o.logprobs,
                                                                                              o.token_ids)], abs=1e-5)
    st = core_state(server)
    assert st["num_unfinished_requests"] == 0 and st["num_free_blocks"] == st["num_blocks"]


def test_a_client_that_hangs_up_aborts_its_request_in_the_core(server):
    before = scrape(server.url)[("vllm:request_success_total", "abort")]
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "def fib(n):", "max_tokens": 400,
                                                       "temperature": 0, "stream": True}) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")
            assert srv_busy(server)                     # the core holds it while the stream is open
        # the connection is closed here, 400 tokens early
    st = core_state(server)
    assert st["num_unfinished_requests"] == 0, "the request still runs in the core"
    assert st["num_free_blocks"] == st["num_blocks"], "blocks leaked in the core"
    assert scrape(server.url)[("vllm:request_success_total", "abort")] == before + 1
    assert server.engine_loop.num_pending == 0 and server.engine_loop.error is None


def srv_busy(srv) -> bool:
    return srv.engine_loop.call(engine_state).result(10)["has_unfinished"]


def step_count(engine) -> int:
    return engine.step_count


def test_metrics_and_the_live_view_see_every_step_of_the_core(server):
    httpx.post(server.url + "/v1/completions", json={"prompt": "x = 1\n", "max_tokens": 6}, timeout=30)
    core_state(server)
    steps = server.engine_loop.call(step_count).result(10)
    m = scrape(server.url)
    assert m[("vllm:iteration_tokens_total_count", None)] == steps, "a step's stats did not reach /metrics"
    live = [int(d.split('"step":', 1)[1].split(",", 1)[0]) for d in server.app.state.feed.backlog()]
    assert live == list(range(steps - len(live), steps)), "the live view missed a step"
    assert m[("vllm:num_requests_running", None)] == 0 and m[("vllm:kv_cache_usage_perc", None)] == 0


def test_a_bad_engine_config_fails_at_start_up_with_the_engines_message():
    with pytest.raises(ValueError, match="block_size"):
        ServerThread(functools.partial(EngineConfig, block_size=0))


def test_a_killed_core_is_a_503_naming_it_for_open_and_new_requests():
    with ServerThread(functools.partial(LLM, "target", device="cpu", max_num_seqs=4)) as srv, \
            httpx.Client(base_url=srv.url, timeout=10) as c:
        pid = srv.engine_loop.process.pid
        with c.stream("POST", "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 400, "stream": True}) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            rest = [line for line in lines if line]    # the open stream ends (read timeout 10 s: no hang)
        assert time.monotonic() - t0 < 5
        assert "engine core process" in rest[-1] and "SIGKILL" in rest[-1] and rest[-1] != "data: [DONE]"
        for r in (c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}),
                  c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}),
                  c.get("/health")):
            assert r.status_code == 503, r.text
            assert f"engine core process (pid {pid}) was killed by SIGKILL" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 5


def test_serve_exits_with_status_1_after_its_core_dies():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minibatch", "serve", "--port", str(port), "--device", "cpu",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        seen = [proc.stdout.readline() for _ in range(1)]
        while "engine core in process" not in seen[-1] and seen[-1] and len(seen) < 50:
            seen.append(proc.stdout.readline())       # "minibatch: engine core in process N"
        assert "engine core in process" in seen[-1], "".join(seen)
        core = int(seen[-1].split()[-1])
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        os.kill(core, signal.SIGKILL)
        time.sleep(0.3)
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
        assert r.status_code == 503 and "engine core process" in r.json()["error"]["message"]
        assert proc.wait(20) == 1
        assert "exiting in" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_arrival_is_stamped_before_the_body_is_read(server):
    """A client that takes 0.4 s to send its body: the server's TTFT counts that time, since the arrival is stamped
    at the ASGI entry (as the client's own clock would), not when the handler starts."""
    def ttft_sum():
        for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=10).text):
            for s in fam.samples:
                if s.name == "vllm:time_to_first_token_seconds_sum":
                    return s.value
        return 0.0
    before = ttft_sum()
    body = b'{"prompt": "def f(x):", "max_tokens": 2, "temperature": 0}'
    host, port = server.url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body[:10])
        time.sleep(0.4)
        sock.sendall(body[10:])
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert b" 200 " in reply.split(b"\r\n", 1)[0]
    assert ttft_sum() - before >= 0.4
