"""Mutant (exercise 5): returns everything that followed the match, not at most k tokens."""


def ngram_propose(token_ids, k, n_max=3, n_min=1):
    tokens, L = list(token_ids), len(token_ids)
    if k == 0:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for start in range(L - n):
            if tokens[start:start + n] == tokens[L - n:]:
                return tokens[start + n:]                     # BUG: [:k] forgotten
    return []
