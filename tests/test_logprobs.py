"""Logprobs (sampling/logprobs.py), checked against the no-cache oracle: a full forward over the sequence so far,
the reference controls, the temperature, log_softmax. Output logprobs with and without speculation (a verified
token's comes from the target's row, never the draft's), with n > 1 and a stop string; prompt logprobs with
chunked prefill and prefix-cache hits; and the server's OpenAI shapes (echo, max_tokens 0, streaming, 400s)."""
import httpx
import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.sampling.logits_processors import process_row_reference
from minibatch.sampling.logprobs import Logprob
from minibatch.model.model import forward_sequences
from minibatch.serve import ServerThread

PROMPTS = ["def fib(n):\n    ", "class Stack:\n    def push(self, x):\n", "import os\nimport sys\n"]
SPECS = {"plain": None, "draft k3": {"method": "draft", "num_speculative_tokens": 3},
         "ngram k2": {"method": "ngram", "num_speculative_tokens": 2},
         "eagle tree": {"method": "eagle", "tree": "dynamic", "num_draft_tokens": 6, "depth": 3, "topk": 2}}


def oracle_entries(model, prompt: list, output: list, params) -> list:
    """[{token: logprob}] of each output token and the top params.logprobs, from full forwards."""
    seqs = [prompt + output[:i] for i in range(len(output))]
    out = []
    for i, lg in enumerate(forward_sequences(model, seqs)):
        x = torch.tensor(process_row_reference(lg[-1].tolist(), params, prompt, output[:i]))
        lp = (x / (params.temperature or 1.0)).log_softmax(-1)
        out.append((lp[output[i]].item(), int((lp >= lp[output[i]]).sum()), lp.topk(params.logprobs)))
    return out


def check(entries, want, num):
    assert len(entries) == len(want)
    for e, (tok_lp, rank, top), t in zip(entries, want, [next(iter(e)) for e in entries]):
        assert isinstance(e[t], Logprob)
        assert e[t].logprob == pytest.approx(tok_lp, abs=1e-4) and e[t].rank == rank
        ranked = {tok: v for tok, v in e.items() if v.rank <= num}
        assert sorted(ranked) == sorted(top.indices.tolist())
        for tok, v in zip(top.indices.tolist(), top.values.tolist()):
            assert e[tok].logprob == pytest.approx(v, abs=1e-4)


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_output_logprobs_equal_the_oracle(target_model, draft_model, spec, temperature):
    cfg = SPECS[spec]
    llm = LLM(target_model, draft_model=draft_model if cfg and cfg["method"] == "draft" else None,
              speculative_config=cfg, max_num_batched_tokens=32, block_size=8, num_gpu_blocks=12, max_num_seqs=3)
    params = SamplingParams(temperature=temperature, max_tokens=12, logprobs=3, seed=5, repetition_penalty=1.2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        c = o.outputs[0]
        assert c.logprobs is not None and o.prompt_logprobs is None
        assert [next(iter(e)) for e in c.logprobs] == c.token_ids          # the chosen token first
        check(c.logprobs, oracle_entries(target_model, list(p.encode()), c.token_ids, params), 3)
        if temperature == 0:
            assert all(e[t].rank == 1 for e, t in zip(c.logprobs, c.token_ids))
    if cfg:
        assert sum(o.outputs[0].spec["accepted"] for o in outs) > 0, "no draft accepted: speculation untested"
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "no preemption: the recompute path went untested"


def test_logprobs_follow_forks_and_stop_strings(target_model):
    llm = LLM(target_model)
    params = SamplingParams(temperature=1.0, n=3, max_tokens=10, logprobs=0, seed=1, stop=["  "])
    o = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert len(o.outputs) == 3
    for c in o.outputs:
        assert len(c.logprobs) == len(c.token_ids) and all(len(e) == 1 for e in c.logprobs)
        check(c.logprobs, oracle_entries(target_model, list(PROMPTS[0].encode()), c.token_ids,
                                         SamplingParams(temperature=1.0, logprobs=0)), 0)
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].logprobs is None


