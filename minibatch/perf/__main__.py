"""python -m minibatch.perf profiles    the hardware and model profiles, with their sources

Only what the profiles themselves say. Measuring this machine runs the engine, and the engine stands above
perf/ in the stack (it imports the cost model), so that is a benchmark, in bench/:

    python -m minibatch.bench calibrate [--out FILE]      this machine's profile, measured
    python -m minibatch.bench validate [--profile FILE]   predicted vs measured step times on a mixed workload
"""
from __future__ import annotations

import argparse
import sys

from minibatch.perf.hardware import PROFILES
from minibatch.perf.models import get_model, model_names

MOVED = ("calibrate", "validate")        # they drive engines: python -m minibatch.bench calibrate | validate


def print_profiles() -> None:
    print(f"{'hardware':<9} {'bf16 TFLOP/s':>12} {'fp32 TFLOP/s':>12} {'TB/s':>6} {'GB':>5} {'ridge FLOP/B':>12}")
    for h in PROFILES.values():
        print(f"{h.name:<9} {h.flops('bf16') / 1e12:>12.1f} {h.flops('fp32') / 1e12:>12.1f} "
              f"{h.mem_bandwidth / 1e12:>6.2f} {h.mem_capacity / 1e9:>5.0f} {h.ridge('bf16'):>12.0f}")
    print(f"\n{'model':<13} {'params':>8} {'weights GB':>10} {'KV KB/token':>11}  source")
    for n in model_names():
        m = get_model(n)
        print(f"{n:<13} {m.num_params / 1e9:>7.3f}B {m.weight_bytes / 1e9:>10.3f} {m.kv_bytes_per_token / 1024:>11.1f}  "
              f"{m.source}")
    print("\nsources of the hardware numbers:")
    for h in PROFILES.values():
        for k, v in h.sources.items():
            print(f"  {h.name}.{k}: {v}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in MOVED:
        print(f"error: `python -m minibatch.perf {argv[0]}` runs the engine, which stands above perf/: it is "
              f"`python -m minibatch.bench {argv[0]}`", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(prog="python -m minibatch.perf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["profiles"])
    ap.parse_args(argv)
    print_profiles()
    return 0


if __name__ == "__main__":
    sys.exit(main())
