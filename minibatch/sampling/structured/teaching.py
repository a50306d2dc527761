"""The idea under structured outputs, small enough to read: a regex becomes an automaton over bytes, and each
state of that automaton becomes a 256-wide mask of the bytes allowed next.

With a byte-level vocabulary (token i is byte i) the mask *is* the automaton's transition table: the model may
emit byte b in state s exactly when s has a transition on b that can still reach an accepting state. Three steps:

1. ``parse``: the regex -> a small syntax tree (literals, classes, ``.``, groups, ``|``, ``* + ? {m,n}``).
2. ``NFA``: Thompson's construction (Thompson 1968): each tree node becomes a fragment of states joined by
   byte-set edges and empty (epsilon) edges. A character is a *sequence* of bytes: ``.`` (any Unicode scalar
   but ``\\n``) and ``[^...]`` (any but those listed) match non-ASCII characters too, so they expand into the
   UTF-8 byte automaton (RFC 3629 §4), as a byte tokenizer's model must see them.
3. ``DFA``: the subset construction (Rabin & Scott 1959) over the 256 bytes. Row s of the mask allows byte b
   when state s has a transition on b. (A state from which no accepting state can be reached would be *dead*,
   and a byte into it must not be allowed, or the model could walk into a dead end. Thompson's construction
   from this syntax, which has no empty class, makes none; a library with intersection or negation does, and
   prunes them: llguidance's ``&`` and ``~``.)

``DFA.masks`` is [num_states, 256] bool: row s is the mask in state s. ``TeachingMatcher`` walks it, keeping the
states it visited so that it can roll back (speculation's rejected drafts). The library backend (backend.py)
does the same for JSON schemas and grammars, lazily and much faster; tests hold the two equal on regexes.
"""
from __future__ import annotations

import torch

ALL = (1 << 256) - 1                          # a byte set is a 256-bit int: bit b set = byte b in the set
ASCII = (1 << 128) - 1
NEWLINE = 1 << 10


def _set(*ranges) -> int:
    """Byte set from inclusive (lo, hi) ranges."""
    return sum(((1 << (hi + 1)) - (1 << lo)) for lo, hi in ranges)


_ESCAPES = {"d": _set((48, 57)), "w": _set((48, 57), (65, 90), (97, 122), (95, 95)),
            "s": _set((9, 13), (32, 32)), "n": NEWLINE, "t": 1 << 9, "r": 1 << 13}
# A non-ASCII Unicode scalar as UTF-8 byte sequences (RFC 3629 §4): each a list of byte sets, one per byte.
_CONT = _set((0x80, 0xBF))
UTF8_MULTIBYTE = [[_set((0xC2, 0xDF)), _CONT],
                  [1 << 0xE0, _set((0xA0, 0xBF)), _CONT], [_set((0xE1, 0xEC), (0xEE, 0xEF)), _CONT, _CONT],
                  [1 << 0xED, _set((0x80, 0x9F)), _CONT],
                  [1 << 0xF0, _set((0x90, 0xBF)), _CONT, _CONT], [_set((0xF1, 0xF3)), _CONT, _CONT, _CONT],
                  [1 << 0xF4, _set((0x80, 0x8F)), _CONT, _CONT]]


# -- 1. parse ------------------------------------------------------------------------------------------------
# A tree node is a tuple: ("bytes", set) one ASCII byte of a set; ("any", ascii_set) that set or any non-ASCII
# character; ("cat", [nodes]); ("alt", [nodes]); ("rep", node, lo, hi) with hi None for unbounded.

def parse(regex: str):
    """Regex (ASCII syntax: literals, escapes \\d \\w \\s \\n \\t, [classes], [^negated], ., (groups), |,
    * + ? {m} {m,} {m,n}) -> syntax tree. Raises ValueError saying where it fails."""
    if not isinstance(regex, str):
        raise TypeError(f"regex must be a str, got {type(regex).__name__}")
    if not regex.isascii():
        raise ValueError("the teaching regex takes ASCII syntax only (escape other bytes as a class, or use the "
                         "llguidance backend)")
    node, i = _alt(regex, 0)
    if i != len(regex):
        raise ValueError(f"regex {regex!r}: unexpected {regex[i]!r} at {i}")
    return node


