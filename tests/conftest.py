"""Test configuration shared by every test file.

Triton kernels run on the CPU through Triton's interpreter, which must be
switched on *before* any kernel is decorated, that is before ``kernels`` is
imported anywhere; so it is set here, at the top of the first file pytest loads.
"""
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Kernel tests run on CUDA when present, else through the interpreter on the CPU.
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    # With CUDA, Triton compiles natively and refuses CPU tensors, and the interpreter is off: the tests that
    # drive the kernels with CPU tensors step aside (the `gpu` tests run the same kernels on the device).
    marker, reason = ("interpreter", "feeds CPU tensors to Triton; CUDA is present, so the gpu tests run instead") \
        if HAS_CUDA else ("gpu", "needs a CUDA GPU")
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def target_model():
    from minibatch.model.weights import load_model
    return load_model("target", device="cpu")


@pytest.fixture(scope="session")
def draft_model():
    from minibatch.model.weights import load_model
    return load_model("draft", device="cpu")
