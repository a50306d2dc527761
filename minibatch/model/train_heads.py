"""Train a speculative head on the frozen target:  python -m minibatch.model.train --preset medusa

The target never changes, so what it computes on the corpus is computed **once**: ``precompute`` runs
it over ``--windows`` seeded windows of the training split (and 64 of the held-out split) and keeps
the hidden states a head reads, in float16. Training then touches only the head's parameters, which is
what makes these presets cheap on a CPU (Medusa-1's point, Cai et al. 2024 §2.1.1: the backbone is
frozen, so the heads train on one GPU in hours; here on one CPU core in minutes).

* ``medusa``: head i learns the token at t + 2 + i from h_t (the target's ln_f output), loss
  sum_i 0.8^i CE_i on the corpus's own bytes. Reported: each head's top-1 and top-5 accuracy on
  held-out code (and the target's own head's, for t + 1, beside them).
* ``early_exit``: an adapter on the residual stream after E = ``--exit-layer`` blocks learns the full
  target's next-byte distribution (soft cross-entropy; LayerSkip §3, Kangaroo §3.1). Reported: greedy
  agreement with the target and sum_x min(p, q), with the adapter and without it (the plain exit).

Reproducible: every random choice comes from ``--seed``; the ``.json`` written beside the weights
records the recipe, the target it was trained on (its SHA-256), the curve and the held-out figures.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from minibatch.model.data import load_corpus
from minibatch.model.heads import ExitAdapter, MedusaHeads
from minibatch.model.train import batched_causal_attention, sample_windows
from minibatch.model.weights import HEAD_PRESETS, WEIGHTS_DIR, load_model, read_manifest, save_tensors

MEDUSA_DECAY = 0.8                    # lambda_i = 0.8^i (Medusa §2.1.1)


@torch.no_grad()
def precompute(target, data: np.ndarray, windows: int, seq: int, rng, keys=("final",), batch: int = 8):
    """Run the frozen target once over ``windows`` random windows of ``seq + 1`` bytes.

    Returns tokens[W, S + 1] (int64) and {key: hidden[W, S, C] float16} for the keys asked (GPT.forward's
    numbering: ints count blocks run, "final" is the ln_f output that feeds the LM head)."""
    toks, hidden = [], {k: [] for k in keys}
    for i in range(0, windows, batch):
        x, y = sample_windows(data, min(batch, windows - i), seq, rng)
        B, S = x.shape
        _, hs = target(x.reshape(-1), torch.arange(S).repeat(B), batched_causal_attention(B, S),
                       hidden_states=keys)
        toks.append(torch.cat([x, y[:, -1:]], dim=1))
        for k in keys:
            hidden[k].append(hs[k].view(B, S, -1).half())
    return torch.cat(toks), {k: torch.cat(v) for k, v in hidden.items()}


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
    wte = target.wte.weight.t().float()
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
        p = (hidden["final"][w, t].float() @ target.wte.weight.t()).softmax(-1)      # the target's p [B, V]
    logq = adapter.logits(target, hidden[adapter.exit_layer][w, t].float()).log_softmax(-1)
    return -(p * logq).sum(-1).mean()


@torch.no_grad()
def exit_eval(adapter, target, toks, hidden) -> dict:
    """Held-out: how often the early exit's argmax is the target's (greedy acceptance), and sum_x min(p, q)
    (the acceptance rate of one sampled draft at temperature 1, Leviathan et al. §3.1); with and without
    the adapter, so the adapter's worth shows."""
    E, C = adapter.exit_layer, hidden["final"].shape[-1]
    x, h = hidden[E].reshape(-1, C).float(), hidden["final"].reshape(-1, C).float()
    p = (h @ target.wte.weight.t()).softmax(-1)
    out = {}
    for name, logits in (("adapter", adapter.logits(target, x)), ("plain_exit", target.ln_f(x) @ target.wte.weight.t())):
        q = logits.softmax(-1)
        out[f"{name}_greedy_agreement"] = (q.argmax(-1) == p.argmax(-1)).float().mean().item()
        out[f"{name}_sampled_acceptance"] = torch.minimum(p, q).sum(-1).mean().item()
    return out


def position_batch(hidden, key, batch, rng):
    W, S = hidden[key].shape[:2]
    return torch.from_numpy(rng.integers(0, W, batch)), torch.from_numpy(rng.integers(0, S, batch))


