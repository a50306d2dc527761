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
* ``eagle3``: one Llama layer on (token embedding, fc(low, middle, high target states)), trained on the
  target's distribution alone, rolled out ``--ttt-steps`` steps on its own outputs (EAGLE-3 §3.2's
  training-time test; ``eagle3_head.py``). Reported: each step's agreement and a greedy chain's tau.
* ``eagle``: one block on (token embedding, target feature) learns the next feature, SmoothL1 + 0.1 x CE
  against the target's distribution, with noise on the input features (EAGLE §4.2), on crops of the
  precomputed windows (it attends, so it trains on sequences). Reported: first-draft greedy agreement
  and sum_x min(p, q), and the same when every input feature is one of its own guesses.

The losses and held-out figures of each preset are in ``head_objectives.py``.

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

from minibatch.model.data import load_corpus
from minibatch.model.head_objectives import (eagle3_eval, eagle3_loss, eagle_batch, eagle_eval, eagle_loss, exit_eval,
                                             exit_loss, medusa_batch, medusa_eval, medusa_loss, position_batch,
                                             rollout_batch)
from minibatch.model.heads import Eagle3Head, EagleHead, ExitAdapter, MedusaHeads, token_embedding
from minibatch.model.training import batched_causal_attention, cosine_lr, sample_windows
from minibatch.model.weights import HEAD_KINDS, HEADS_OF, WEIGHTS_DIR, head_preset, load_model, read_manifest, save_tensors

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


# -- the loop every preset shares ------------------------------------------------------------------------------------

def build(preset, target, args):
    """(the head, the target hidden states it reads, loss(head, toks, hidden, rng), eval(head, toks, hidden))."""
    if preset == "medusa":
        heads = MedusaHeads.from_target(target, args.num_heads)
        return (heads, ("final",),
                lambda m, tk, hs, rng: medusa_loss(m, tk, hs, *medusa_batch(tk, hs, m.num_heads, args.batch_size, rng),
                                                   teacher_head=token_embedding(target) if args.distill else None),
                lambda m, tk, hs: medusa_eval(m, target, tk, hs))
    if preset == "early_exit":
        if not 1 <= args.exit_layer < target.config.n_layer:
            raise ValueError(f"--exit-layer must lie in 1..{target.config.n_layer - 1}, got {args.exit_layer}")
        adapter = ExitAdapter(target.config.n_embd, target.config.vocab_size, args.exit_layer, args.adapter_hidden)
        return (adapter, (args.exit_layer, "final"),
                lambda m, tk, hs, rng: exit_loss(m, target, tk, hs, *position_batch(hs, "final", args.batch_size, rng)),
                lambda m, tk, hs: exit_eval(m, target, tk, hs))
    if preset == "eagle":
        head = EagleHead.from_target(target)             # the target's kind of block: the GPT's, or a Llama layer
        return (head, ("final",),
                lambda m, tk, hs, rng: eagle_loss(m, target, tk, hs, *eagle_batch(hs, args.crop, args.batch_size, rng),
                                                  args.noise),
                lambda m, tk, hs: eagle_eval(m, target, tk, hs))
    if preset == "eagle3":
        head = Eagle3Head.from_target(target, tuple(args.layers))
        return (head, tuple(head.layers) + ("final",),
                lambda m, tk, hs, rng: eagle3_loss(m, target, tk, hs, *rollout_batch(hs, args.crop, args.batch_size,
                                                                                     args.ttt_steps, rng),
                                                   args.ttt_steps),
                lambda m, tk, hs: eagle3_eval(m, target, tk, hs, args.ttt_steps))
    raise ValueError(f"unknown head preset {preset!r}; choose one of {list(HEAD_KINDS)}")


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m minibatch.model.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True, choices=list(HEAD_KINDS), help="which head")
    ap.add_argument("--model", default="target", choices=list(HEADS_OF),
                    help="the frozen model it reads (saved as head_preset(preset, model): medusa, llama_medusa, ...)")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=2048, help="positions per step (eagle: in windows of --crop)")
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
    ap.add_argument("--crop", type=int, default=256, help="eagle: positions per training window")
    ap.add_argument("--noise", type=float, default=0.1, help="eagle: uniform noise on the input features")
    ap.add_argument("--layers", type=int, nargs=3, default=[1, 2, 4],
                    help="eagle3: the low, middle and high states it fuses (blocks run)")
    ap.add_argument("--ttt-steps", type=int, default=4, help="eagle3: training-time test, steps rolled out")
    ap.add_argument("--init", action="store_true", help="continue from the shipped checkpoint (a further stage)")
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
    if args.preset not in HEADS_OF[args.model]:
        raise ValueError(f"--preset {args.preset} is not a head of --model {args.model}; its heads: {HEADS_OF[args.model]}")
    name = head_preset(args.preset, args.model)
    target = load_model(args.model, device="cpu")
    for p in target.parameters():
        p.requires_grad_(False)
    head, keys, loss_fn, eval_fn = build(args.preset, target, args)
    previous = None
    if args.init:                                                 # a further stage from the shipped weights
        from minibatch.model.heads import load_head
        shipped = load_head(name, target)
        if shipped.config() != head.config():
            raise ValueError(f"--init: the shipped {args.preset} is {shipped.config()}, this run builds {head.config()}")
        head.load_state_dict(shipped.state_dict())
        previous = shipped.manifest
    t0 = time.time()
    train_t, train_h = precompute(target, load_corpus("train"), args.windows, args.seq_len, rng, keys)
    val_t, val_h = precompute(target, load_corpus("val"), args.val_windows, args.seq_len,
                              np.random.default_rng(1234), keys)
    pre_min = (time.time() - t0) / 60
    print(f"{args.preset}: {head.num_params():,} parameters; target run once over {train_t.numel():,} train / "
          f"{val_t.numel():,} val bytes in {pre_min:.1f} min")
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)

    t1, log = time.time(), []
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, args.lr, args.warmup, args.steps)
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
            "target": args.model, "target_sha256": read_manifest(args.model)["sha256"],
            "recipe": {k: v for k, v in vars(args).items() if k not in ("out", "threads", "eval_every")},
            "command": "python -m minibatch.model.train " + " ".join(_without_out(sys.argv[1:] if argv is None else argv)),
            "precompute_minutes": round(pre_min, 1), "train_minutes": round((time.time() - t1) / 60, 1),
            "python": ".".join(map(str, sys.version_info[:3])), "final": log[-1], "log": log}
    if previous is not None:                                      # every stage of the recipe, in order
        stage = lambda m: {k: m[k] for k in ("recipe", "command", "train_minutes", "final") if k in m}
        info["stages"] = previous.get("stages", [stage(previous)]) + [stage(info) | {"init": previous["sha256"]}]
    print("saved", save_tensors(name, head.state_dict(), info, args.out or WEIGHTS_DIR))
    return head, info


if __name__ == "__main__":
    main()
