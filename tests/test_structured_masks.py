"""The teaching automaton against Python's re and against the library (llguidance): same language, same masks."""
import re

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from minibatch.sampling.structured.backend import LLGuidanceMatcher, compile_grammar
from minibatch.sampling.structured.matcher import advance, row_masks
from minibatch.sampling.structured.teaching import DFA, TeachingMatcher, parse

pytestmark = pytest.mark.usefixtures("one_thread")

# Random regexes in the teaching syntax: literals (some needing an escape), classes, negated classes, ".",
# concatenation, alternation and every quantifier, nested.
LEAVES = st.sampled_from(["a", "b", "c", "0", "1", " ", r"\.", r"\+", "[a-c]", "[0-9]", "[^ab]", ".", "[ab1]"])


def _combine(children):
    pair = st.tuples(children, children)
    return st.one_of(pair.map(lambda p: p[0] + p[1]), pair.map(lambda p: f"({p[0]}|{p[1]})"),
                     st.tuples(children, st.sampled_from(["*", "+", "?", "{2}", "{1,3}", "{0,2}", "{2,}"]))
                     .map(lambda p: f"({p[0]}){p[1]}"))


REGEXES = st.recursive(LEAVES, _combine, max_leaves=6)


@settings(max_examples=150, deadline=None)
@given(regex=REGEXES, text=st.text(alphabet="abc01 .+xd\n", max_size=8))
@example(regex="((a){2,})*", text="a")          # a skip once landed inside an inner loop: one "a" matched
@example(regex="((a){2,}){0,2}", text="aaa")
def test_teaching_dfa_matches_what_python_re_matches(regex, text):
    assert DFA(regex).matches(text.encode()) == (re.fullmatch(regex, text) is not None)


@settings(max_examples=120, deadline=None)
@given(regex=REGEXES, walk=st.lists(st.integers(0, 255), max_size=10))
@example(regex="((a){2,})*", walk=[0])
def test_teaching_and_library_masks_agree(regex, walk):
    """Walk both matchers over the same bytes (each drawn byte, or an allowed one when it is refused): at every
    step the 256-wide masks and the accepting flags are equal."""
    teach, lib = TeachingMatcher(DFA(regex)), LLGuidanceMatcher(compile_grammar("regex", regex))
    for b in walk + [None]:
        allowed = teach.allowed()
        assert torch.equal(allowed, lib.allowed()), f"{regex!r} after {bytes(teach_path(teach))!r}"
        assert teach.is_accepting() == lib.is_accepting()
        if b is None or not allowed.any():
            return
        ok = allowed.nonzero().flatten().tolist()
        b = b if allowed[b] else ok[b % len(ok)]
        assert teach.accept(b) and lib.accept(b)


def teach_path(m):
    """The bytes a teaching matcher took (rebuilt from its states, for the failure message)."""
    return [next(b for b in range(256) if m.dfa.next[s][b] == t) for s, t in zip(m.states, m.states[1:])]


@pytest.mark.parametrize("make", [lambda r: TeachingMatcher(DFA(r)),
                                  lambda r: LLGuidanceMatcher(compile_grammar("regex", r))], ids=["teaching", "llg"])
def test_rollback_and_row_masks(make):
    m = make("ab(c|d)e")
    start = m.allowed().clone()
    assert m.accept(ord("a")) and m.accept(ord("b"))
    after_ab = m.allowed().clone()
    assert after_ab.nonzero().flatten().tolist() == [ord("c"), ord("d")]
    assert not m.accept(ord("x")), "a refused byte leaves the state as it was"
    assert torch.equal(m.allowed(), after_ab)
    m.rollback(2)
    assert torch.equal(m.allowed(), start)
    # a chain of drafts "a", "b", "x", "e": row j is the mask after drafts 0..j-1; under the refused "x", all True
    rows = row_masks(m, [ord(c) for c in "abxe"])
    assert rows[0].nonzero().flatten().tolist() == [ord("a")] and torch.equal(rows[2], after_ab)
    assert rows[3].all() and rows[4].all() and torch.equal(m.allowed(), start), "row_masks moves nothing"
    # a tree: root -> "a" -> {"b" -> "c", "x"}: node i's row is its own path's state
    rows = row_masks(m, [ord(c) for c in "abxc"], parents=[-1, 0, 1, 1, 2])
    assert torch.equal(rows[2], after_ab) and rows[3].all()
    assert rows[4].nonzero().flatten().tolist() == [ord("e")]
    # advance: the grammar ends after "abce": the rest is dropped, finish "stop"
    assert advance(m, [ord(c) for c in "abcexy"]) == ([ord(c) for c in "abce"], "stop")


@pytest.mark.parametrize("regex,match", [("a(", "unclosed group"), ("*a", "nothing to repeat"),
                                         ("a{3,1}", "max < min"), ("[ab", "unclosed"), ("\\q", "unknown escape"),
                                         ("é", "ASCII"), ("a)", "unexpected")])
def test_teaching_parser_says_what_is_wrong(regex, match):
    with pytest.raises(ValueError, match=match):
        parse(regex)


def test_dot_is_one_utf8_character():
    d = DFA(".")
    assert d.matches("é".encode()) and d.matches("😀".encode()) and d.matches(b"a")
    assert not d.matches(b"\n") and not d.matches(b"\xed\xa0\x80"), "no newline, no surrogate"
    assert not d.matches(b"\xc3") and not d.matches(b"\x80"), "no half character, no stray continuation byte"
