"""Mutant (exercise 5): takes the most recent earlier occurrence of the n-gram instead of the earliest (what
minibatch itself did until it followed vLLM: right in a match's tokens, but little follows a match near the end)."""


def ngram_propose(token_ids, k, n_max=3, n_min=1):
    tokens, L = list(token_ids), len(token_ids)
    if k == 0:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for start in range(L - n - 1, -1, -1):                # BUG: should scan from 0 up
            if tokens[start:start + n] == tokens[L - n:]:
                return tokens[start + n:start + n + k]
    return []
