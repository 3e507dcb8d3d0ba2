"""The options of ``compile``: one typed field each (default, doc, choices), checked when built
(docs/options.md has their table)."""

# no ``from __future__ import annotations``: check_choices reads the Literal types of the fields

import dataclasses
from typing import Any, Literal, Sequence

import torch
from torch import nn

from .config import SGD, LearnerMode
from .engine.backends.process.conv_choice import CpuConv
from .engine.executors import Executor
from .engine.state.flat import MemoryFormat
from .engine.state.precision import Precision
from .engine.sync import ALGORITHMS, SMA, SyncAlgorithm
from .engine.transport.comm import Distributed
from .errors import check_flag, is_count
from .fields import check_choices, option
from .kernels.select import KernelBackend
from .tuning.autotune import AutoTune

__all__ = ["CompileOptions"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """How ``compile`` plans the training: ``compile`` takes these as keyword arguments, or one
    ``options=CompileOptions(...)``. Each field's default, choices and doc are its own
    (``dataclasses.fields(CompileOptions)``, ``field.metadata["doc"]``; docs/options.md).

    Raises:
        ValueError: ``batch_size`` or ``replicas`` not a positive integer (or ``"auto"``), a value
            not among a field's choices, a ``sync`` algorithm with an executor it does not run on
            (``SyncAlgorithm.check_executor``: e.g. ``DiLoCo`` with ``executor="process"``).
        TypeError: ``autotune``, ``optimizer``, ``sync``, ``distributed`` or ``memory_budget`` of
            the wrong type, ``verify``, ``strict_trace`` or ``cuda_graphs`` not a bool."""

    batch_size: int = option(doc="b, samples per learner per round (an integer ≥ 1)")
    devices: int | str | Sequence[str] = option(1, doc=(
        "'auto' (every CUDA GPU, else one CPU device), a count G (G GPUs, or G logical CPU "
        "devices), or device names such as ['cuda:0', 'cuda:1']"))
    replicas: int | Literal["auto"] = option("auto", doc=(
        "m, replicas per device (≥ 1), or 'auto': the auto-tuner picks m and the learner mode "
        "while fit runs (docs/design-overview.md §5)"))
    learner_mode: LearnerMode = option("per_replica", doc=(
        "'fused' runs a device's replicas as one vmapped program, tried on the example inputs "
        "first (where vmap cannot run the model: ValueError, or with replicas='auto' a warning)"))
    executor: Executor = option("auto", doc=(
        "'inline' (this process; CUDA streams on GPUs), 'process' (CPU worker processes over "
        "shared memory) or 'auto' (docs/runtime.md)"))
    autotune: AutoTune | None = option(None, doc=(
        "the auto-tuner's settings, crossbow_graph.AutoTune(...), with replicas='auto'; None: "
        "AutoTune()"))
    optimizer: SGD | torch.optim.Optimizer = option(SGD(), doc=(
        "each replica's local optimiser: a torch.optim optimizer built over the model's "
        "parameters, param groups kept (e.g. torch.optim.AdamW(model.parameters(), lr=1e-3)), or "
        "crossbow_graph.SGD(...) (docs/optimizers.md)"))
    sync: SyncAlgorithm = option(SMA(), doc=(
        "the sync algorithm (engine/sync/): SMA(...) (alpha=None: 0.8 of the pull's stability "
        "bound 2(1 + μ_z)/(1 + k + μ_z), at least 0.5; centre_rate=None: z's rate k·α, with "
        "the default α at most 0.8·(1 + μ_z)(2 − α); scale_lr=True: each "
        "learner steps at the lr × √min(k, 16), ramped over 0.25 epoch after every change of k, "
        "False: the lr as set; docs/design-overview.md §2), SSGD() (the k learners' "
        "gradients averaged, one SGD step for every replica; scale_lr=True: SMA's η rule), DiLoCo(sync_every=H) (an outer "
        "optimizer over z every H rounds) or LocalSGD(sync_every=H) (z the replicas' mean every H "
        "rounds); all but SMA run on the inline executor"))
    concrete_args: dict[str, Any] | None = option(None, doc=(
        "{forward argument: value} fixed for torch.fx's trace (TraceError's advice)"))
    leaf_modules: Sequence[type[nn.Module]] = option((), doc=(
        "module classes torch.fx keeps whole (measured eagerly, as a model it cannot trace)"))
    memory_budget: int | None = option(None, doc=(
        "bytes per device for the learners; None: the free memory on CUDA; on CPUs, the "
        "replicas' state must fit the host's available memory"))
    verify: bool = option(True, doc=(
        "run the verifier between the compiler passes, also when adjust re-plans"))
    kernel_backend: KernelBackend = option("auto", doc=(
        "the SMA update kernels (docs/kernels.md): 'auto' (Triton on CUDA, C on the CPU with a C "
        "compiler, else torch; torch for a float64 model), 'triton' (on the CPU through its "
        "interpreter), 'torch' or 'c'"))
    distributed: Distributed | None = option(None, doc=(
        "under torchrun, crossbow_graph.Distributed(...) (timeout, checksum period, sync dtype; "
        "fault_tolerant, lighthouse, replica_group, min_replicas, ft_attempts: torchft replica "
        "groups, docs/distributed.md; None: its defaults); each rank runs devices × m learners, "
        "z starts as rank 0's model"))
    precision: Precision = option("fp32", doc=(
        "'bf16'/'fp16': the learners' forward under torch.autocast, float32 parameters and SMA "
        "update, fp16 with a loss scale per replica (a float32 model only; docs/runtime.md)"))
    strict_trace: bool = option(False, doc=(
        "raise TraceError where torch.fx cannot trace the model; False: train it as given (analysed "
        "by one measured forward) with a one-line TraceWarning; plan.summary() says what "
        "inspection lost (docs/compiler.md §1)"))
    memory_format: MemoryFormat = option("auto", doc=(
        "layout of the nn.Conv2d weights in the replicas' rows: 'auto' (channels-last on CPU "
        "devices, contiguous on CUDA), 'channels_last' or 'contiguous' (docs/runtime.md)"))
    cuda_graphs: bool = option(False, doc=(
        "capture each round on one CUDA device in a CUDA graph and replay it (SMA with the SGD "
        "kernels; other rounds, or a failed capture, run eagerly with a GraphWarning; "
        "docs/runtime.md)"))
    cpu_conv: CpuConv = option("auto", doc=(
        "the convolution library of the process executor's workers: 'auto' (measured once per "
        "model and b), 'onednn' or 'aten'; the two round differently, so fix one for "
        "bit-identical resumes (docs/runtime.md)"))

    @property
    def tuned(self) -> bool:
        """``replicas="auto"``: the auto-tuner picks m."""
        return self.replicas == "auto"

    def __post_init__(self) -> None:
        batch_size, replicas = self.batch_size, self.replicas
        autotune, optimizer, sync = self.autotune, self.optimizer, self.sync
        if not is_count(batch_size):
            raise ValueError(f"batch_size={batch_size!r}: must be a positive integer, e.g. 16")
        if not self.tuned and not is_count(replicas):
            raise ValueError(f"replicas={replicas!r}: replicas per device must be an integer ≥ 1 "
                             "or 'auto'")
        if autotune is not None and not isinstance(autotune, AutoTune):
            raise TypeError(f"autotune must be crossbow_graph.AutoTune(...), got {type(autotune).__name__}")
        if not isinstance(optimizer, (SGD, torch.optim.Optimizer)):
            got = (f"the class {optimizer.__name__}: build an instance over the model's parameters"
                   if isinstance(optimizer, type) else type(optimizer).__name__)
            raise TypeError(f"optimizer must be a torch.optim optimizer built over the model's "
                            f"parameters, e.g. torch.optim.AdamW(model.parameters(), lr=1e-3), "
                            f"or crossbow_graph.SGD(lr=0.01); got {got}")
        if not isinstance(sync, SyncAlgorithm):
            names = ", ".join(f"crossbow_graph.{a.__name__}(...)" for a in ALGORITHMS)
            raise TypeError(f"sync must be one of {names}, got {type(sync).__name__}")
        sync.check_executor(self.executor)  # ValueError: e.g. DiLoCo on the process executor
        for name in ("verify", "strict_trace", "cuda_graphs"):
            check_flag(name, getattr(self, name))
        check_choices(self)
        budget = self.memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise TypeError(f"memory_budget={budget!r}: bytes per device as an integer, e.g. "
                            f"memory_budget=2 * 2**30 for 2 GiB, or None")
        distributed = self.distributed
        if distributed is not None and not isinstance(distributed, Distributed):
            raise TypeError(f"distributed must be crossbow_graph.Distributed(...), got {type(distributed).__name__}")
