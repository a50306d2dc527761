"""Train a preset on the stdlib corpus:  python -m minibatch.model.train --preset target

The target learns from the bytes themselves (next-byte cross-entropy). The draft
is *distilled* from the shipped target (``--distill``): its loss is the
cross-entropy against the target's full next-byte distribution, which teaches
it to agree with the target's choices, the property speculative decoding is
paid by (Leviathan et al., 2023, Sec. 3: the speed-up grows with acceptance).

The speculative heads (``--preset medusa | eagle | early_exit``) train on top of the frozen target;
their presets live in ``train_heads.py`` and are dispatched there from here.

Reported metric: bits per byte (bpb) = mean cross-entropy in nats / ln 2, on
held-out files. A uniform guess over 256 bytes scores 8 bpb.
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from minibatch.model.data import load_corpus
from minibatch.model.training import batched_causal_attention, cosine_lr, sample_windows
from minibatch.model.model import GPT
from minibatch.model.registry import PRESETS, build, get_config
from minibatch.model.weights import load_model, save_checkpoint


def logits_of(model: GPT, x: torch.Tensor) -> torch.Tensor:
    B, S = x.shape
    pos = torch.arange(S).repeat(B)
    return model(x.reshape(-1), pos, batched_causal_attention(B, S)).view(B, S, -1)


@torch.no_grad()
def evaluate(model: GPT, val: np.ndarray, teacher: GPT | None = None, windows: int = 64,
             seq: int = 512, seed: int = 1234) -> dict:
    """Held-out bpb, and (with a teacher) how often the argmax agrees with the teacher's."""
    model.eval()
    rng = np.random.default_rng(seed)
    nll, agree, n = 0.0, 0, 0
    for _ in range(windows // 8):
        x, y = sample_windows(val, 8, seq, rng)
        logits = logits_of(model, x)
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
        if teacher is not None:
            agree += (logits.argmax(-1) == logits_of(teacher, x).argmax(-1)).sum().item()
        n += y.numel()
    model.train()
    out = {"val_bpb": nll / n / math.log(2)}
    if teacher is not None:
        out["greedy_agreement"] = agree / n
    return out


def main(argv=None):
    import sys
    from minibatch.model.weights import HEAD_KINDS, HEAD_PRESETS
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset")
    if pre.parse_known_args(argv)[0].preset in HEAD_KINDS:        # a head on the frozen target (--model)
        from minibatch.model import train_heads
        return train_heads.main(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS) + list(HEAD_PRESETS))
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--distill", action="store_true", help="learn the shipped target's distributions")
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--out", default=None, help="directory for the checkpoint (default: minibatch/model/checkpoints)")
    ap.add_argument("--init", action="store_true",
                    help="continue from the shipped checkpoint of this preset (a second, lower-lr stage)")
    args = ap.parse_args(argv)
    cfg = get_config(args.preset)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    train, val = load_corpus("train"), load_corpus("val")
    model = build(cfg)
    previous = None
    if args.init:                                                 # stage 2: start from the shipped weights
        from minibatch.model.weights import read_manifest
        previous = read_manifest(args.preset)
        model.load_state_dict(load_model(args.preset, device="cpu").state_dict())
    teacher = load_model("target", device="cpu") if args.distill else None
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    print(f"{cfg.name}: {model.num_params():,} parameters; corpus {len(train):,} train / {len(val):,} val bytes")

    t0, log = time.time(), []
    bar = tqdm(range(args.steps), desc=f"train {cfg.name}", mininterval=5)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, args.lr, args.warmup, args.steps)
        x, y = sample_windows(train, args.batch_size, args.seq_len, rng)
        logits = logits_of(model, x)
        if teacher is None:
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))
        else:
            with torch.no_grad():
                p_teacher = logits_of(teacher, x).softmax(-1)
            loss = -(p_teacher * logits.log_softmax(-1)).sum(-1).mean()   # soft cross-entropy
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{(step + 1) * x.numel() / (time.time() - t0):.0f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            ev = evaluate(model, val, teacher)
            ev.update(step=step + 1, loss=round(loss.item(), 4), minutes=round((time.time() - t0) / 60, 1))
            log.append(ev)
            tqdm.write(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in ev.items()))
    info = {"num_params": model.num_params(), "steps": args.steps, "batch_size": args.batch_size,
            "seq_len": args.seq_len, "lr": args.lr, "seed": args.seed, "distilled": args.distill,
            "tokens_seen": args.steps * args.batch_size * args.seq_len,
            "train_minutes": round((time.time() - t0) / 60, 1), "python": ".".join(map(str, __import__("sys").version_info[:3])),
            "final": log[-1], "log": log}
    if previous is not None:                                      # keep the recipe reproducible: every stage
        stages = previous.get("stages", [{k: previous[k] for k in ("steps", "lr", "seed", "tokens_seen",
                                                                     "train_minutes", "final") if k in previous}])
        info["stages"] = stages + [{k: info[k] for k in ("steps", "lr", "seed", "tokens_seen",
                                                         "train_minutes", "final")} | {"init": previous["sha256"]}]
        info["tokens_seen"] = sum(st["tokens_seen"] for st in info["stages"])
    kw = {"directory": args.out} if args.out else {}
    print("saved", save_checkpoint(model, info, **kw))


if __name__ == "__main__":
    main()
