"""The lab bench: workloads, run metrics, benchmarks and lecture demos, all driving the public engine API.

    python -m minibatch.bench batching | speculative | trees | attention | kv | kv-accuracy | peers | online | serve | preemption | offload | prefix
    python -m minibatch demo continuous | static | paged | speculative | tree
"""


def main(argv=None):
    from minibatch.bench.run import main as run_main       # lazily: `import minibatch.bench` stays cheap
    return run_main(argv)
