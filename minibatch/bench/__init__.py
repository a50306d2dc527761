"""The lab bench: workloads, run metrics, benchmarks and lecture demos, all driving the public engine API.

    python -m minibatch.bench batching | speculative | attention | kv | peers | online
    python -m minibatch demo continuous | paged | speculative
"""


def main(argv=None):
    from minibatch.bench.run import main as run_main       # lazily: `import minibatch.bench` stays cheap
    return run_main(argv)
