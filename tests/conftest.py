"""Shared pytest setup: Triton's interpreter on machines without CUDA; GPU tests skipped there.

Triton reads TRITON_INTERPRET when ``@triton.jit`` decorates a function, and triton.language
decorates its own helpers when it is first imported, so the variable is set here, before any test
module imports triton. (crossbow_graph's kernels do not depend on it: see kernels/triton_sma.py.)
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))  # tests/_reference.py and friends

# One intra-op thread for the suite, and by OMP_NUM_THREADS for the processes it starts: the
# oracles (eager PyTorch) and the plans, whose fit(cpu_threads="auto") chooses from the cores the
# host leaves free and never more than torch's setting, then run the same arithmetic whatever the
# host's load (a thread count of its own rounds otherwise, and Adam turns that into steps of ±η
# where a gradient is 0: docs/optimizers.md). tests/test_threads.py sets its own.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _gpu_fp32(request):
    """gpu-marked tests compare with float32 oracles: TF32 off while they run."""
    if "gpu" not in request.node.keywords:
        yield
        return
    from _plans import fp32_exact

    with fp32_exact():
        yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
