"""python -m minibatch.perf calibrate [--out FILE]   this machine's profile, measured
   python -m minibatch.perf validate [--profile FILE]  predicted vs measured step times on a mixed workload
   python -m minibatch.perf profiles                  the hardware and model profiles, with their sources"""
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cmds = ("calibrate", "validate", "profiles")
    if not argv or argv[0] not in cmds:
        print(__doc__, file=sys.stderr)
        print(f"error: choose one of {list(cmds)}", file=sys.stderr)
        return 2
    if argv[0] == "calibrate":
        from minibatch.bench.calibrate import main as run
    elif argv[0] == "validate":
        from minibatch.bench.validate import main as run
    else:
        from minibatch.bench.validate import profiles_main as run
    try:
        return run(argv[1:])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
