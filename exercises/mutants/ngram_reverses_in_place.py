"""Mutant (exercise 5): reverses the caller's list in place to scan from the end (list.reverse() returns
None and changes the list: the engine's sequence is now backwards)."""


def ngram_propose(token_ids, k, n_max=3, n_min=1):
    L = len(token_ids)
    if k == 0:
        return []
    token_ids.reverse()                                       # BUG: the caller's list, reversed for good
    rev = token_ids                                           # rev[j] is token L - 1 - j
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pattern = rev[:n]
        for r in range(1, L - n + 1):                         # an earlier occurrence ends at token L - 1 - r
            if rev[r:r + n] == pattern:
                follow = rev[max(0, r - k):r]
                return follow[::-1]
    return []
