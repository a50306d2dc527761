"""Mutant (exercise 5): proposes the matched n-gram and what follows it, instead of only what follows it."""


def ngram_propose(token_ids, k, n_max=3, n_min=1):
    tokens, L = list(token_ids), len(token_ids)
    if k == 0:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for start in range(L - n):
            if tokens[start:start + n] == tokens[L - n:]:
                return tokens[start:start + k]               # BUG: tokens[start + n:start + n + k]
    return []
