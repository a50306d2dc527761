"""What each speculative head learns, and how it is scored on held-out code (``train_heads.py`` runs them).

Every loss reads tensors the frozen target computed once (``train_heads.precompute``): tokens[W, S + 1] and
hidden states {key: [W, S, C]} over W windows of S bytes; w and t (or idx) pick the windows and positions
of a batch. The heads themselves are in ``heads.py``.

* Medusa-1 (Cai et al. 2024 §2.1.1): head i at h_t learns token t + 2 + i, loss sum_i 0.8^i CE_i; with a
  teacher head, the target's own distribution at t + 1 + i instead (self-distillation, §2.3.2).
* Early exit (LayerSkip §3, Kangaroo §3.1): the adapter after E blocks learns the full target's distribution.
* EAGLE (Li et al. 2024 §4.2): SmoothL1 to the next feature + 0.1 x CE to the target's distribution, with
  uniform noise on the input features.
* EAGLE-3 (Li et al. 2025 §3.2): CE to the target's distribution only, rolled out k steps on its own outputs
  (the training-time test), loss sum_j 0.8^j CE_j.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from minibatch.model.heads import token_embedding
from minibatch.model.training import batched_causal_attention

MEDUSA_DECAY = 0.8                    # lambda_i = 0.8^i (Medusa §2.1.1)


# -- Medusa ----------------------------------------------------------------------------------------------------------

def medusa_loss(heads, toks, hidden, w, t, teacher_head=None):
    """Sum over heads of 0.8^i x CE(head i at h_t, token t + 2 + i); w, t: [B] windows and positions.

    With ``teacher_head`` (the target's tied head, ``--distill``): the label of head i is the target's own
    distribution at position t + 1 + i (which predicts token t + 2 + i from the corpus prefix), a soft
    cross-entropy (self-distillation, Medusa §2.3.2): the heads learn what the target would say, which is
    what a verify pass accepts, instead of what the corpus says."""
    logits = heads(hidden["final"][w, t].float())                    # [B, K, V]
    K = logits.shape[1]
    if teacher_head is None:
        targets = toks[w[:, None], t[:, None] + 2 + torch.arange(K)]  # [B, K]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none").view(-1, K)
    else:
        with torch.no_grad():
            p = (hidden["final"][w[:, None], t[:, None] + 1 + torch.arange(K)].float() @ teacher_head.t()).softmax(-1)
        ce = -(p * logits.log_softmax(-1)).sum(-1)                    # [B, K]
    return (ce.mean(0) * MEDUSA_DECAY ** torch.arange(K)).sum()


@torch.no_grad()
def medusa_eval(heads, target, toks, hidden) -> dict:
    """Top-1 / top-5 accuracy of each head on every held-out position that has its target token, and how often
    its top-1 is the target's own argmax for that token (given the true prefix): what greedy decoding accepts."""
    W, S, C = hidden["final"].shape
    K = heads.num_heads
    h = hidden["final"][:, : S - K - 1].reshape(-1, C).float()         # [W * (S-K-1), C]
    logits = heads(h)                                                  # [N, K, V]
    top5 = logits.topk(5, dim=-1).indices                              # [N, K, 5]
    wte = token_embedding(target).t().float()
    base = (h @ wte).argmax(-1)                                        # the target's own guess of t + 1
    out = {"target_top1_t+1": (base == toks[:, 1: S - K].reshape(-1)).float().mean().item()}
    for i in range(K):
        y = toks[:, 2 + i: S - K + 1 + i].reshape(-1)
        out[f"head{i}_top1_t+{2 + i}"] = (top5[:, i, 0] == y).float().mean().item()
        out[f"head{i}_top5_t+{2 + i}"] = (top5[:, i] == y[:, None]).any(-1).float().mean().item()
        teacher = (hidden["final"][:, 1 + i: S - K + i].reshape(-1, C).float() @ wte).argmax(-1)
        out[f"head{i}_agrees_with_target"] = (top5[:, i, 0] == teacher).float().mean().item()
    return out


def medusa_batch(toks, hidden, K, batch, rng):
    W, S = hidden["final"].shape[:2]
    return (torch.from_numpy(rng.integers(0, W, batch)), torch.from_numpy(rng.integers(0, S - K - 1, batch)))


# -- early exit -----------------------------------------------------------------------------------------------------

def exit_loss(adapter, target, toks, hidden, w, t):
    """Soft cross-entropy of the early exit (first E blocks + adapter + ln_f + head) against the full target."""
    with torch.no_grad():
        p = target.lm_head(hidden["final"][w, t].float()).softmax(-1)      # the target's p [B, V]
    logq = adapter.logits(target, hidden[adapter.exit_layer][w, t].float()).log_softmax(-1)
    return -(p * logq).sum(-1).mean()


@torch.no_grad()
def exit_eval(adapter, target, toks, hidden) -> dict:
    """Held-out: how often the early exit's argmax is the target's (greedy acceptance), and sum_x min(p, q)
    (the acceptance rate of one sampled draft at temperature 1, Leviathan et al. §3.1); with and without
    the adapter, so the adapter's worth shows."""
    E, C = adapter.exit_layer, hidden["final"].shape[-1]
    x, h = hidden[E].reshape(-1, C).float(), hidden["final"].reshape(-1, C).float()
    p = target.lm_head(h).softmax(-1)
    out = {}
    for name, logits in (("adapter", adapter.logits(target, x)), ("plain_exit", target.lm_head(target.final_norm(x)))):
        q = logits.softmax(-1)
        out[f"{name}_greedy_agreement"] = (q.argmax(-1) == p.argmax(-1)).float().mean().item()
        out[f"{name}_sampled_acceptance"] = torch.minimum(p, q).sum(-1).mean().item()
    return out


def position_batch(hidden, key, batch, rng):
    W, S = hidden[key].shape[:2]
    return torch.from_numpy(rng.integers(0, W, batch)), torch.from_numpy(rng.integers(0, S, batch))


# -- EAGLE ----------------------------------------------------------------------------------------------------------

EAGLE_CLS_WEIGHT = 0.1                # the CE term's weight beside the SmoothL1 on features (EAGLE §4.2)


def eagle_forward(head, target, toks, hidden, w, idx, noise: float = 0.0):
    """f^ [B, S, C] for entries at positions idx [B, S] of windows w [B]: entry p reads token p and f_{p-1}
    (with uniform noise in [-noise, noise] added, EAGLE §4.2: drafting will feed it its own imperfect f^)."""
    B, S = idx.shape
    f_prev = hidden["final"][w[:, None], idx - 1].float()                          # [B, S, C]
    if noise:
        f_prev = f_prev + (torch.rand(f_prev.shape) * 2 - 1) * noise
    out = head(target, toks[w[:, None], idx].reshape(-1), f_prev.reshape(B * S, -1), idx.reshape(-1),
               batched_causal_attention(B, S), 0)
    return out.view(B, S, -1)


def eagle_loss(head, target, toks, hidden, w, idx, noise):
    """SmoothL1(f^_p, f_p) + 0.1 x CE(head(f^_p), the target's distribution head(f_p)) (EAGLE §4.2)."""
    f_hat = eagle_forward(head, target, toks, hidden, w, idx, noise)
    f = hidden["final"][w[:, None], idx].float()
    wte = token_embedding(target).t()
    p = (f @ wte).softmax(-1)
    cls = -(p * (f_hat @ wte).log_softmax(-1)).sum(-1).mean()
    return F.smooth_l1_loss(f_hat, f) + EAGLE_CLS_WEIGHT * cls


def eagle_batch(hidden, crop, batch, rng):
    """Random windows and crops of ``crop`` positions, starting at 1 or later (entry p needs f_{p-1})."""
    W, S = hidden["final"].shape[:2]
    n = max(1, batch // crop)
    w = torch.from_numpy(rng.integers(0, W, n))
    start = torch.from_numpy(rng.integers(1, S - crop + 1, n))
    return w, start[:, None] + torch.arange(crop)


@torch.no_grad()
def eagle_eval(head, target, toks, hidden) -> dict:
    """Held-out, every position of every window: how often head(f^_p) has the target's argmax (greedy acceptance
    of a first draft) and sum_x min(p, q) (sampled, temperature 1); and the same with every input feature one of
    the head's own guesses (a pessimistic stand-in for drafts 2, 3, ...: EAGLE's feature drift)."""
    W, S, C = hidden["final"].shape
    wte, out = token_embedding(target).t(), {}
    agree = {"first": [], "fed_own": []}
    accept = {"first": [], "fed_own": []}
    for i in range(0, W, 8):
        w = torch.arange(i, min(i + 8, W))
        idx = torch.arange(1, S).repeat(len(w), 1)
        p = (hidden["final"][w[:, None], idx].float() @ wte).softmax(-1)
        f_hat = eagle_forward(head, target, toks, hidden, w, idx)
        fed = {"final": hidden["final"].clone()}
        fed["final"][w[:, None], idx] = f_hat.half()                                # inputs: its own guesses
        f_hat2 = eagle_forward(head, target, toks, fed, w, idx[:, 1:])
        for name, fh, pp in (("first", f_hat, p), ("fed_own", f_hat2, p[:, 1:])):
            q = (fh @ wte).softmax(-1)
            agree[name].append((q.argmax(-1) == pp.argmax(-1)).float().flatten())
            accept[name].append(torch.minimum(pp, q).sum(-1).flatten())
    for name in agree:
        out[f"{name}_greedy_agreement"] = torch.cat(agree[name]).mean().item()
        out[f"{name}_sampled_acceptance"] = torch.cat(accept[name]).mean().item()
    return out


# -- EAGLE-3: the training-time test ---------------------------------------------------------------------------------

EAGLE3_DECAY = 0.8                    # step j's weight 0.8^j (SafeAILab's traineagle3: ploss_weight)


class RolloutAttention:
    """The attention of a k-step rollout over B windows of S entries (EAGLE-3 §3.2's training-time test).

    Call 0 (step 0) is causal over the rows: row p is entry idx_p, reading a true feature, and sees rows <= p.
    At step j >= 1, row p stands for the *drafted* entry idx_p + j (it reads the layer's own output of step
    j - 1 at the same row); it sees step 0's rows <= p (the context the target computed) and its own row in
    steps 1 .. j (the chain it drafted from there), which is exactly what a drafted entry sees when drafting
    (``spec_decode/eagle.py``: the catch-up entries, then the scratch entries of this chain). The reference's
    ``cache_hidden`` with its diagonal masks, the same thing."""

    def __init__(self, batch: int, seq: int):
        self.B, self.S, self.k0 = batch, seq, None
        self.diag: list = []                                          # [(k_j, v_j)] of steps 1 .. j

    def __call__(self, layer_idx, q, k, v):                           # q [B*S, H, D], k, v [B*S, Hkv, D]
        B, S, (H, D), Hkv = self.B, self.S, q.shape[1:], k.shape[1]
        q = q.view(B, S, H, D).transpose(1, 2)                        # [B, H, S, D]
        k, v = (t.view(B, S, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1) for t in (k, v))
        if self.k0 is None:
            self.k0, self.v0 = k, v
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            self.diag.append((k, v))
            s0 = (q @ self.k0.transpose(-1, -2)) / math.sqrt(D)       # [B, H, S, S]
            s0 = s0.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
            sd = torch.stack([(q * kd).sum(-1) for kd, _ in self.diag], -1) / math.sqrt(D)    # [B, H, S, j]
            w = torch.cat([s0, sd], -1).softmax(-1)
            vd = torch.stack([vv for _, vv in self.diag], -2)         # [B, H, S, j, D]
            y = w[..., :S] @ self.v0 + (w[..., S:, None] * vd).sum(-2)
        return y.transpose(1, 2).reshape(B * S, H, D)


def eagle3_rollout(head, target, toks, hidden, w, idx, steps: int):
    """The layer rolled out ``steps`` steps on its own outputs: [(positions [B, S], its logits [B, S, V])] per
    step. Step 0's entries read the fused target feature g_{p-1}; step j's read the layer's own output of step
    j - 1 and the true token at idx + j (a draft is judged only where its predecessors were accepted)."""
    B, S = idx.shape
    feats = head.fuse([hidden[i][w[:, None], idx - 1].float() for i in head.layers])          # [B, S, C]
    attn, out = RolloutAttention(B, S), []
    for j in range(steps):
        pos = idx + j
        a = head(target, toks[w[:, None], pos].reshape(-1), feats.reshape(B * S, -1), pos.reshape(-1), attn, 0)
        feats = a.view(B, S, -1)
        out.append((pos, head.logits(target, feats)))
    return out


def eagle3_loss(head, target, toks, hidden, w, idx, steps: int):
    """sum_j 0.8^j x CE(step j's guess at entry idx + j, the target's distribution there); no feature loss."""
    loss = 0.0
    for j, (pos, logits) in enumerate(eagle3_rollout(head, target, toks, hidden, w, idx, steps)):
        with torch.no_grad():
            p = target.lm_head(hidden["final"][w[:, None], pos].float()).softmax(-1)         # [B, S, V]
        loss = loss + EAGLE3_DECAY ** j * -(p * logits.log_softmax(-1)).sum(-1).mean()
    return loss


def rollout_batch(hidden, crop, batch, steps, rng):
    """eagle_batch's windows and crops, leaving room for ``steps`` - 1 drafted entries after each."""
    W, S = hidden["final"].shape[:2]
    n = max(1, batch // crop)
    w = torch.from_numpy(rng.integers(0, W, n))
    start = torch.from_numpy(rng.integers(1, S - crop - steps + 2, n))
    return w, start[:, None] + torch.arange(crop)


@torch.no_grad()
def eagle3_eval(head, target, toks, hidden, steps: int) -> dict:
    """Held-out, every position: step j's greedy agreement with the target and sum_x min(p, q) (each step's guess
    fed the layer's own earlier outputs), and ``chain_tau``: 1 + sum_j P(steps 0 .. j all agree), a greedy
    chain's tokens per verify step on the corpus's prefixes."""
    W, S, C = hidden["final"].shape
    agree, accept, chain = [[] for _ in range(steps)], [[] for _ in range(steps)], [[] for _ in range(steps)]
    for i in range(0, W, 8):
        w = torch.arange(i, min(i + 8, W))
        idx = torch.arange(1, S - steps + 1).repeat(len(w), 1)
        ok = None
        for j, (pos, logits) in enumerate(eagle3_rollout(head, target, toks, hidden, w, idx, steps)):
            p = target.lm_head(hidden["final"][w[:, None], pos].float()).softmax(-1)
            q = logits.softmax(-1)
            hit = q.argmax(-1) == p.argmax(-1)
            ok = hit if ok is None else ok & hit
            agree[j].append(hit.float().flatten())
            accept[j].append(torch.minimum(p, q).sum(-1).flatten())
            chain[j].append(ok.float().flatten())
    out = {}
    for j in range(steps):
        out[f"step{j}_greedy_agreement"] = torch.cat(agree[j]).mean().item()
        out[f"step{j}_sampled_acceptance"] = torch.cat(accept[j]).mean().item()
    out["chain_tau"] = 1 + sum(torch.cat(c).mean().item() for c in chain)
    return out
