"""Mutant (exercise 5): lets the trailing n-gram match itself, which has nothing after it."""


def ngram_propose(token_ids, k, n_max=3, n_min=1):
    tokens, L = list(token_ids), len(token_ids)
    if k == 0:
        return []
    for n in range(min(n_max, L), n_min - 1, -1):
        for start in range(L - n + 1):                        # BUG: start = L - n is the pattern itself
            if tokens[start:start + n] == tokens[L - n:]:
                return tokens[start + n:start + n + k]
    return []
