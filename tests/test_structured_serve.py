"""Structured outputs through the server: OpenAI's response_format, vLLM's structured_outputs and guided_* extra
body fields; a constraint that does not compile, or admits no string, is a 400 and the server keeps serving."""
import json
import re

import httpx
import pytest

from minibatch import LLM, SamplingParams
from minibatch.serve import ServerThread

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    llm = LLM("target", device="cpu", num_gpu_blocks=30, max_num_seqs=8)
    with ServerThread(llm) as srv:
        yield srv


def post(srv, **body):
    return httpx.post(srv.url + "/v1/completions", json={"model": "target", "max_tokens": 24, "temperature": 0,
                                                           **body}, timeout=60)


@pytest.mark.parametrize("fields,so", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "flag", "schema": SCHEMA}}},
     {"json": SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"structured_outputs": {"regex": r"[a-z]{2,5}\(\)"}}, {"regex": r"[a-z]{2,5}\(\)"}),
    ({"guided_regex": r"(0|[1-9][0-9]{0,2})"}, {"regex": r"(0|[1-9][0-9]{0,2})"}),
    ({"guided_choice": ["alpha", "beta"]}, {"choice": ["alpha", "beta"]}),
    ({"guided_json": SCHEMA}, {"json": SCHEMA}),
    ({"guided_grammar": 'start: "x" ("+" "x")*'}, {"grammar": 'start: "x" ("+" "x")*'}),
], ids=["response_format schema", "json_object", "structured_outputs", "guided_regex", "guided_choice",
        "guided_json", "guided_grammar"])
def test_each_field_constrains_as_offline(server, fields, so):
    r = post(server, prompt="value = ", **fields)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    want = LLM("target", device="cpu").generate(
        ["value = "], SamplingParams(temperature=0, max_tokens=24, structured_outputs=so), use_tqdm=False)
    assert text == want[0].outputs[0].text
    assert r.json()["choices"][0]["finish_reason"] == want[0].outputs[0].finish_reason
    if "regex" in so and want[0].outputs[0].finish_reason == "stop":
        assert re.fullmatch(so["regex"], text)
    if "choice" in so:
        assert text in so["choice"]
    if "json" in so and want[0].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(text)["ok"], bool)


def test_the_official_client_and_streaming(server):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=60)
    body = {"structured_outputs": {"choice": ["red", "green", "blue"]}}
    one = c.completions.create(model="target", prompt="colour = ", max_tokens=8, temperature=0, extra_body=body)
    chunks = c.completions.create(model="target", prompt="colour = ", max_tokens=8, temperature=0, stream=True,
                                  extra_body=body)
    assert one.choices[0].text in ("red", "green", "blue") and one.choices[0].finish_reason == "stop"
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == one.choices[0].text


@pytest.mark.parametrize("fields,match", [
    ({"structured_outputs": {"regex": "a("}}, "does not compile"),
    ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 3}}, "does not compile"),
    ({"guided_json": "{bad"}, "json"),
    ({"guided_grammar": "start: a\na: b"}, "does not compile"),
    ({"guided_regex": "[^\\x00-\\x{10FFFF}]"}, "admits no string"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "one structured-outputs field"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regexp": "a"}}, "unknown field"),
    ({"guided_choice": "yes"}, "guided_choice"),
])
def test_bad_constraints_are_400_and_the_server_keeps_serving(server, fields, match):
    r = post(server, prompt="x = ", **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and match in err["message"], err
    ok = post(server, prompt="x = ", guided_choice=["yes", "no"])
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("yes", "no")
