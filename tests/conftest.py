"""Test configuration shared by every test file.

Triton kernels run on the CPU through Triton's interpreter, which must be
switched on *before* any kernel is decorated, that is before ``kernels`` is
imported anywhere; so it is set here, at the top of the first file pytest loads.

MINIBATCH_NO_TRITON=1 runs the tests as on a machine where Triton does not install (macOS, Windows):
``import triton`` fails here and in every Python the tests start (tests/no_triton/sitecustomize.py), and the
tests that need Triton (marker ``triton``, a "triton" backend parameter, the ``interpreter`` tests) are skipped,
saying why.
"""
import os
import re
import sys
import runpy

NO_TRITON = os.environ.get("MINIBATCH_NO_TRITON", "") not in ("", "0")
if NO_TRITON:                             # before anything can import triton
    _blocker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "no_triton")
    os.environ["PYTHONPATH"] = os.pathsep.join([_blocker] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    os.environ["MINIBATCH_NO_TRITON_PREFIX"] = sys.prefix     # this environment's Pythons, not a peer's venv
    runpy.run_path(os.path.join(_blocker, "sitecustomize.py"))

import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Kernel tests run on CUDA when present, else through the interpreter on the CPU.
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def one_thread():
    """Tiny tensors: with a second thread, contention on a shared 2-core machine costs ~100x. A file opts in
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    # With CUDA, Triton compiles natively and refuses CPU tensors, and the interpreter is off: the tests that
    # drive the kernels with CPU tensors step aside (the `gpu` tests run the same kernels on the device).
    marker, reason = ("interpreter", "feeds CPU tensors to Triton; CUDA is present, so the gpu tests run instead") \
        if HAS_CUDA else ("gpu", "needs a CUDA GPU")
    skip = pytest.mark.skip(reason=reason)
    try:
        import triton  # noqa: F401
        why_not_triton = None
    except ImportError as e:
        why_not_triton = pytest.mark.skip(reason=f"needs Triton, which installs on Linux only ({e})")
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if why_not_triton and ("triton" in item.keywords or "interpreter" in item.keywords
                               or any(isinstance(v, str) and v == "triton" for v in params.values())):
            item.add_marker(why_not_triton)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In a student release, a test outside tests/exercises that reaches an exercise you have not finished is
    skipped, saying which (the graded tests in tests/exercises fail instead: they are your grade)."""
    outcome = yield
    rep = outcome.get_result()
    if call.excinfo is None or not rep.failed or "exercises" in item.path.parent.parts[-1:]:
        return
    import exercises
    if not exercises.REMOVED:
        return
    from exercises.notebook import _unfinished_reason
    why = _unfinished_reason(call.excinfo.value)
    if why is None:                       # a subprocess (the server, a command) that stopped for the same reason
        m = re.search(r"this needs exercise \d+ \([^)]*\), which is not finished[^\n]*", str(rep.longrepr))
        why = m.group(0) if m else None
    if why is not None:
        rep.outcome, rep.longrepr = "skipped", (str(item.path), item.location[1] or 0, f"Skipped: {why}")


@pytest.fixture(scope="session")
def cpu_op():
    """The C++ CPU attention operator (kv/backends/cpu_kernel.py), built once; a skip saying why where it cannot be."""
    import warnings
    from minibatch.kv.backends import cpu_kernel
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = cpu_kernel.load()
    if got is None:
        pytest.skip(f"the C++ operator cannot be built here: {[str(w.message) for w in caught]}")
    return got


@pytest.fixture(scope="session")
def target_model():
    from minibatch.model.weights import load_model
    return load_model("target", device="cpu")


@pytest.fixture(scope="session")
def draft_model():
    from minibatch.model.weights import load_model
    return load_model("draft", device="cpu")
