"""A decode step's model forward never waits for the device, for every graph-safe backend (issue 25).

``NoHostSync`` raises on every operation that makes the host wait for a device (or that a CUDA graph cannot
hold): reading a value back (``aten._local_scalar_dense``: ``.item()``, ``int(t)``, ``bool(t)``; ``.tolist()``),
a shape that depends on the data (``nonzero``, ``masked_select``, indexing with a boolean mask) and any copy to
another device (on a GPU: to the CPU). It wraps the *real* forward, on the CPU, the one the engine runs: a
TorchDispatchMode sees every aten call. ``.tolist()`` of a CPU tensor reads memory without an aten call, so it
is patched out for the duration. The "loop" backend (not graph-safe: it plans from ``.tolist()``) shows the
mode does catch a sync.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minibatch import LLM, SamplingParams
from minibatch.kv.attention import GRAPH_SAFE_BACKENDS

aten = torch.ops.aten
SYNCS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default}


class HostSync(RuntimeError):
    pass


class NoHostSync(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCS or func.overloadpacket in (aten.item, aten.nonzero):
            raise HostSync(f"{func} reads a device value back to the host")
        if func.overloadpacket in (aten.index, aten.index_put, aten.index_put_):
            idx = args[1]
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in idx):
                raise HostSync(f"{func} with a boolean mask: its shape depends on the data (a nonzero)")
        if func.overloadpacket is aten._to_copy:
            dst = kwargs.get("device")
            if dst is not None and torch.device(dst) != args[0].device:
                raise HostSync(f"{func}: a copy from {args[0].device} to {dst}")
        if func.overloadpacket is aten.copy_ and args[0].device != args[1].device:
            raise HostSync(f"{func}: a copy from {args[1].device} to {args[0].device}")
        return func(*args, **kwargs)

    # torch re-enters a mode around its own dispatch (it pops and pushes it back), so __enter__ / __exit__ nest:
    # patch .tolist on the outermost enter and restore the original on the outermost exit only (saving it on
    # every enter once saved the patch itself, and every later test of the session found .tolist raising).
    _depth = 0

    def __enter__(self):
        if NoHostSync._depth == 0:
            torch.Tensor.tolist = _no_tolist
        NoHostSync._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        NoHostSync._depth -= 1
        if NoHostSync._depth == 0:
            torch.Tensor.tolist = _TOLIST
        return super().__exit__(*exc)


_TOLIST = torch.Tensor.tolist


def _no_tolist(t):
    raise HostSync(".tolist() reads a tensor back to the host")


def test_tolist_comes_back_after_the_mode():
    """The patch must not outlive the mode (it once leaked into every later test of the session)."""
    x = torch.arange(3)
    with pytest.raises(HostSync), NoHostSync():
        x.tolist()
    with NoHostSync():
        (x + 1).sum()
    assert x.tolist() == [0, 1, 2] and torch.Tensor.tolist is _TOLIST


def test_the_mode_catches_what_it_should():
    x = torch.arange(6.0)
    for bad in (lambda: x.max().item(), lambda: int(x.sum()), lambda: x[x > 2], lambda: x.nonzero(),
                lambda: x.tolist(), lambda: x.to("meta")):
        with pytest.raises(HostSync), NoHostSync():
            bad()
    with NoHostSync():                                   # fixed-shape work passes
        torch.where(x > 2, x, 0.0).index_select(0, torch.tensor([1, 2])).sum()


def run_decode_steps_under_the_mode(model, backend, n, **cfg):
    """Prefill n prompts of mixed lengths in one step, then run the decode steps' forwards under NoHostSync.
    Returns the number of decode forwards checked and the outputs."""
    llm = LLM(model, attention_backend=backend, max_num_seqs=32, max_num_batched_tokens=512, **cfg)
    eng, checked, mode, inside = llm.llm_engine, [0], NoHostSync(), [False]
    prompts = [list(b"def f(x):\n    return x + " * (1 + i % 3))[: 7 + 5 * i] for i in range(n)]
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=3 + i % 3))
    eng.step()                                           # every prompt's prefill: not checked

    def pre(module, args):
        assert args[0].shape[0] <= 32, "a decode step feeds one token per sequence"
        checked[0] += 1
        mode.__enter__()
        inside[0] = True

    def post(module, args, out):
        inside[0] = False
        mode.__exit__(None, None, None)
    hooks = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]
    try:
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        if inside[0]:                                    # a forward that raised never reached the post-hook
            mode.__exit__(None, None, None)
        for h in hooks:
            h.remove()
    return checked[0]


# Triton's interpreter (the CPU's stand-in) copies every tensor to NumPy, so "triton" is held to this on a GPU
BACKENDS = [b if b != "triton" else pytest.param(b, marks=pytest.mark.gpu) for b in GRAPH_SAFE_BACKENDS]


@pytest.mark.parametrize("mode", ["eager", "eager-replay"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_decode_forward_does_not_sync(target_model, backend, mode):
    """The plain path (mixed lengths: buckets and a scatter) and the graphs' fixed buffers (padding rows)."""
    cfg = {} if mode == "eager" else {"cuda_graph_mode": "eager-replay"}
    model = target_model
    if backend == "triton":
        from minibatch.model.weights import load_model
        model = load_model("target", device="cuda")
    assert run_decode_steps_under_the_mode(model, backend, 5, **cfg) >= 4


def test_the_loop_backend_does_sync_and_the_mode_sees_it(target_model):
    with pytest.raises(HostSync):
        run_decode_steps_under_the_mode(target_model, "loop", 2)
    assert torch.Tensor.tolist is _TOLIST and torch.arange(2).tolist() == [0, 1]   # the mode left with the error
