"""The library backend: llguidance (Microsoft's guidance project, Rust; one of vLLM's structured-output backends,
with xgrammar, outlines-core and guidance).

Why llguidance, for a 256-byte vocabulary on this machine:
- it installs alone: one abi3 wheel and *no* dependencies (xgrammar 0.2.9 pulls in transformers, torch and a
  TVM runtime; a wrong torch would be a several-GB mistake on a CPU machine);
- it takes any tokenizer as a plain list of token byte strings, so "token i is byte i" is four lines, with no
  Hugging Face tokenizer to fake;
- it compiles JSON schemas, regexes, Lark/GBNF grammars and choices lazily (an Earley parser over a lexer of
  derivative-based regexes), so a grammar costs milliseconds to start, not a whole automaton up front;
- its matcher has ``rollback(n)``, which speculation needs when drafts are rejected.

llguidance wants an end-of-sequence token: the mask's bit for it says "the grammar may end here". minibatch's
model has none (a byte model stops on length or stop strings), so the matcher's vocabulary is 257 entries,
byte i for i < 256 and an EOS token 256 that the model never emits: bit 256 is read as "accepting", and the
first 256 bits are the byte mask the model samples under.
"""
from __future__ import annotations

import functools
import json

import numpy as np
import torch

EOS = 256                                     # the matcher's end-of-sequence token: "the grammar may end here"
INSTALL = "pip install llguidance==1.9.1"     # requirements.txt's pin


class StructuredOutputsUnavailable(ImportError, ValueError):
    """A request asked for structured outputs where llguidance is not installed. A ValueError too, so that the
    server answers that request 400 (a bad request for this server), while every other request runs."""


@functools.cache
def llguidance():
    """The library, imported the first time a request asks for it: the rest of the engine runs without it."""
    try:
        import llguidance as llg
    except ImportError as e:
        raise StructuredOutputsUnavailable(
            f"structured outputs with backend 'llguidance' need the llguidance package, which is not installed "
            f"({e}): {INSTALL} (or use backend='teaching' for a regex or a choice)") from None
    return llg


class _ByteTokenizer:
    """What ``llguidance.TokenizerWrapper`` reads: token i is the byte i, plus an EOS token no text encodes to."""
    eos_token_id, bos_token_id = EOS, None
    tokens = [bytes([i]) for i in range(256)] + [b"\xff[EOS]"]
    special_token_ids = [EOS]

    def __call__(self, data):
        return list(data)


@functools.cache
def tokenizer():
    """llguidance's LLTokenizer over the 257 tokens."""
    llg = llguidance()
    # slices=[]: the slicer speeds up masks over 100k-token vocabularies; over 257 it only costs.
    return llg.LLTokenizer(llg.TokenizerWrapper(_ByteTokenizer()), slices=[])


def compile_grammar(kind: str, spec, disable_any_whitespace: bool = False) -> str:
    """One structured-outputs constraint -> an llguidance grammar, checked: raises ValueError with the library's
    message when it does not compile or admits no string. kind: "json", "regex", "choice" or "grammar"."""
    llg = llguidance()
    if kind == "json":
        schema = spec if isinstance(spec, str) else json.dumps(spec)
        opts = {"whitespace_flexible": False} if disable_any_whitespace else None
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=opts)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not a valid JSON schema: {e}") from None
    elif kind == "regex":
        grammar = llg.LLMatcher.grammar_from_regex(spec)
    elif kind == "choice":                    # a Lark alternation of JSON-quoted literals
        grammar = llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
    else:                                     # "grammar": Lark, or llama.cpp's GBNF (llguidance converts it)
        try:
            grammar = llg.grammar_from("grammar", spec)
        except ValueError as e:
            raise ValueError(f"structured_outputs.grammar does not compile: {e}") from None
    m = _start(grammar)
    if m.is_error():
        raise ValueError(f"structured_outputs.{kind} does not compile: {m.get_error().strip()}")
    first = LLGuidanceMatcher(grammar)
    if not first.allowed().any() and not first.is_accepting():
        raise ValueError(f"structured_outputs.{kind} admits no string")
    return grammar


@functools.lru_cache(maxsize=256)
def _start(grammar: str):
    """A matcher at the grammar's start, made once per grammar (~6 ms: the lexer and parser are built) and only
    ever copied (``deep_copy``, ~1 us), as vLLM's backends cache compiled grammars. Never consumed itself."""
    return llguidance().LLMatcher(tokenizer(), grammar, log_level=0)


class LLGuidanceMatcher:
    """One sequence's state in an llguidance grammar, with the teaching matcher's interface."""

    def __init__(self, grammar: str):
        self.grammar = grammar
        self.m = _start(grammar).deep_copy()

    def _bits(self) -> np.ndarray:
        return np.unpackbits(np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8), bitorder="little")

    def allowed(self) -> torch.Tensor:
        """[256] bool: the bytes the grammar allows next (none once it is stopped)."""
        return torch.from_numpy(self._bits()[:256].astype(bool))

    def is_accepting(self) -> bool:
        return self.m.is_accepting()

    def accept(self, token: int) -> bool:
        """Consume one byte if the grammar allows it; a refused byte leaves the state as it was."""
        if self.m.is_stopped() or self.m.validate_tokens([token]) != 1:
            return False
        return self.m.consume_token(token)

    def rollback(self, n: int) -> None:
        if n and not self.m.rollback(n):
            raise ValueError(f"llguidance could not roll back {n} tokens: {self.m.get_error()}")
