"""Measure the peak memory of an eager training step and compare it with the estimate.

``python bench/memcheck.py [cuda]`` prints, for LeNet-5, ResNet-32 and VGG-16 at two
batch sizes each, the measured peak bytes, the estimate (analysis.py ``estimate_memory``, without the
flat-buffer share that an eager step does not have) and the relative error. On the CPU the
measurement is torch.profiler's allocator events (``profile_memory=True``); on a GPU it is
``torch.cuda.max_memory_allocated``. docs/compiler.md quotes the numbers, and
tests/test_compiler_memory.py holds the estimate within its tolerance of ``compare``'s measurement.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from crossbow_graph.compiler.analysis import estimate_memory  # noqa: E402
from crossbow_graph.compiler.passes import library_workspace  # noqa: E402
from crossbow_graph.compiler.trace import trace_model  # noqa: E402
from crossbow_graph.models import get_model, input_shape  # noqa: E402

__all__ = ["measure_training_step_bytes", "compare", "main"]


def _step_twice(make_model: Callable[[], nn.Module], input_shape: tuple[int, ...], batch_size: int,
                num_classes: int, device: torch.device) -> None:
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch_size, *input_shape, device=device)
    y = torch.randint(0, num_classes, (batch_size,), device=device)
    for _ in range(2):  # the second step has gradients and momentum allocated
        opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def measure_training_step_bytes(make_model: Callable[[], nn.Module], input_shape: tuple[int, ...],
                                batch_size: int, *, num_classes: int = 10,
                                device: str = "cpu") -> int:
    """Peak bytes allocated by two eager SGD (momentum 0.9) steps of a new model at batch b.

    Everything is allocated inside the measurement: the model, the batch ``[b, *input_shape]``,
    gradients, momentum, activations and backward temporaries.

    Args:
        make_model: builds the model (called inside the measurement).
        input_shape: one sample's shape, without the batch dimension.
        batch_size: b.
        num_classes: targets are drawn from ``[0, num_classes)``.
        device: ``"cpu"`` (torch.profiler allocator events) or ``"cuda"``/``"cuda:i"``
            (``torch.cuda.max_memory_allocated``).

    Returns:
        Peak bytes above the memory in use before the call.
    """
    dev = torch.device(device)
    torch.manual_seed(0)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:  # the step allocates its stream's cuBLAS workspace again, whatever
            clear()            # ran before on that stream (the measurement is order-independent)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        _step_twice(make_model, input_shape, batch_size, num_classes, dev)
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step_twice(make_model, input_shape, batch_size, num_classes, dev)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def compare(name: str, batch_size: int, *, device: str = "cpu") -> tuple[int, int, float]:
    """(measured bytes, estimated bytes, relative error of the estimate) for a zoo model; on CUDA
    the estimate includes the cuBLAS workspace of the stream (the caching allocator counts it)."""
    shape = input_shape(name)
    mg = trace_model(get_model(name), (torch.randn(2, *shape),))
    library = library_workspace([device if device != "cuda" else "cuda:0"], mg.analysis)
    estimate = estimate_memory(mg.analysis, batch_size).training_step + library
    measured = measure_training_step_bytes(lambda: get_model(name), shape, batch_size, device=device)
    return measured, estimate, estimate / measured - 1


def main(argv: list[str] | None = None) -> int:
    """Print the comparison table (one intra-op thread, as the tests measure)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python bench/memcheck.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("device", nargs="?", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "BATCH"), default=None,
                        help="measure one model at one batch size and print 'measured estimate' "
                             "in bytes (what the tests run in a process of its own)")
    args = parser.parse_args(argv)
    device = args.device
    torch.set_num_threads(1)
    if args.one is not None:
        measured, estimate, _ = compare(args.one[0], int(args.one[1]), device=device)
        print(measured, estimate)
        return 0
    print(f"{'model':<10}{'batch':>6}{'measured MiB':>14}{'estimate MiB':>14}{'error':>8}  ({device})")
    for name, b in (("lenet5", 16), ("lenet5", 64), ("resnet32", 8), ("resnet32", 32),
                    ("vgg16", 8), ("vgg16", 32)):
        measured, estimate, err = compare(name, b, device=device)
        print(f"{name:<10}{b:>6}{measured / 2**20:>14.2f}{estimate / 2**20:>14.2f}{err:>+8.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
