"""python -m minibatch.bench batching | speculative | attention | kv | peers | online | preemption | offload ...  (see minibatch/bench/run.py)."""
import sys

from minibatch.bench.run import main

sys.exit(main())
