"""Mutant (exercise 5): tries the shortest n-gram first (n_min up), so long matches never win."""


def ngram_propose(token_ids, k, n_max=3, n_min=1):
    tokens, L = list(token_ids), len(token_ids)
    if k == 0:
        return []
    for n in range(n_min, min(n_max, L - 1) + 1):            # BUG: should go from n_max down
        for start in range(L - n):
            if tokens[start:start + n] == tokens[L - n:]:
                return tokens[start + n:start + n + k]
    return []
