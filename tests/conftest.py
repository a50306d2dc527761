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
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def target_model():
    from minibatch.weights import load_model
    return load_model("target", device="cpu")


@pytest.fixture(scope="session")
def draft_model():
    from minibatch.weights import load_model
    return load_model("draft", device="cpu")
