"""python -m minibatch.bench batching | speculative | attention | kv  (see minibatch/bench/run.py)."""
import sys

from minibatch.bench.run import main

sys.exit(main())
