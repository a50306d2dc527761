"""Mutant (exercise 5): joins the ids with commas and searches the string, mapping a hit back by counting commas;
"1,2" is also found inside "11,2", a match that starts in the middle of a token."""


def ngram_propose(token_ids, k, n_max=3, n_min=1):
    tokens, L = list(token_ids), len(token_ids)
    if k == 0:
        return []
    text = ",".join(str(t) for t in tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pattern = ",".join(str(t) for t in tokens[L - n:])
        trailing = len(text) - len(pattern)                   # where the trailing n-gram starts in the text
        at = text.find(pattern, 0, trailing + len(pattern) - 1)
        if at != -1:
            start = text[:at].count(",")                      # BUG: no check that the hit starts at a token
            return tokens[start + n:start + n + k]
    return []