def _alt(s, i):
    parts = []
    node, i = _cat(s, i)
    parts.append(node)
    while i < len(s) and s[i] == "|":
        node, i = _cat(s, i + 1)
        parts.append(node)
    return (parts[0] if len(parts) == 1 else ("alt", parts)), i


def _cat(s, i):
    items = []
    while i < len(s) and s[i] not in "|)":
        atom, i = _atom(s, i)
        while i < len(s) and s[i] in "*+?{":
            atom, i = _quantifier(s, i, atom)
        items.append(atom)
    return ("cat", items), i


def _quantifier(s, i, atom):
    if s[i] != "{":
        return ("rep", atom, {"*": 0, "+": 1, "?": 0}[s[i]], 1 if s[i] == "?" else None), i + 1
    j = s.find("}", i)
    body = s[i + 1:j].split(",") if j > 0 else []
    if not 1 <= len(body) <= 2 or not body[0].isdigit() or not (len(body) == 1 or body[1] == "" or body[1].isdigit()):
        raise ValueError(f"regex {s!r}: bad repetition at {i} (write {{m}}, {{m,}} or {{m,n}})")
    lo = int(body[0])
    hi = lo if len(body) == 1 else (None if body[1] == "" else int(body[1]))
    if hi is not None and hi < lo:
        raise ValueError(f"regex {s!r}: repetition {{{lo},{hi}}} has max < min")
    return ("rep", atom, lo, hi), j + 1


def _atom(s, i):
    c = s[i]
    if c == "(":
        node, i = _alt(s, i + 1)
        if i >= len(s) or s[i] != ")":
            raise ValueError(f"regex {s!r}: unclosed group")
        return node, i + 1
    if c == "[":
        return _class(s, i + 1)
    if c == ".":
        return ("any", ASCII & ~NEWLINE), i + 1
    if c == "\\":
        if i + 1 >= len(s):
            raise ValueError(f"regex {s!r}: a trailing backslash")
        e = s[i + 1]
        return ("bytes", _ESCAPES.get(e, 1 << ord(e)) if not e.isalnum() or e in _ESCAPES else _bad(s, e)), i + 2
    if c in "*+?{})":
        raise ValueError(f"regex {s!r}: nothing to repeat, or unbalanced, at {i} ({c!r})")
    return ("bytes", 1 << ord(c)), i + 1


def _bad(s, e):
    raise ValueError(f"regex {s!r}: unknown escape \\{e}")


def _class(s, i):
    negate = i < len(s) and s[i] == "^"
    i += negate
    members, first = 0, True
    while i < len(s) and (s[i] != "]" or first):
        first = False
        if s[i] == "\\" and i + 1 < len(s):
            lo_set, i = _ESCAPES.get(s[i + 1], 1 << ord(s[i + 1])), i + 2
        else:
            lo_set, i = 1 << ord(s[i]), i + 1
        if i + 1 < len(s) and s[i] == "-" and s[i + 1] != "]" and lo_set.bit_count() == 1:
            lo, hi = lo_set.bit_length() - 1, ord(s[i + 1])
            if hi < lo:
                raise ValueError(f"regex {s!r}: class range out of order")
            lo_set, i = _set((lo, hi)), i + 2
        members |= lo_set
    if i >= len(s):
        raise ValueError(f"regex {s!r}: unclosed [class]")
    return (("any", ASCII & ~members) if negate else ("bytes", members)), i + 1


# -- 2. Thompson's NFA ------------------------------------------------------------------------------------------

