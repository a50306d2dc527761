"""Exercise 5: prompt lookup decoding, the proposer without a model (Saxena, 2023; vLLM's "ngram").

Speculative decoding needs someone to guess the next k tokens. Text, and code
even more, repeats itself: names, indentation, ``self.``. So guess that it
repeats: take the last n tokens of the sequence, find where that n-gram occurred
*before* in the sequence's own context (prompt + output so far), and propose the
tokens that followed it there. The target model checks the guess (exercise 4),
so a wrong guess costs a little compute and never changes the output.

    tokens = [a, b, c, d, a, b]   n = 2: the last 2-gram is [a, b]; it occurred at 0;
                                  what followed it there: [c, d, a, b] -> propose [c, d] for k = 2

Run the tests:  MINIBATCH_STUDENT=ngram python -m pytest tests/exercises -m ex5
"""
from __future__ import annotations


def ngram_propose(token_ids: list[int], k: int, n_max: int = 3, n_min: int = 1) -> list[int]:
    """Up to k proposed tokens (a list of ints), or [] when no n-gram matches.

    For n = n_max down to n_min (longer matches first: they predict better):
      * the pattern is the last n tokens;
      * find its *earliest* occurrence: the smallest start index s < len - n with
        token_ids[s:s+n] == pattern (the trailing n-gram itself does not count, but an
        earlier occurrence may overlap it). The earliest, as vLLM and Hugging Face take it:
        in repetitive text the most recent one sits just before the end, so little follows it;
      * if found, return the up to k tokens that followed it, token_ids[s+n : s+n+k]
        (fewer than k when the context ends first).
    n never exceeds len(token_ids) - 1. k == 0 -> []. Token ids are any ints (bytes: 0..255),
    not digits; compare them as ints. ``token_ids`` is the sequence itself: read it, never change it.

    Plain Python lists and slices are all you need (``exercises/hints/ex5.md`` if you are stuck).
    """
    raise NotImplementedError("Exercise 5: ngram_propose (exercises/ex5_ngram.py)")
