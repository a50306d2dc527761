"""Structured outputs: a grammar becomes a mask over the 256 bytes, one per sampled row.

teaching.py (a regex's automaton, readable), backend.py (llguidance, the library), params.py (vLLM's
``StructuredOutputsParams``), matcher.py (the engine's side: masks per row, advance and roll back),
reference.py (the slow oracle: the no-cache model under the teaching matcher's masks).
"""
from minibatch.sampling.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