class NFA:
    """States 0..n-1; ``edges[s]`` = [(byte_set, t)]; ``eps[s]`` = [t]; one start and one accepting state."""

    def __init__(self, tree):
        self.edges, self.eps = [], []
        self.start, self.accept = self._build(tree)

    def _new(self) -> int:
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def _chain(self, sets):
        """A path of byte-set edges: one fragment (start, end)."""
        start = cur = self._new()
        for b in sets:
            nxt = self._new()
            self.edges[cur].append((b, nxt))
            cur = nxt
        return start, cur

    def _build(self, node):
        kind = node[0]
        if kind == "bytes":
            return self._chain([node[1]])
        if kind == "any":                       # one ASCII byte of the set, or one whole multibyte character
            s, e = self._new(), self._new()
            for seq in [[node[1]]] + UTF8_MULTIBYTE:
                a, b = self._chain(seq)
                self.eps[s].append(a)
                self.eps[b].append(e)
            return s, e
        if kind == "cat":
            s = e = self._new()
            for child in node[1]:
                a, b = self._build(child)
                self.eps[e].append(a)
                e = b
            return s, e
        if kind == "alt":
            s, e = self._new(), self._new()
            for child in node[1]:
                a, b = self._build(child)
                self.eps[s].append(a)
                self.eps[b].append(e)
            return s, e
        _, child, lo, hi = node                # rep: lo copies, then (hi - lo) optional ones, or a loop
        s = e = self._new()
        for k in range(lo if hi is not None else max(lo, 1)):
            a, b = self._build(child)
            self.eps[e].append(a)
            if hi is None and k == max(lo, 1) - 1:
                self.eps[b].append(a)          # the last copy loops: x{m,} = x^(m-1) x+
            e = b
        # Every skip lands on a fresh state, never on a copy's end: that end may have an edge back into the copy
        # (an inner loop, as in (a{2,})*), and a skip onto it would let a partial copy count as a whole one.
        end = self._new()
        self.eps[e].append(end)
        if hi is None and lo == 0:             # x* = (x+)?
            self.eps[s].append(end)
        e = end
        for _ in range((hi - lo) if hi is not None else 0):
            a, b = self._build(child)
            end = self._new()
            self.eps[e] += [a, end]            # this optional copy, or skip it
            self.eps[b].append(end)
            e = end
        return s, e

    def closure(self, states) -> frozenset:
        seen, todo = set(states), list(states)
        while todo:
            for t in self.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)


# -- 3. the DFA and its masks ---------------------------------------------------------------------------------

class DFA:
    """The subset construction over bytes. ``next[s][b]`` is the state after byte b in
    state s (-1: not allowed); ``masks[s]`` [256] bool; ``accepting[s]``; state 0 is the start."""

    def __init__(self, regex: str):
        nfa = NFA(parse(regex))
        start = nfa.closure([nfa.start])
        index, sets, nxt = {start: 0}, [start], []
        while len(nxt) < len(sets):                 # breadth first over the state sets reached so far
            cur, row = sets[len(nxt)], [-1] * 256
            for b in range(256):
                to = [t for s in cur for bs, t in nfa.edges[s] if bs >> b & 1]
                if to:
                    c = nfa.closure(to)
                    if c not in index:
                        index[c] = len(sets)
                        sets.append(c)
                    row[b] = index[c]
            nxt.append(row)
        self.next, self.accepting = nxt, [nfa.accept in s for s in sets]
        self.masks = torch.tensor([[t >= 0 for t in row] for row in nxt], dtype=torch.bool)

    def matches(self, data: bytes) -> bool:
        s = 0
        for b in data:
            s = self.next[s][b]
            if s < 0:
                return False
        return self.accepting[s]


class TeachingMatcher:
    """One sequence's position in a DFA: ``allowed()`` [256] bool, ``accept(token)``, ``rollback(n)``."""

    def __init__(self, dfa: DFA):
        self.dfa, self.states = dfa, [0]       # every state visited, so rollback is a pop

    def allowed(self) -> torch.Tensor:
        return self.dfa.masks[self.states[-1]]

    def is_accepting(self) -> bool:
        return self.dfa.accepting[self.states[-1]]

    def accept(self, token: int) -> bool:
        t = self.dfa.next[self.states[-1]][token]
        if t >= 0:
            self.states.append(t)
        return t >= 0

    def rollback(self, n: int) -> None:
        if not 0 <= n < len(self.states):
            raise ValueError(f"cannot roll back {n} tokens: only {len(self.states) - 1} were accepted")
        del self.states[len(self.states) - n:]
