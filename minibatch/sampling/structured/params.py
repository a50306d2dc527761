"""What a request asks its output to be: vLLM's ``StructuredOutputsParams`` (vllm/sampling_params.py).

Exactly one of ``json`` (a JSON schema, as a dict or a string), ``json_object`` (any JSON object), ``regex``,
``choice`` (a list of strings) or ``grammar`` (Lark or GBNF) is set. ``backend`` picks who turns it into masks:
"llguidance" (the library, every kind; backend.py) or "teaching" (regex and choice only; teaching.py), as
vLLM's older ``GuidedDecodingParams.backend`` did per request.

The constraint is compiled once, here, when the params are made: a schema or regex that does not compile, or a
grammar that admits no string, is a ValueError at the boundary (a 400 from the server), never a failure mid-step.
Each sequence then gets its own matcher from the compiled form (``new_matcher``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Union

from minibatch.sampling.structured.backend import LLGuidanceMatcher, compile_grammar
from minibatch.sampling.structured.teaching import DFA, TeachingMatcher

KINDS = ("json", "json_object", "regex", "choice", "grammar")
BACKENDS = ("llguidance", "teaching")


@dataclass
class StructuredOutputsParams:
    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False      # JSON without optional whitespace (vLLM's name)
    backend: str = "llguidance"
    _compiled: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {list(KINDS)}, got {set_ or 'none'}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown structured_outputs backend {self.backend!r}; choose one of {list(BACKENDS)}")
        kind, spec = self.kind, getattr(self, self.kind)
        if kind == "choice" and (not isinstance(spec, (list, tuple)) or not spec
                                 or not all(isinstance(c, str) and c for c in spec)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got {spec!r}")
        if kind in ("regex", "grammar") and not isinstance(spec, str):
            raise ValueError(f"structured_outputs.{kind} must be a string, got {type(spec).__name__}")
        if kind == "json" and not isinstance(spec, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or str), got {type(spec).__name__}")
        if self.backend == "teaching":
            if kind not in ("regex", "choice"):
                raise ValueError(f"the teaching backend compiles regex and choice only, not {kind!r}; "
                                 f"use backend='llguidance'")
            try:
                self._compiled = DFA(spec if kind == "regex" else "|".join(map(re.escape, spec)))
            except ValueError as e:
                raise ValueError(f"structured_outputs.{kind}: {e}") from None
        else:
            if kind == "json_object":
                kind, spec = "json", {"type": "object"}
            self._compiled = compile_grammar(kind, spec, self.disable_any_whitespace)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def new_matcher(self):
        """A fresh matcher at the grammar's start, for one sequence."""
        if self.backend == "teaching":
            return TeachingMatcher(self._compiled)
        return LLGuidanceMatcher(self._compiled)


def structured_outputs_params(value) -> Optional[StructuredOutputsParams]:
    """None, a StructuredOutputsParams, or its fields as a dict (as the server's JSON gives them) -> params."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = set(value) - set(KINDS) - {"disable_any_whitespace", "backend"}
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {sorted(unknown)}; choose from "
                             f"{list(KINDS) + ['disable_any_whitespace', 'backend']}")
        return StructuredOutputsParams(**value)
    raise TypeError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {type(value).__name__}")