@pytest.mark.parametrize("cfg", [{}, dict(max_num_batched_tokens=16, block_size=8)], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_the_oracle(target_model, cfg):
    llm = LLM(target_model, **cfg)
    shared = "# a shared preamble, long enough to fill whole blocks of the prefix cache\n"
    prompts = [shared + "def f(x):", shared + "class A:"]          # the second hits the prefix cache
    for p in prompts:
        o = llm.generate([p], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
        ids = list(p.encode())
        lp = forward_sequences(target_model, [ids])[0].log_softmax(-1)             # [L, V]
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(ids)
        for i, e in enumerate(o.prompt_logprobs[1:]):
            assert e[ids[i + 1]].logprob == pytest.approx(lp[i, ids[i + 1]].item(), abs=1e-5)
            assert e[ids[i + 1]].rank == int((lp[i] >= lp[i, ids[i + 1]]).sum())
            assert {t for t, v in e.items() if v.rank <= 2} == set(lp[i].topk(2).indices.tolist())
    assert llm.llm_engine.allocator.hits > 0, "no prefix-cache hit: that case went untested"


# -- the server ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(target_model):
    with ServerThread(LLM(target_model, max_num_seqs=8)) as srv:
        yield srv


def post(srv, **body):
    return httpx.post(srv.url + "/v1/completions", json={"temperature": 0, **body}, timeout=60)


def test_echo_with_max_tokens_0_scores_the_prompt(server, target_model):
    prompt = "def add(a, b):\n    return a + b\n"
    r = post(server, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    assert r.status_code == 200, r.text
    body = r.json()
    c = body["choices"][0]
    assert c["text"] == prompt and body["usage"]["completion_tokens"] == 0
    lp = c["logprobs"]
    ids = list(prompt.encode())
    assert lp["tokens"] == [chr(t) for t in ids] and lp["text_offset"] == list(range(len(ids)))
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = forward_sequences(target_model, [ids])[0].log_softmax(-1)
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(want[i - 1, ids[i]].item(), abs=1e-5)
        assert max(lp["top_logprobs"][i].values()) == pytest.approx(want[i - 1].max().item(), abs=1e-5)
    # lm-eval's request: echo, max_tokens 1, logprobs 1: the prompt scored, then one generated token
    c = post(server, prompt=ids, max_tokens=1, echo=True, logprobs=1).json()["choices"][0]
    assert c["logprobs"]["token_logprobs"][:-1] == lp["token_logprobs"] and len(c["logprobs"]["tokens"]) == len(ids) + 1
    # vLLM's prompt_logprobs extension: the prompt token and the top 1, keyed by token id
    c = post(server, prompt=prompt, max_tokens=1, echo=True, logprobs=3, prompt_logprobs=1).json()["choices"][0]
    pl = c["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    for i in range(1, len(ids)):
        assert pl[i][str(ids[i])]["logprob"] == pytest.approx(want[i - 1, ids[i]].item(), abs=1e-5)
        assert {v["rank"] for v in pl[i].values()} <= {1, pl[i][str(ids[i])]["rank"]}


def test_completion_logprobs_match_the_engine_and_stream(server):
    body = dict(prompt="import os\n", max_tokens=8, logprobs=3, frequency_penalty=0.5, logit_bias={"10": -100},
                stop_token_ids=[40], min_tokens=2, repetition_penalty=1.1, presence_penalty=0.1)
    c = post(server, **body).json()["choices"][0]
    lp = c["logprobs"]
    assert "".join(lp["tokens"]) == c["text"] and "\n" not in c["text"]
    assert all(len(t) <= 4 and min(t.values()) <= x for t, x in zip(lp["top_logprobs"], lp["token_logprobs"]))
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "temperature": 0, "stream": True}) as r:
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    import json
    streamed = [json.loads(x[6:])["choices"][0]["logprobs"] for x in chunks]
    assert sum((s["token_logprobs"] for s in streamed if s), []) == pytest.approx(lp["token_logprobs"])
    assert sum((s["text_offset"] for s in streamed if s), []) == lp["text_offset"]


@pytest.mark.parametrize("bad,param", [
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"logit_bias": {"256": 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_tokens": 99}, "min_tokens"),
    ({"stop_token_ids": [300]}, "stop_token_ids"), ({"max_tokens": 0}, None), ({"echo": True, "stream": True}, None)])
def test_bad_values_are_400s_and_the_server_keeps_serving(server, bad, param):
    r = post(server, prompt="x", **bad)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert err["param"] == param and param in err["message"]
    assert post(server, prompt="x", max_tokens=2).status_code == 200


def test_tokenize_endpoints(server):
    assert httpx.post(server.url + "/tokenize", json={"prompt": "hé"}).json()["tokens"] == [104, 195, 169]
    assert httpx.post(server.url + "/detokenize", json={"tokens": [104, 195, 169]}).json()["prompt"] == "hé"
    assert httpx.post(server.url + "/detokenize", json={"tokens": [256]}).status_code == 400
    assert "eos_token" in httpx.get(server.url + "/tokenizer_info").json()
