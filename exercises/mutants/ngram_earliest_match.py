"""Mutant (exercise 5): takes the earliest occurrence of the n-gram instead of the most recent."""


def ngram_propose(token_ids, k, n_max=3, n_min=1):
    tokens, L = list(token_ids), len(token_ids)
    if k == 0:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for start in range(0, L - n):                         # BUG: should scan from L - n - 1 down
            if tokens[start:start + n] == tokens[L - n:]:
                return tokens[start + n:start + n + k]
    return []
