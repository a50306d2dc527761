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


def check_stats_line(method, err):
    m = re.search(rf"# speculative decoding \({method}\): (\d+) of (\d+) drafts accepted \(acceptance rate "
                  r"(\d\.\d\d)\), (\d+\.\d\d) tokens per verify step", err)
    assert m, err
    accepted, proposed = int(m[1]), int(m[2])
    assert 0 <= accepted <= proposed and proposed > 0 and float(m[3]) == pytest.approx(accepted / proposed, abs=0.005)


@pytest.mark.parametrize("method", [m for m in METHODS if m != "eagle3"])     # eagle3: the Llama's head only
def test_every_method_gives_the_plain_greedy_text_and_says_what_it_accepted(method, plain_text, capsys):
    code, out, err = generate(capsys, "--speculative", method, "-k", "3")
    assert code == 0 and out == plain_text
    check_stats_line(method, err)


def test_eagle3_on_the_llama_gives_its_plain_greedy_text(capsys):
    from minibatch.model.weights import WEIGHTS_DIR
    if not (WEIGHTS_DIR / "llama_eagle3.safetensors").exists():
        pytest.skip("no shipped llama_eagle3 (python -m minibatch.model.train --preset eagle3 --model llama)")
    _, plain, _ = generate(capsys, "--model", "llama")
    code, out, err = generate(capsys, "--model", "llama", "--speculative", "eagle3", "-k", "4")
    assert code == 0 and out == plain
    check_stats_line("eagle3", err)


def test_a_token_tree_from_the_speculative_config(plain_text, capsys):
    code, out, err = generate(capsys, "--speculative-config",
                              '{"method": "eagle", "tree": "dynamic", "num_draft_tokens": 8, "depth": 3, "topk": 2}')
    assert code == 0 and out == plain_text and "# speculative decoding (eagle)" in err


@pytest.mark.parametrize("argv, needle", [
    (["--speculative", "ngram", "--speculative-config", '{"method": "ngram"}'], "not both"),
    (["--speculative-config", '{"method": "nope"}'], "unknown speculative method 'nope'"),
    (["--speculative", "draft", "-k", "17"], "num_speculative_tokens must be an integer in [0, 16]"),
    (["--speculative", "eagle3", "-k", "2"], "method 'eagle3' needs the head 'eagle3'"),    # the GPT has none
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
