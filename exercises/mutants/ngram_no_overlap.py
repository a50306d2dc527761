"""Mutant (exercise 5): insists that the earlier occurrence end before the trailing n-gram starts,
so an overlapping earlier match ([1, 1, 1 | 1]) is missed."""


def ngram_propose(token_ids, k, n_max=3, n_min=1):
    tokens, L = list(token_ids), len(token_ids)
    if k == 0:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for start in range(L - 2 * n + 1):                   # BUG: should run to L - n - 1
            if tokens[start:start + n] == tokens[L - n:]:
                return tokens[start + n:start + n + k]
    return []
