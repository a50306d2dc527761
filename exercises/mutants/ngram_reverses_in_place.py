"""Mutant (exercise 5): reverses the caller's list in place on its way to a reversed copy (list.reverse()
returns None and changes the list: the engine's sequence is now backwards)."""


def ngram_propose(token_ids, k, n_max=3, n_min=1):
    L = len(token_ids)
    if k == 0:
        return []
    token_ids.reverse()                                       # BUG: the caller's list, reversed for good
    tokens = token_ids[::-1]                                  # ... to read it forwards again from a copy
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for start in range(L - n):
            if tokens[start:start + n] == tokens[L - n:]:
                return tokens[start + n:start + n + k]
    return []
