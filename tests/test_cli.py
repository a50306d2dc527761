"""``python -m minibatch generate``: every speculation method from the command line, and clear errors.

Greedy speculative decoding is lossless, so each method's completion must be the plain one, token for token;
the stats line must say which method ran and how many drafts it kept."""
import re

import pytest

from minibatch.__main__ import main
from minibatch.spec_decode.config import METHODS

PROMPT = "    def __init__(self, name):\n        self.name = name\n        self."


def generate(capsys, *extra):
    code = main(["generate", PROMPT, "--max-tokens", "24", "--device", "cpu", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def plain_text():
    import io
    from contextlib import redirect_stderr, redirect_stdout
    buf = io.StringIO()
    with redirect_stdout(buf), redirect_stderr(io.StringIO()):
        assert main(["generate", PROMPT, "--max-tokens", "24", "--device", "cpu"]) == 0
    return buf.getvalue()


@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_the_plain_greedy_text_and_says_what_it_accepted(method, plain_text, capsys):
    code, out, err = generate(capsys, "--speculative", method, "-k", "3")
    assert code == 0 and out == plain_text
    m = re.search(rf"# speculative decoding \({method}\): (\d+) of (\d+) drafts accepted \(acceptance rate "
                  r"(\d\.\d\d)\), (\d+\.\d\d) tokens per verify step", err)
    assert m, err
    accepted, proposed = int(m[1]), int(m[2])
    assert 0 <= accepted <= proposed and proposed > 0 and float(m[3]) == pytest.approx(accepted / proposed, abs=0.005)


def test_a_token_tree_from_the_speculative_config(plain_text, capsys):
    code, out, err = generate(capsys, "--speculative-config",
                              '{"method": "eagle", "tree": "dynamic", "num_draft_tokens": 8, "depth": 3, "topk": 2}')
    assert code == 0 and out == plain_text and "# speculative decoding (eagle)" in err


@pytest.mark.parametrize("argv, needle", [
    (["--speculative", "ngram", "--speculative-config", '{"method": "ngram"}'], "not both"),
    (["--speculative-config", '{"method": "nope"}'], "unknown speculative method 'nope'"),
    (["--speculative", "draft", "-k", "17"], "num_speculative_tokens must be an integer in [0, 16]"),
])
def test_bad_speculation_is_a_clear_error(argv, needle, capsys):
    code, out, err = generate(capsys, *argv)
    assert code == 2 and out == "" and needle in err


def test_an_unknown_method_or_bad_json_is_refused_by_the_parser(capsys):
    for argv in (["--speculative", "nope"], ["--speculative-config", "{bad"]):
        with pytest.raises(SystemExit) as e:
            generate(capsys, *argv)
        assert e.value.code == 2


def test_the_radix_cache_and_a_cache_aware_policy_give_the_plain_text(plain_text, capsys):
    code, out, err = generate(capsys, "--prefix-cache", "radix", "--scheduling-policy", "lpm")
    assert code == 0 and out == plain_text
    for argv in (["--prefix-cache", "tree"], ["--scheduling-policy", "lifo"]):
        with pytest.raises(SystemExit):
            generate(capsys, *argv)
        assert "invalid choice" in capsys.readouterr().err
