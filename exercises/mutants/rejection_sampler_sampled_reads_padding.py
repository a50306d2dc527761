"""Mutant (exercise 4): sampled rows verify all k draft slots, padding included (num_draft_tokens is
honoured for greedy rows only)."""
import torch


def rejection_sample(draft_token_ids, draft_probs, target_probs, generators=None, num_draft_tokens=None,
                     greedy=None):
    B, k = draft_token_ids.shape
    ks = [k] * B if num_draft_tokens is None else list(num_draft_tokens)
    greedy = [False] * B if greedy is None else list(greedy)
    p_all = target_probs.double().cpu()
    q_all = None if draft_probs is None else draft_probs.double().cpu()
    drafts = draft_token_ids.tolist()
    rows, accepted = [], []
    for b in range(B):
        g = generators[b] if generators is not None else None
        n = 0
        while n < (ks[b] if greedy[b] else k):               # BUG: ks[b] for sampled rows too
            x = drafts[b][n]
            p = float(p_all[b, n, x])
            q = 1.0 if q_all is None else float(q_all[b, n, x])
            if greedy[b]:
                ok = x == int(p_all[b, n].argmax())
            else:
                u = float(torch.rand((), dtype=torch.float64, generator=g))
                ok = u * q < p
            if not ok:
                break
            n += 1
        if greedy[b]:
            extra = int(p_all[b, n].argmax())
        else:
            dist = p_all[b, n]
            if n < k:
                if q_all is None:
                    residual = dist.clone()
                    residual[drafts[b][n]] = 0
                else:
                    residual = (dist - q_all[b, n]).clamp(min=0)
                if residual.sum() > 0:
                    dist = residual
            extra = int(torch.multinomial(dist, 1, generator=g))
        rows.append(drafts[b][:n] + [extra] + [-1] * (k - n))
        accepted.append(n)
    return torch.tensor(rows, dtype=torch.int64).view(B, k + 1), torch.tensor(accepted, dtype=torch.int64)
