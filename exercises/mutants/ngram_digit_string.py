"""Mutant (exercise 5): searches a string of the tokens' digits, one character per token: right while every
token id is a single digit, wrong as soon as one is not (a byte-level vocabulary has ids up to 255)."""


def ngram_propose(token_ids, k, n_max=3, n_min=1):
    text = "".join(str(t) for t in token_ids)                  # BUG: "12" is two characters, not one token
    L = len(text)
    if k == 0:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        start = text.find(text[L - n:], 0, L - 1)             # earliest occurrence before the end (may overlap)
        if start != -1:
            return [int(c) for c in text[start + n:start + n + k]]
    return []
