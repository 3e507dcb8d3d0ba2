"""A child process of tests/test_precompile.py: the Triton SMA kernels' launches of
``TritonSMAKernels`` (the engine's own arguments: CPU tensors, numbers or 0-dim tensors as
hyper-parameters) compiled as a CUDA launch would compile them for sm_90, through Triton's JIT
with the stand-in driver of kernels/precompile.py; prints one JSON list: per launch, whether
Triton's cache had it. (It leaves the stand-in driver active: a process of its own.)

    python tests/_launch_hits.py M P
"""

import json
import sys

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from crossbow_graph.kernels import triton_sma as T
from crossbow_graph.kernels.precompile import _TargetDriver


def _launch(self, *args, num_warps=None):  # EmittedKernel.launch's CUDA call, compiled only
    JITFunction(T.kernel_body(self.spec.kind)).warmup(
        *args, grid=self.spec.grid, **self.spec.constexprs,
        num_warps=num_warps or self.spec.num_warps, enable_fp_fusion=T.FP_FUSION)


def main() -> None:
    m, P = int(sys.argv[1]), int(sys.argv[2])
    T.import_triton()
    driver.set_active(_TargetDriver(90))
    hits = []
    knobs.compilation.listener = lambda **kw: hits.append(bool(kw["cache_hit"]))
    T.EmittedKernel.launch = _launch
    T.device_type = lambda t: "cuda"  # the specs of a CUDA device
    kernels = T.TritonSMAKernels()
    w, v, g = (torch.zeros(m, P) for _ in range(3))
    z = torch.zeros(P)
    for graphs in (False, True):  # numbers (eager rounds), 0-dim tensors (graph rounds)
        h = torch.tensor if graphs else float
        for first in (True, False):
            acc = kernels.local_update(w, v, g, z, lr=h(0.01), momentum=h(0.9), nesterov=False,
                                       weight_decay=0.0, alpha=h(1 / m), first_step=first)
        kernels.central_update(z, z.clone(), acc, central_momentum=h(0.9))
    print(json.dumps(hits))


if __name__ == "__main__":
    main()
