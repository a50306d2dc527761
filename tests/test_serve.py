"""The OpenAI-compatible server, over real HTTP on 127.0.0.1: what a client sees, and what the engine keeps.

One server (a ServerThread on a free port) serves the module. Its cache is
30 blocks of 16 tokens (480 tokens, less than one 512-token context), so a
request can be refused for never fitting the cache, and 32 concurrent
requests queue and may be preempted, as on a busy server.
"""
import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minibatch import LLM, SamplingParams
from minibatch.model.tokenizer import decode, encode
from minibatch.serve import ServerThread

pytestmark = pytest.mark.serve

BASES = ["def fib(n):\n", "import os\nimport sys\n", "class Stack:\n    def push(self, x):\n",
         "# résumé of the café menu\n", "for i in range(10):\n", "x = {'π': 3.14159, 'e': 2.71828}\n",
         "    return self.", "while True:\n    line = f.readline()\n"]
PROMPTS = [BASES[i % 8] + "    " * (i // 8) for i in range(32)]
MAX_TOKENS = [8 + (i * 5) % 33 for i in range(32)]
WITH_STOP = (3, 10, 19, 28)                    # these get a stop string picked from their own output


@pytest.fixture(scope="module")
def server():
    llm = LLM("target", device="cpu", num_gpu_blocks=30, max_num_seqs=16)
    with ServerThread(llm, max_pending_requests=64) as srv:
        yield srv


def engine_state(srv):
    """Wait (bounded) until the engine has no unfinished request; then the allocator must hold and be empty."""
    deadline = time.monotonic() + 20
    while True:
        busy, free, total = srv.engine_loop.call(lambda e: (e.has_unfinished_requests(), e.allocator.num_free_blocks,
                                                            e.allocator.num_blocks)).result(10)
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    srv.engine_loop.call(lambda e: e.allocator.check_invariants()).result(10)
    assert not busy, "requests still unfinished 20 s later"
    assert free == total, f"{total - free} blocks leaked"
    assert srv.engine_loop.error is None


def scrape(url) -> dict:
    """{(sample name, sorted labels): value} from /metrics, through prometheus_client's own parser."""
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def sample(m: dict, name: str, **labels) -> float:
    labels = {"model_name": "target", **labels}
    return m[(name, tuple(sorted(labels.items())))]


def client(srv):
    openai = pytest.importorskip("openai")
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="EMPTY", max_retries=0, timeout=60)


async def complete(c, prompt, stream, **kw):
    """(text, token ids, finish reason) of choice 0, through the official client, streamed or not."""
    r = await c.completions.create(model="target", prompt=prompt, stream=stream,
                                   extra_body={"return_token_ids": True}, **kw)
    if not stream:
        ch = r.choices[0]
        return ch.text, ch.token_ids, ch.finish_reason
    text, ids, reason = "", [], None
    async for chunk in r:
        ch = chunk.choices[0]
        text, ids, reason = text + ch.text, ids + ch.token_ids, ch.finish_reason or reason
    return text, ids, reason


def test_32_concurrent_completions_half_streaming_equal_offline_greedy(server):
    c = client(server)
    llm = LLM("target", device="cpu")
    plain = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS], use_tqdm=False)
    stops = {}
    for i in WITH_STOP:                        # a stop string from the middle of its own greedy output
        ids = plain[i].outputs[0].token_ids
        s = decode(ids[len(ids) // 2: len(ids) // 2 + 2])
        if encode(s) == ids[len(ids) // 2: len(ids) // 2 + 2]:
            stops[i] = [s]
    params = [SamplingParams(temperature=0, max_tokens=m, stop=stops.get(i, [])) for i, m in enumerate(MAX_TOKENS)]
    ref = llm.generate(PROMPTS, params, use_tqdm=False)
    assert any(ref[i].outputs[0].finish_reason == "stop" for i in stops)

    async def run():
        return await asyncio.gather(*[complete(c, p, i % 2 == 0, max_tokens=m, temperature=0, stop=stops.get(i))
                                      for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS))])
    got = asyncio.run(run())
    for i, (text, ids, reason) in enumerate(got):
        want = ref[i].outputs[0]
        assert ids == want.token_ids, f"request {i} ({'stream' if i % 2 == 0 else 'plain'}): tokens differ"
        assert (text, reason) == (want.text, want.finish_reason), f"request {i}"
    engine_state(server)


def test_parallel_samples_of_several_prompts_stream_as_they_complete(server):
    prompts, sp = ["def a(", "import "], SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12)
    ref = LLM("target", device="cpu").generate(prompts, sp, use_tqdm=False)
    want = {2 * p + o.index: o.text for p, r in enumerate(ref) for o in r.outputs}
    body = {"prompt": prompts, "n": 2, "temperature": 0.8, "seed": 7, "max_tokens": 12}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert {ch["index"]: ch["text"] for ch in r["choices"]} == want
    assert r["usage"]["completion_tokens"] == 48
    streamed = {}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for ch in httpx.Response(200, content=line[len("data: "):]).json()["choices"]:
            streamed[ch["index"]] = streamed.get(ch["index"], "") + ch["text"]
    assert streamed == want
    engine_state(server)


