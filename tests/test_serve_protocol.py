"""The server's wire format without a server: request validation and the streamed text deltas.

The deltas are the subtle part: a byte-level model emits a multibyte character
one byte per step, and a stop string can be half-generated when a step ends.
Whatever the steps, the concatenated deltas must equal the final text.
"""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from minibatch.sampling.sampler import find_stop
from minibatch.model.tokenizer import decode, encode
from minibatch.serve.protocol import CompletionRequest, TextDelta, validation_message

pytestmark = pytest.mark.serve


def stream(tokens: list, stop: list, chunks: list, max_tokens: int):
    """Replay the engine's appends (chunks of 1..k tokens, cut before a stop string) through a TextDelta."""
    delta, out, texts, ids, i = TextDelta(stop), [], [], [], 0
    for k in chunks:
        out += tokens[i:i + k][: max_tokens - len(out)]
        i += k
        cut = find_stop(out, stop)
        if cut is not None:
            del out[cut:]
        finished = cut is not None or len(out) >= max_tokens or i >= len(tokens)
        text, new = delta.update(out, finished)
        texts.append(text)
        ids += new
        if finished:
            return out, "".join(texts), ids
    raise AssertionError("the replay never finished")


@settings(max_examples=300, deadline=None)
@given(text=st.text(min_size=1, max_size=40), junk=st.lists(st.integers(0, 255), max_size=6),
       stop=st.lists(st.text(min_size=1, max_size=4), max_size=3), data=st.data())
def test_streamed_deltas_concatenate_to_the_final_text(text, junk, stop, data):
    tokens = encode(text) + junk                                    # valid UTF-8, then possibly invalid bytes
    chunks = data.draw(st.lists(st.integers(1, 3), min_size=len(tokens), max_size=len(tokens)))
    final, streamed, ids = stream(tokens, stop, chunks, max_tokens=len(tokens))
    assert streamed == decode(final)
    assert ids == final


def test_a_split_character_waits_for_its_last_byte():
    d = TextDelta([])
    e = encode("é")                                                # 2 bytes
    assert d.update(e[:1], False) == ("", e[:1])
    assert d.update(e, False) == ("é", e[1:])


def test_a_possible_stop_string_is_held_back_until_it_is_decided():
    d = TextDelta(["END"])
    assert d.update(encode("abcE"), False)[0] == "abc"             # "E" may start "END"
    assert d.update(encode("abcEN"), False)[0] == ""
    assert d.update(encode("abcENx"), False)[0] == "ENx"           # it did not
    out = encode("abcENxEN")                                        # the engine cuts before "END":
    assert d.update(out[:6], True)[0] == ""                         # nothing held is ever sent


@pytest.mark.parametrize("body, fragment", [
    ({"prompt": "x", "max_token": 5}, "max_token: unknown field"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens: Input should be a valid integer"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": 5}, "prompt"),
    ({"max_tokens": 5}, "prompt: Field required"),
    ({"prompt": "x", "suffix": "}"}, "`suffix` is not supported"),
    ({"prompt": "x", "echo": True, "stream": True}, "`echo` is supported without `stream` only"),
    ({"prompt": "x", "max_tokens": 0}, "`max_tokens: 0` is allowed only with `echo: true`"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "only allowed with `stream: true`"),
    ({"prompt": "x", "stream": True, "stream_options": {"usage": True}}, "stream_options.usage: unknown field"),
])
def test_bad_requests_are_refused_with_a_readable_message(body, fragment):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate(body)
    message, _ = validation_message(e.value.errors())
    assert fragment in message


def test_good_requests_map_to_sampling_params():
    r = CompletionRequest.model_validate({"prompt": ["a", "b"], "max_tokens": 7, "temperature": 0, "top_k": 5,
                                          "stop": "\n", "n": 2, "seed": 3, "best_of": 2, "user": "ada"})
    assert r.prompts() == ["a", "b"]
    p = r.sampling_params(7)
    assert (p.n, p.temperature, p.top_k, p.max_tokens, p.stop, p.seed) == (2, 0, 5, 7, ["\n"], 3)
    assert CompletionRequest.model_validate({"prompt": [1, 2, 3]}).prompts() == [[1, 2, 3]]
    assert CompletionRequest.model_validate({"prompt": [[1], [2]]}).prompts() == [[1], [2]]
    with pytest.raises(ValueError, match="top_p"):
        CompletionRequest.model_validate({"prompt": "x", "top_p": 0}).sampling_params(4)
