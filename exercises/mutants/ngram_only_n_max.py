"""Mutant (exercise 5): tries only the longest n-gram and gives up, never falling back to shorter ones."""


def ngram_propose(token_ids, k, n_max=3, n_min=1):
    tokens, L = list(token_ids), len(token_ids)
    if k == 0 or L < 2:
        return []
    n = min(n_max, L - 1)                                     # BUG: should loop n down to n_min
    if n < n_min:
        return []
    for start in range(L - n):
        if tokens[start:start + n] == tokens[L - n:]:
            return tokens[start + n:start + n + k]
    return []