def test_a_cancelled_stream_and_a_vanished_client_free_their_blocks(server):
    c = client(server)
    before = sample(scrape(server.url), "vllm:request_success_total", finished_reason="abort")

    async def run():
        other = asyncio.ensure_future(complete(c, "def fib(n):\n", False, max_tokens=30, temperature=0))
        s = await c.completions.create(model="target", prompt="def fib(n):", max_tokens=400, temperature=0,
                                       stream=True)
        n = 0
        async for _ in s:
            n += 1
            if n == 3:
                break
        await s.close()                        # the client hangs up mid-stream
        return await other
    text, ids, reason = asyncio.run(run())
    assert (len(ids), reason) == (30, "length"), "the request beside the cancelled one must finish normally"
    engine_state(server)
    with pytest.raises(httpx.TimeoutException):   # a plain request whose client gives up after 0.5 s
        httpx.post(server.url + "/v1/completions", json={"prompt": "def fib(n):", "max_tokens": 400}, timeout=0.5)
    engine_state(server)
    after = sample(scrape(server.url), "vllm:request_success_total", finished_reason="abort")
    assert after == before + 2, "both requests were aborted, not run to their 400 tokens"


BAD = [  # (what, body, status, fragment of the message)
    ("bad JSON", b'{"prompt": "x",', 400, "not valid JSON"),
    ("not an object", [1, 2], 400, "valid dictionary"),
    ("unknown field", {"prompt": "x", "max_token": 5}, 400, "max_token: unknown field"),
    ("wrong type", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens: Input should be a valid integer"),
    ("no prompt", {"max_tokens": 5}, 400, "prompt: Field required"),
    ("prompt over the context", {"prompt": "x" * 500, "max_tokens": 20}, 400, "exceeds the context length 512"),
    ("streamed, over the context", {"prompt": "x" * 500, "max_tokens": 20, "stream": True}, 400, "context length"),
    ("never fits the cache", {"prompt": "x" * 10, "max_tokens": 480}, 400, "could never finish"),
    ("temperature < 0", {"prompt": "x", "temperature": -1}, 400, "temperature must be >= 0"),
    ("top_p 0", {"prompt": "x", "top_p": 0}, 400, "top_p must lie in (0, 1]"),
    ("top_p > 1", {"prompt": "x", "top_p": 1.5}, 400, "top_p must lie in (0, 1]"),
    ("top_k -2", {"prompt": "x", "top_k": -2}, 400, "top_k must be"),
    ("max_tokens 0", {"prompt": "x", "max_tokens": 0}, 400, "`max_tokens: 0` is allowed only with `echo: true`"),
    ("max_tokens -1", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens must be an integer >= 1"),
    ("n 0", {"prompt": "x", "n": 0}, 400, "n must be an integer >= 1"),
    ("n over max_num_seqs", {"prompt": "x", "n": 17}, 400, "exceeds max_num_seqs=16"),
    ("empty stop string", {"prompt": "x", "stop": [""]}, 400, "stop must be non-empty"),
    ("empty prompt", {"prompt": ""}, 400, "the prompt is empty"),
    ("one bad prompt of two", {"prompt": ["def f(x):", ""]}, 400, "the prompt is empty"),   # neither is kept
    ("token id out of range", {"prompt": [65, 300]}, 400, "token ids in [0, 256)"),
    ("unimplemented field", {"prompt": "x", "suffix": "}"}, 400, "`suffix` is not supported"),
    ("logprobs over the limit", {"prompt": "x", "logprobs": 21}, 400, "logprobs must be an int in [0, 20]"),
    ("unknown model", {"prompt": "x", "model": "gpt-4"}, 404, "`gpt-4` does not exist"),
]


@pytest.mark.parametrize("what, body, status, fragment", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_clear_4xx_and_the_next_request_succeeds(server, what, body, status, fragment):
    url = server.url + "/v1/completions"
    r = httpx.post(url, content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes) \
        else httpx.post(url, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["code"] == status and err["type"], err
    assert not server.engine_loop.call(lambda e: e.has_unfinished_requests()).result(5), "a refused request runs"
    ok = httpx.post(url, json={"prompt": "def f(x):", "max_tokens": 3, "temperature": 0}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"].encode()) <= 3
    engine_state(server)


def test_the_openai_client_raises_the_servers_message(server):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="temperature must be >= 0"):
        c.completions.create(model="target", prompt="x", temperature=-0.5)
    assert [m.id for m in c.models.list().data] == ["target"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_queue_bound_answers_503_then_serves_again():
    llm = LLM("target", device="cpu", max_num_seqs=4)
    with ServerThread(llm, max_pending_requests=2) as srv, httpx.Client(base_url=srv.url, timeout=30) as h:
        body = {"prompt": "def f(x):", "max_tokens": 300, "stream": True}
        with h.stream("POST", "/v1/completions", json=body) as a, h.stream("POST", "/v1/completions", json=body) as b:
            lines = [a.iter_lines(), b.iter_lines()]        # kept: a dropped iterator closes its connection
            assert all(next(it).startswith("data: ") for it in lines)     # both admitted and streaming
            r = h.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 503
            assert "--max-pending-requests" in r.json()["error"]["message"]
            assert r.json()["error"]["type"] == "server_overloaded"
        engine_state(srv)
        assert h.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_metrics_parse_and_move(server):
    m0 = scrape(server.url)
    prompt = "import os\nimport sys\nimport json\nimport time\n"     # 45 bytes: 2 full blocks, cached after one
    for stream in (False, False, True):
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                          json={"prompt": prompt, "max_tokens": 5, "temperature": 0, "stream": stream}) as r:
            r.read()
    engine_state(server)
    m1 = scrape(server.url)
    moved = lambda name, **kw: sample(m1, name, **kw) - sample(m0, name, **kw)     # noqa: E731
    assert moved("vllm:request_success_total", finished_reason="length") == 3
    assert moved("vllm:generation_tokens_total") == 15
    assert moved("vllm:prompt_tokens_total") == 3 * len(encode(prompt))
    for h in ("vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"):
        assert moved(h + "_count") == 3, h
        assert sample(m1, h + "_bucket", le="+Inf") == sample(m1, h + "_count")
    assert moved("vllm:prefix_cache_queries_total") >= 3 * 32
    assert moved("vllm:prefix_cache_hits_total") >= 2 * 32, "the 2nd and 3rd requests reuse the 1st's blocks"
    assert moved("vllm:iteration_tokens_total_count") >= 5
    for g in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert sample(m1, g) == 0, g
    assert 0 < sample(m1, "vllm:gpu_prefix_cache_hit_rate") <= 1
    assert ("vllm:num_preemptions_total", (("model_name", "target"),)) in m1