# -- the loop every preset shares ------------------------------------------------------------------------------------

def build(preset, target, args):
    """(the head, the target hidden states it reads, loss(head, toks, hidden, rng), eval(head, toks, hidden))."""
    if preset == "medusa":
        heads = MedusaHeads.from_target(target, args.num_heads)
        return (heads, ("final",),
                lambda m, tk, hs, rng: medusa_loss(m, tk, hs, *medusa_batch(tk, hs, m.num_heads, args.batch_size, rng),
                                                   teacher_head=target.wte.weight if args.distill else None),
                lambda m, tk, hs: medusa_eval(m, target, tk, hs))
    if preset == "early_exit":
        if not 1 <= args.exit_layer < target.config.n_layer:
            raise ValueError(f"--exit-layer must lie in 1..{target.config.n_layer - 1}, got {args.exit_layer}")
        adapter = ExitAdapter(target.config.n_embd, target.config.vocab_size, args.exit_layer, args.adapter_hidden)
        return (adapter, (args.exit_layer, "final"),
                lambda m, tk, hs, rng: exit_loss(m, target, tk, hs, *position_batch(hs, "final", args.batch_size, rng)),
                lambda m, tk, hs: exit_eval(m, target, tk, hs))
    raise ValueError(f"unknown head preset {preset!r}; choose one of {list(HEAD_PRESETS)}")


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m minibatch.model.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True, choices=list(HEAD_PRESETS))
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=2048, help="positions per step")
    ap.add_argument("--windows", type=int, default=1024, help="training windows the target is run over once")
    ap.add_argument("--val-windows", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--num-heads", type=int, default=4, help="medusa: heads (tokens t+2 .. t+1+K)")
    ap.add_argument("--distill", action="store_true",
                    help="medusa: learn the target's distributions instead of the corpus's bytes (Medusa §2.3.2)")
    ap.add_argument("--exit-layer", type=int, default=1, help="early_exit: blocks the draft runs (E)")
    ap.add_argument("--adapter-hidden", type=int, default=256, help="early_exit: the adapter MLP's width")
    ap.add_argument("--out", default=None, help="directory for the checkpoint (default: minibatch/model/checkpoints)")
    return ap.parse_args(argv)


def _without_out(argv):
    """The command line as recorded: without --out (where this copy was written is no part of the recipe)."""
    argv, out = list(argv), []
    while argv:
        a = argv.pop(0)
        if a == "--out":
            argv.pop(0)
        elif not a.startswith("--out="):
            out.append(a)
    return out


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    target = load_model("target", device="cpu")
    for p in target.parameters():
        p.requires_grad_(False)
    head, keys, loss_fn, eval_fn = build(args.preset, target, args)
    t0 = time.time()
    train_t, train_h = precompute(target, load_corpus("train"), args.windows, args.seq_len, rng, keys)
    val_t, val_h = precompute(target, load_corpus("val"), args.val_windows, args.seq_len,
                              np.random.default_rng(1234), keys)
    pre_min = (time.time() - t0) / 60
    print(f"{args.preset}: {head.num_params():,} parameters; target run once over {train_t.numel():,} train / "
          f"{val_t.numel():,} val bytes in {pre_min:.1f} min")
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)

    def lr_at(step):                                              # linear warm-up, cosine to 10 %
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    t1, log = time.time(), []
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = loss_fn(head, train_t, train_h, rng)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            head.eval()
            ev = eval_fn(head, val_t, val_h)
            head.train()
            ev.update(step=step + 1, loss=round(loss.item(), 4), minutes=round((time.time() - t1) / 60, 1))
            log.append(ev)
            print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in ev.items()), flush=True)
    info = {"config": head.config(), "preset": args.preset, "num_params": head.num_params(),
            "target_sha256": read_manifest("target")["sha256"],
            "recipe": {k: v for k, v in vars(args).items() if k not in ("out", "threads", "eval_every")},
            "command": "python -m minibatch.model.train " + " ".join(_without_out(sys.argv[1:] if argv is None else argv)),
            "precompute_minutes": round(pre_min, 1), "train_minutes": round((time.time() - t1) / 60, 1),
            "python": ".".join(map(str, sys.version_info[:3])), "final": log[-1], "log": log}
    print("saved", save_tensors(args.preset, head.state_dict(), info, args.out or WEIGHTS_DIR))
    return head, info


if __name__ == "__main__":
    main()
