"""The public entry point: ``compile(model, ...) -> Plan`` and ``Plan.fit`` (docs/design-overview.md §1)."""

from __future__ import annotations

import copy
import dataclasses
import math
import pathlib
import warnings
from typing import Any, Callable, Sequence

import networkx as nx
import torch
from torch import nn
from torch.utils._pytree import tree_map

from .compiler import inspect as _inspect
from .compiler.arguments import check_trace_arguments
from .compiler.outputs import model_loss
from .compiler.passes import build_task_graph
from .compiler.trace import ModelGraph, trace_model
from .config import LEARNER_MODES, SGD, Adjustment
from .engine.comm import Comm, Distributed, plan_facts
from .engine.optim import OptimizerRows, as_local_optimizer
from .engine.precision import check_precision
from .engine.fused import fused_mode_message, vmap_failure
from .engine.graphs import RoundGraph, cuda_graphs_refusal
from .engine.scheduler import Scheduler
from .engine.settings import RunSettings, settings_view
from .engine.sync import ALGORITHMS, SMA, SyncAlgorithm
from .engine.state import (MEMORY_FORMATS, DeviceState, FlatLayout, channels_last_weights,
                           check_grad_hooks, copy_module, float_buffers_named, model_dtype,
                           trainable_named)
from .errors import check_flag, is_count
from .kernels.select import plan_kernels, select_backend
from .training.batchnorm import BNRecalibration
from .training.checkpoint import load_plan_state_dict, plan_state_dict
from .training.data import collate_of
from .training.evaluation import eval_samples, evaluate_model
from .training.history import History
from .training.hooks import Hook
from .training.options import FitOptions, as_hooks
from .training.run_setup import RunRecord
from .training.trainer import Trainer
from .tuning.autotune import AutoTune, AutoTuner
from .tuning.metrics import MetricsMonitor
from .tuning.policy_base import apply_adjustment

__all__ = ["compile", "Plan", "resolve_devices"]


def resolve_devices(devices: int | str | Sequence[str]) -> list[str]:
    """Device names for ``devices``.

    ``"auto"``: every CUDA GPU (``cuda:0`` …), else one CPU device. An int G: G devices — GPUs
    when that many exist, else G logical CPU devices ``cpu:0 … cpu:G−1``. A list: those names.

    Raises:
        ValueError: G < 1, an unknown name, or a CUDA device that does not exist.
    """
    n_cuda = torch.cuda.device_count()
    if devices == "auto":
        return [f"cuda:{i}" for i in range(n_cuda)] or ["cpu:0"]
    if isinstance(devices, str) and devices.partition(":")[0] in ("cuda", "gpu"):
        where = (f"this machine has {n_cuda} CUDA GPUs: use devices=[{devices!r}]" if n_cuda and devices != "gpu"
                 else f"this machine has {n_cuda} CUDA GPUs: use devices='auto'" if n_cuda
                 else "this machine has no CUDA GPU (torch.cuda.device_count() is 0): use devices=1 (the "
                      "CPU), or a count of logical CPU devices such as devices=2")
        raise ValueError(f"devices={devices!r}: {where}")
    if isinstance(devices, bool) or not isinstance(devices, (int, list, tuple)):
        raise ValueError(f"devices={devices!r}: use 'auto', a number of devices, or a list of "
                         "names such as ['cuda:0', 'cuda:1'] or ['cpu:0', 'cpu:1']")
    if isinstance(devices, int):
        if devices < 1:
            raise ValueError(f"devices={devices}: need at least one device")
        if n_cuda:
            if devices > n_cuda:
                raise ValueError(f"devices={devices}, but this machine has {n_cuda} CUDA GPUs; "
                                 f"use devices≤{n_cuda} or devices='auto'")
            return [f"cuda:{i}" for i in range(devices)]
        return [f"cpu:{i}" for i in range(devices)]
    names = list(devices)
    for name in names:
        kind, _, idx = str(name).partition(":")
        if kind not in ("cpu", "cuda") or (idx and not idx.isdigit()):
            raise ValueError(f"device '{name}': use 'cpu:N' (a logical CPU device) or 'cuda:N'")
        if kind == "cuda" and int(idx or 0) >= n_cuda:
            raise ValueError(f"device '{name}' does not exist: this machine has {n_cuda} CUDA GPUs")
    if len(set(names)) != len(names):
        raise ValueError(f"devices {names} name a device twice")
    return names


def _torch_device(name: str) -> torch.device:
    return torch.device("cpu") if name.startswith("cpu") else torch.device(name)


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        hint = (" (a factory: call it, e.g. cg.models.lenet5())" if callable(model) and not isinstance(model, str)
                else " (a zoo name: build it with cg.models.get_model(name))" if isinstance(model, str) else "")
        raise TypeError(f"compile() takes an nn.Module as model, got {type(model).__name__} {model!r:.60}{hint}")
    params = list(model.parameters())
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameters: there is nothing to train")
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if t.is_meta:
                raise ValueError(f"model's {kind} '{name}' is on the meta device (no data): "
                                 "materialise it, e.g. model.to_empty(device='cpu') and load "
                                 "weights (model.load_state_dict(...)), before compile")
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise ValueError(f"parameter '{name}' of {type(model).__name__} has dtype {p.dtype}; "
                             "trainable parameters must be floating point (register integer "
                             "tensors as buffers)")
    if not any(p.requires_grad for p in params):
        raise ValueError(f"every parameter of {type(model).__name__} is frozen "
                         "(requires_grad=False): there is nothing to train")
    check_grad_hooks(model)


def _check_batch_norm(model_graph: ModelGraph, batch_size: int) -> None:
    """BatchNorm in training mode needs more than one value per channel: b · (spatial size) > 1,
    read from the traced (or measured) input shape of every BatchNorm module (BatchNorm1d on
    ``[N, C]`` at b = 1 fails; BatchNorm2d on ``[N, C, H, W]`` with H·W > 1 works)."""
    if batch_size != 1:
        return
    for path, cls, shape in model_graph.batch_norm_inputs:
        if math.prod(shape[2:]) == 1:  # one value per channel and sample
            raise ValueError(
                f"batch_size=1 with {cls} '{path}', which normalises "
                f"inputs of shape [1, {', '.join(map(str, shape[1:]))}] per learner: BatchNorm "
                "needs more than one value per channel in training; use batch_size ≥ 2, or "
                "GroupNorm/LayerNorm instead of BatchNorm")


def compile(  # noqa: A001 - the public name the design asks for
    model: nn.Module, example_inputs: tuple[Any, ...] | dict[str, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    *, batch_size: int, devices: int | str | Sequence[str] = 1, replicas: int | str = "auto",
    learner_mode: str = "per_replica", executor: str = "auto", autotune: AutoTune | None = None,
    optimizer: "SGD | torch.optim.Optimizer" = SGD(), sync: SyncAlgorithm = SMA(),
    concrete_args: dict[str, Any] | None = None, leaf_modules: Sequence[type[nn.Module]] = (),
    memory_budget: int | None = None, verify: bool = True, kernel_backend: str = "auto",
    distributed: Distributed | None = None, precision: str = "fp32", strict_trace: bool = False,
    memory_format: str = "auto", cuda_graphs: bool = False,
) -> "Plan":
    """Trace ``model`` and compile it into a runnable, inspectable plan of SMA training.

    The plan trains k = G·m replicas (m per device, G devices) with synchronous model averaging
    (docs/design-overview.md §2). Each replica starts as a copy of ``model``'s current weights;
    ``model`` itself is not modified.

    Args:
        model: the ``nn.Module`` to train (floating-point parameters).
        example_inputs: one batch: a tuple of positional inputs, e.g. ``(x,)`` with
            ``x [N, 1, 28, 28]``, or a dict of keyword inputs, e.g. a HuggingFace model's
            ``{"input_ids": ids [N, T], "attention_mask": mask [N, T]}``.
        loss_fn: ``loss_fn(output, target) -> scalar`` (batch mean; or a dict with it under
            ``"loss"``) on the output as the model returns it (tensor, tuple, dict, ModelOutput);
            None: the loss the model computes from labels in its inputs (compiler/outputs.py).
        batch_size: b, samples per learner per round (> 0).
        devices: ``"auto"`` (every GPU, else one CPU device), a count, or device names.
        replicas: m, replicas per device (≥ 1), or ``"auto"``: the auto-tuner (tuning/autotune.py,
            docs/design-overview.md §5) picks m and the learner mode while ``fit`` runs.
        learner_mode: ``"per_replica"`` or ``"fused"`` (a device's replicas as one vmapped
            program, tried first on the example inputs: where vmap cannot run the model,
            ValueError naming ``"per_replica"``, or with ``replicas="auto"`` a warning).
        executor: ``"auto"``, ``"inline"`` (this process; CUDA streams on GPUs) or ``"process"``
            (CPU worker processes over shared memory); see ``engine.scheduler``.
        autotune: the auto-tuner's settings (with ``replicas="auto"``); default ``AutoTune()``.
        optimizer: a ``torch.optim`` optimizer built over ``model``'s parameters, param groups
            kept (e.g. ``torch.optim.AdamW(model.parameters(), lr=1e-3)``), or
            ``crossbow_graph.SGD(...)``; each replica has its own state, the SMA correction
            follows the local step (engine/optim.py, docs/optimizers.md). ``Plan.optimizer``.
        sync: the SMA settings (α = None means 1/k), or ``SSGD()``: gradients averaged over the
            k learners and one SGD step for all replicas (a batch of k·b; the inline executor),
            or ``DiLoCo(sync_every=H)``: an outer optimizer over z every H rounds, replicas
            restarted from z (the inline executor); or another algorithm of engine/sync/
            (docs/design-overview.md §2).
        concrete_args, leaf_modules: {forward argument: value} and a list of module classes for
            torch.fx (TraceError's advice); leaves, the model as one too, are measured eagerly.
        memory_budget: bytes per device for learners; None: no bound on CPUs, free memory on CUDA.
        verify: run the verifier between compiler passes.
        kernel_backend: the SMA update kernels (docs/kernels.md): ``"auto"`` (Triton on CUDA,
            C on the CPU with a C compiler, else torch; torch for a float64 model), ``"c"``,
            ``"triton"`` (on the CPU through its interpreter) or ``"torch"``.
        distributed: under torchrun, ``crossbow_graph.Distributed`` (timeout, checksum period,
            sync dtype); each rank runs ``devices`` × m learners, z starts as rank 0's model.
        precision: ``"fp32"``, or ``"bf16"``/``"fp16"``: the learners' forward under
            ``torch.autocast`` with float32 parameters and SMA update, fp16 with a loss scale per
            replica (a float32 model only; engine/precision.py, docs/runtime.md).
        strict_trace: raise TraceError when no fx graph can be made; False: train as given,
            analysed by one measured forward, with a ``TraceWarning`` (docs/compiler.md §1).
        memory_format: ``"auto"`` (``nn.Conv2d`` weights channels-last in the rows on CPU
            devices, contiguous on CUDA), ``"channels_last"`` or ``"contiguous"`` (docs/runtime.md).
        cuda_graphs: capture each round on one CUDA device in a CUDA graph and replay it (SMA
            with the SGD kernels; other rounds, or a failed capture, run eagerly with a
            ``GraphWarning``; engine/graphs.py, docs/runtime.md). Off by default.

    Returns:
        The Plan.

    Raises:
        TraceError: the example inputs do not run through the model, or (``strict_trace``)
            torch.fx cannot trace it.
        ValueError: a bad argument (batch size, replicas, devices, backend, precision, memory
            format, ``cuda_graphs=True`` without CUDA devices; a model without trainable float
            parameters or with a post-accumulate-grad hook; ``loss_fn=None`` without a loss;
            ``"fused"`` for a model vmap cannot run; a meta example input; docs/reliability.md).
        TypeError: ``loss_fn`` not callable or a loss class, a flag not a bool, a tracing argument.
        ImportError, CompilerError: the Triton or C kernels asked for cannot be built.
        PlanError: the plan is unsound, e.g. the replicas do not fit ``memory_budget``.
        DistributedError: under torchrun, the ranks' plans differ (names the difference).
    """
    args = _CompileArgs(**locals())  # every argument, by name (nothing else is defined yet)
    return _build_plan(args)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _CompileArgs:
    """``compile``'s arguments, checked when built (ValueError/TypeError as ``compile``
    documents them), before any tracing."""

    model: nn.Module
    example_inputs: tuple[Any, ...]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    batch_size: int
    devices: int | str | Sequence[str]
    replicas: int | str
    learner_mode: str
    executor: str
    autotune: AutoTune | None
    optimizer: Any
    sync: SyncAlgorithm
    concrete_args: dict[str, Any] | None
    leaf_modules: Sequence[type[nn.Module]]
    memory_budget: int | None
    verify: bool
    kernel_backend: str
    distributed: Distributed | None
    precision: str
    strict_trace: bool = False
    memory_format: str = "auto"
    cuda_graphs: bool = False

    @property
    def tuned(self) -> bool:
        """``replicas="auto"``: the auto-tuner picks m."""
        return self.replicas == "auto"

    def __post_init__(self) -> None:
        batch_size, replicas, loss_fn = self.batch_size, self.replicas, self.loss_fn
        autotune, optimizer, sync = self.autotune, self.optimizer, self.sync
        if not is_count(batch_size):
            raise ValueError(f"batch_size={batch_size!r}: must be a positive integer, e.g. 16")
        if not self.tuned and not is_count(replicas):
            raise ValueError(f"replicas={replicas!r}: replicas per device must be an integer ≥ 1 "
                             "or 'auto'")
        if autotune is not None and not isinstance(autotune, AutoTune):
            raise TypeError(f"autotune must be crossbow_graph.AutoTune(...), got {type(autotune).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, target), or None (the "
                            f"model's own output.loss), got {type(loss_fn).__name__}")
        if isinstance(loss_fn, type):  # the class itself is callable too: loss_fn(output, target) builds one
            prefix = "nn." if loss_fn.__module__.startswith("torch.nn") else ""
            raise TypeError(f"loss_fn={prefix}{loss_fn.__name__} is a class, not a loss: pass an "
                            f"instance: {prefix}{loss_fn.__name__}()")
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
        _check_model(self.model)
        for name in ("verify", "strict_trace", "cuda_graphs"):
            check_flag(name, getattr(self, name))
        check_trace_arguments(self.model, self.example_inputs, self.concrete_args, self.leaf_modules)
        if self.memory_format not in MEMORY_FORMATS:
            raise ValueError(f"memory_format={self.memory_format!r}: must be one of "
                             f"{', '.join(map(repr, MEMORY_FORMATS))}")
        check_precision(self.precision, model_dtype(trainable_named(self.model)))
        budget = self.memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise TypeError(f"memory_budget={budget!r}: bytes per device as an integer, e.g. "
                            f"memory_budget=2 * 2**30 for 2 GiB, or None")
        distributed = self.distributed
        if distributed is not None and not isinstance(distributed, Distributed):
            raise TypeError(f"distributed must be crossbow_graph.Distributed(...), got {type(distributed).__name__}")


def _build_plan(args: _CompileArgs) -> "Plan":
    """``compile`` after its argument checks: devices and torchrun's process group, the update
    kernels' backend, the traced model and the task graph, the Plan."""
    names, comm = _devices_and_comm(args.devices, args.distributed)
    if args.cuda_graphs and (refusal := cuda_graphs_refusal(names)):
        raise ValueError(refusal)
    kernels = select_backend(args.kernel_backend, "cuda" if names[0].startswith("cuda") else "cpu",
                             model_dtype(trainable_named(args.model)))
    model_graph = trace_model(args.model, args.example_inputs, concrete_args=args.concrete_args,
                              leaf_modules=args.leaf_modules, strict=args.strict_trace)
    _check_batch_norm(model_graph, args.batch_size)
    if args.loss_fn is None and not model_graph.output_has_loss:
        raise ValueError(f"loss_fn=None trains on the loss {model_graph.name} computes itself "
                         "(output.loss or output['loss']), but its output on the example inputs "
                         "has none: put the labels among the example inputs, e.g. "
                         "{'input_ids': ids, 'labels': labels}, or pass a loss_fn(output, target)")
    memory_budget = args.memory_budget
    if memory_budget is None and names[0].startswith("cuda"):
        memory_budget = cuda_memory_budget(names)
    graph = build_task_graph(model_graph, devices=names,
                             replicas_per_device=1 if args.tuned else args.replicas,
                             batch_size=args.batch_size, memory_budget_bytes=memory_budget,
                             verify=args.verify)
    plan = Plan(model=args.model, model_graph=model_graph, task_graph=graph,
                loss_fn=model_loss if args.loss_fn is None else args.loss_fn,
                batch_size=args.batch_size, optimizer=args.optimizer, sync=args.sync,
                learner_mode=args.learner_mode, executor=args.executor,
                memory_budget=memory_budget, verify=args.verify,
                autotune=(args.autotune or AutoTune()) if args.tuned else None, kernels=kernels,
                comm=comm, precision=args.precision, example_inputs=args.example_inputs,
                memory_format=args.memory_format)
    plan.kernels  # emits the plan's update kernels now (cached; the scheduler launches these)
    plan.scheduler.round_graph = RoundGraph() if args.cuda_graphs else None
    if args.learner_mode == "fused" and plan.fused_failure is not None:
        message = fused_mode_message(type(args.model).__name__, plan.fused_failure)
        if not args.tuned:
            raise ValueError(message)
        warnings.warn(f"{message}; replicas='auto' starts with per_replica", stacklevel=3)
        plan.set_learner_mode("per_replica")
    return plan


def cuda_memory_budget(names: Sequence[str]) -> int:
    """Bytes the plan may use per GPU: the smallest over ``names`` of what the device has free
    (``torch.cuda.mem_get_info``) plus what this process's caching allocator already reserved
    there (reusable), so that other processes' memory and the CUDA context are left out."""
    budgets = []
    for name in names:
        device = _torch_device(name)
        free, _total = torch.cuda.mem_get_info(device)
        budgets.append(int(free) + int(torch.cuda.memory_reserved(device)))
    return min(budgets)


def _devices_and_comm(devices: int | str | Sequence[str],
                      distributed: Distributed | None) -> tuple[list[str], Comm | None]:
    """The device names (``resolve_devices``) and, under torchrun, this rank's Comm. On GPUs
    under torchrun the ranks of a machine take disjoint GPUs (NCCL refuses two ranks on one):
    with ``devices="auto"`` local rank r takes ``cuda:r``; with a count G, ``cuda:r·G`` …
    ``cuda:r·G+G−1``; a list of names is taken as given.

    Raises:
        ValueError: a count G whose GPUs for this local rank do not exist on the machine.
    """
    names = resolve_devices(devices)
    comm = Comm.from_env(distributed, on_cuda=names[0].startswith("cuda"))
    if comm is None or not names[0].startswith("cuda"):
        return names, comm
    if devices == "auto":
        names = [f"cuda:{comm.local_rank}"]  # one process per GPU, as torchrun launches them
    elif isinstance(devices, int) and not isinstance(devices, bool):
        first, n_cuda = comm.local_rank * devices, torch.cuda.device_count()
        if first + devices > n_cuda:
            raise ValueError(f"devices={devices} under torchrun: local rank {comm.local_rank} "
                             f"would take cuda:{first}…cuda:{first + devices - 1}, but this machine "
                             f"has {n_cuda} CUDA GPUs; use devices='auto' (one GPU per process) or "
                             f"--nproc-per-node {max(1, n_cuda // devices)}")
        names = [f"cuda:{first + i}" for i in range(devices)]
    return names, comm


class Plan:
    """A compiled SMA training plan: the task graph of one round and the state it runs on.

    Attributes:
        task_graph: ``networkx.DiGraph``; node attribute ``"task"`` holds a Task; it records the
            b and m it was planned for (re-planned when they change).
        model_graph: the traced model (fx GraphModule, shapes, parameter inventory).
        settings: the run settings in force (engine/settings.py ``RunSettings``: η, b, α, τ, m,
            learner mode), changed only through ``adjust``; the attributes below that name one
            of them are read-only views of it.
        devices: device names; ``replicas_per_device``: m; ``num_learners``: k = G·m.
        batch_size: b.
        learner_mode: ``"per_replica"`` or ``"fused"``.
        optimizer: the local optimiser (a torch.optim optimizer; its param groups hold the
            settings in force); ``sync``: the sync algorithm with the α and τ (H) in force.
        memory_budget: bytes per device for learners (None: unbounded).
        autotuner: the AutoTuner hook that ``fit`` runs (``replicas="auto"``), else None.
        precision: the learners' precision, ``"fp32"``, ``"bf16"`` or ``"fp16"`` (read-only).
    """

    batch_size = settings_view("batch_size", "b, samples per learner per round (read-only).")
    replicas_per_device = settings_view("replicas_per_device", "m, replicas per device (read-only).")
    learner_mode = settings_view("learner_mode", "'per_replica' or 'fused' (read-only).")
    sync = settings_view("sync", "The sync algorithm with its α and τ (H) in force (read-only).")

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The local optimiser as the user gave it (a torch.optim optimizer; for
        ``crossbow_graph.SGD`` a one-group ``torch.optim.SGD`` over the plan's own copy of the
        model): never stepped, its ``param_groups`` hold the settings in force. Build an LR
        scheduler over it (``fit(lr_scheduler=...)``); ``settings.optimizer`` maps its groups
        to the replicas (engine/optim.py)."""
        return self.settings.optimizer.optimizer

    def __init__(self, *, model: nn.Module, model_graph: ModelGraph, task_graph: nx.DiGraph,
                 loss_fn: Callable, batch_size: int, optimizer: Any, sync: SyncAlgorithm,
                 learner_mode: str = "per_replica", executor: str = "auto",
                 memory_budget: int | None = None, verify: bool = True,
                 autotune: AutoTune | None = None, kernels: Any = None,
                 comm: Comm | None = None, precision: str = "fp32",
                 example_inputs: Any = None, memory_format: str = "auto") -> None:
        self.model_graph = model_graph
        self.task_graph = task_graph
        self.loss_fn = loss_fn
        self._template = copy_module(model).train()  # with its parameters' gradient hooks
        self._params = FlatLayout.of(trainable_named(self._template), channels_last_weights(
            self._template, memory_format, {_torch_device(d).type for d in task_graph.graph["devices"]},
            example_inputs))
        self._buffers = FlatLayout.of(float_buffers_named(self._template))
        local = as_local_optimizer(optimizer, model, self._template,
                                   [name for name, *_ in self._params.entries])
        sync.check_optimizer(local)  # ValueError: e.g. SSGD with AdamW
        self.settings = RunSettings(optimizer=local, sync=sync, batch_size=batch_size,
                                    replicas_per_device=int(task_graph.graph["replicas_per_device"]),
                                    learner_mode=learner_mode)
        self.states = [
            DeviceState(name, _torch_device(name), self._template, self.replicas_per_device,
                        self._params, self._buffers, precision=precision)
            for name in self.devices
        ]
        if not local.kernel:
            for s in self.states:
                s.optim_rows = OptimizerRows(local, s)
        self._central = copy.deepcopy(self._template).to(self.states[0].torch_device).eval()
        self._central_buf = self.states[0].zbuf.clone()  # [Q] the evaluated central model's buffers
        self.states[0].bind_central(self._central, self._central_buf)
        self.bn_recalibration = BNRecalibration(self._central)  # set by every fit
        self.scheduler = Scheduler(task_graph, self.states, loss_fn, self.settings, executor=executor)
        if kernels is not None:
            self.scheduler.kernels = kernels
        self.memory_budget = memory_budget
        self._verify = verify
        self.autotuner = AutoTuner(autotune) if autotune is not None else None
        self.comm = comm  # under torchrun: this rank's place in the process group (engine/comm.py)
        self.scheduler.comm = comm
        self._example_inputs = tree_map(  # fused_failure's dry run
            lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, example_inputs)
        self._fused_failure: tuple[str | None] | None = None  # (failure,) once probed
        if comm is not None:
            comm.agree(plan_facts(self), "the plan")
            self._start_from_rank0()
            self._int_buffers_from_rank0(replicas=True)
        self.epochs_done = 0
        self.rounds_done = 0
        self.round_in_epoch = 0  # rounds done in an unfinished epoch (a resumed fit starts there)
        self.position_in_epoch = 0  # samples of the epoch's order used so far
        self.train_seconds = 0.0
        self._unscored_warned = False  # evaluate's warning that no accuracy can be computed
        self.last_eval_extras: dict[str, float] = {}  # the last evaluate's Evaluation.extras
        self.run_record = RunRecord()  # its set-up and checkpoints (training/run_setup.py)

    # -- shape of the plan ------------------------------------------------------------------

    @property
    def devices(self) -> list[str]:
        return list(self.task_graph.graph["devices"])

    @property
    def precision(self) -> str:
        """The learners' precision (engine/precision.py), held by the device states."""
        return self.states[0].precision

    @property
    def num_learners(self) -> int:
        """k = G·m, over every process under torchrun."""
        return len(self.devices) * self.replicas_per_device * (self.comm.world_size if self.comm else 1)

    @torch.no_grad()
    def _start_from_rank0(self) -> None:
        """Every rank's replicas, z, z_prev and buffers start as rank 0's model (docs/design-overview.md §2:
        one initialisation, cloned), whatever each process's own initialisation was."""
        first = self.states[0]
        z, zbuf = first.z.clone(), first.zbuf.clone()
        self.comm.broadcast_tensor_(z, -1)
        if zbuf.numel():
            self.comm.broadcast_tensor_(zbuf, -1)
        for s in self.states:
            s.z.copy_(z)
            s.z_prev.copy_(z)
            s.w.copy_(z.expand_as(s.w))
            if zbuf.numel():
                s.zbuf.copy_(zbuf)
                s.buf.copy_(zbuf.expand_as(s.buf))

    @torch.no_grad()
    def _int_buffers_from_rank0(self, *, replicas: bool, round_index: int = -1) -> None:
        """Under torchrun: rank 0's first replica's integer buffers (one broadcast) into the
        central model on every rank, and into every replica with ``replicas`` (at start-up)."""
        ints = {n: b.cpu() for n, b in self.states[0].replicas[0].named_buffers()
                if not b.is_floating_point()}
        if not ints:  # the same on every rank: the model fingerprints agree
            return
        ints = self.comm.broadcast_object(ints, round_index)
        modules = [self._central] + ([r for s in self.states for r in s.replicas] if replicas else [])
        for module in modules:
            for name, b in module.named_buffers():
                if name in ints:
                    b.copy_(ints[name])

    @property
    def fused_failure(self) -> str | None:
        """Why ``learner_mode="fused"`` cannot run this model, or None: torch.func.vmap's error
        in a dry run of two stacked replicas on the first two example inputs (engine/fused.py
        ``vmap_failure``; e.g. ``torch.nn.LSTM`` has no batching rule). Probed once, when first
        read: by ``compile(learner_mode="fused")``, by ``adjust`` before it switches to fused,
        and by the auto-tuner before it tries fused."""
        if self._fused_failure is None:
            found = None if self._example_inputs is None else \
                vmap_failure(self._template, self._example_inputs)
            self._fused_failure = (found,)
        return self._fused_failure[0]

    @property
    def verify(self) -> bool:
        """Whether the verifier runs between the compiler passes, also when ``adjust`` re-plans."""
        return self._verify

    @property
    def template(self) -> nn.Module:
        """The module every replica is cloned from: a copy of the input model in training mode,
        never trained (read it, do not modify it; ``central_model()`` gives the trained one)."""
        return self._template

    @property
    def max_replicas_per_device(self) -> int | None:
        """The memory bound on m: ``memory_budget // memory_per_learner_bytes`` (None: unbounded)."""
        mem = self.task_graph.graph.get("memory_per_learner_bytes")
        if self.memory_budget is None or not mem:
            return None
        return max(1, self.memory_budget // mem)

    def set_replicas(self, replicas_per_device: int) -> None:
        """Change m between rounds, without losing state (docs/design-overview.md §5, auto-tuner).

        Re-runs the compiler passes (and verifier) for the new m, so ``task_graph`` always matches
        what runs; kept replicas keep their state; new ones are cloned from z with zeroed
        momentum; removed ones are the last of each device; α is re-derived for the new k
        (``SMA.alpha_for``); z is untouched. The next fit round draws k·b samples for the new k.
        The same as ``adjust(Adjustment(replicas_per_device=m))``.

        Raises:
            ValueError: m < 1.
            PlanError: m replicas exceed the memory budget.
        """
        m = replicas_per_device
        if not is_count(m):
            raise ValueError(f"replicas_per_device={m!r}: must be an integer ≥ 1")
        self.adjust(Adjustment(replicas_per_device=m))

    def set_learner_mode(self, mode: str) -> None:
        """Switch the learner mode (``"per_replica"`` or ``"fused"``) from the next round on; the
        same as ``adjust(Adjustment(learner_mode=mode))``.

        Raises:
            ValueError: an unknown mode.
        """
        if mode not in LEARNER_MODES:
            raise ValueError(f"learner_mode={mode!r}: use one of {LEARNER_MODES}")
        self.adjust(Adjustment(learner_mode=mode))

    @property
    def num_parameters(self) -> int:
        """P, trainable scalars per replica (tied parameters once)."""
        return self._params.size

    def _inspection_settings(self) -> dict[str, Any]:
        sync, state = self.sync, self.scheduler.sync_state
        return {"optimizer": self.settings.optimizer.describe(), "sync": sync.describe(state),
                "sync_rule": sync.summary_rule(self.num_learners, state),
                "alpha": sync.alpha_for(self.num_learners)}

    @property
    def kernels(self) -> list:
        """The SMA update kernels this plan runs (docs/design-overview.md §4), one per specialisation.

        Each has ``spec`` (m, P, dtype, block, the constexpr flags), ``backend`` (``"triton"`` or
        ``"torch"``) and ``source`` (printable: the Triton source with its constexpr values, or
        the torch function); Triton ones on CUDA also carry ``asm`` after their first launch, and
        ``lower(arch)`` compiles them to PTX without a GPU.
        """
        local = self.settings.optimizer
        opt = local.sgd()
        return plan_kernels(self.scheduler.kernels, self.states, local=local.kernel,
                            momentum=opt.momentum, nesterov=opt.nesterov,
                            weight_decay=opt.weight_decay,
                            **self.sync.kernel_facts(self.num_learners))  # k, τ, μ_z

    def summary(self) -> str:
        """A table per device: replicas, tasks, GFLOP per round, memory (MiB); then the totals.

        See ``crossbow_graph.compiler.inspect.summary``; under torchrun a last line gives the
        bytes each process hands to the global sync's all-reduce (``Distributed.sync_bytes``).
        """
        text = _inspect.summary(self.task_graph, self._inspection_settings())
        if self.comm is not None:
            d = self.comm.settings
            text += (f"\nglobal sync over {self.comm.world_size} processes: "
                     f"{d.sync_bytes(self.num_parameters, self.states[0].buf.shape[1]):,} bytes "
                     f"per process per sync ({d.sync_dtype} corrections)")
        return text

    def to_json(self, *, indent: int | None = 2) -> str:
        """The task graph as JSON, schema ``crossbow_graph.plan/2`` (docs/compiler.md)."""
        return _inspect.to_json(self.task_graph, self._inspection_settings(), indent=indent)

    @staticmethod
    def from_json(text: str) -> "_inspect.PlanView":
        """Load ``to_json``'s output as an inspectable PlanView: summary, to_json, to_dot and draw
        work; it holds no replicas, so ``fit`` raises PlanError (compile the model to train).

        Raises:
            ValueError: not a plan document. PlanError: the task graph fails the verifier.
        """
        return _inspect.from_json(text)

    def to_dot(self) -> str:
        """Graphviz DOT text of the task graph, devices as clusters."""
        return _inspect.to_dot(self.task_graph)

    def draw(self, path: str) -> "pathlib.Path":
        """Write a picture of the task graph (PNG, SVG or PDF by suffix), devices as clusters.

        Raises:
            RuntimeError: graphviz's ``dot`` is not installed. ValueError: an unknown suffix.
        """
        return _inspect.draw(self.task_graph, path)

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The training state: per device ``w, v [m, P]``, ``z, z_prev [P]``, ``buf [m, Q]``,
        ``zbuf [Q]``, integer buffers, ``first_step``; learning rate, the epoch's losses, faults,
        counters (epochs, rounds, round in epoch, seconds); the model's parameter and buffer
        names, shapes and dtypes. CPU tensors and plain values;
        ``fit(checkpoint_dir=...)`` adds the RNGs, data position, hooks and history
        (training/checkpoint.py)."""
        return plan_state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` in place.

        Raises:
            CheckpointError: the state is of another model (a parameter or buffer of another
                name, shape or dtype: the message names the first) or of a plan with other
                devices, replicas or parameters.
        """
        load_plan_state_dict(self, state)

    # -- the central average model ----------------------------------------------------------

    def central_weights(self, device: int = 0) -> torch.Tensor:
        """A copy of device ``device``'s central average model z, ``[P]``: the trainable
        parameters flattened and concatenated in ``named_parameters()`` order, float64 for a
        float64 model, else float32 (the masters' dtype)."""
        self.scheduler.flush()
        return self._params.to_standard(self.states[device].z.detach())

    def replica_weights(self) -> torch.Tensor:
        """A copy of every replica's parameters, ``[k, P]``, device-major (j = d·m + r), each row
        in ``central_weights``' order."""
        self.scheduler.flush()
        return self._params.to_standard(
            torch.cat([s.w.detach().to(self.states[0].torch_device) for s in self.states]))

    def central_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The central model z (evaluation mode: no dropout, no BatchNorm update) on ``args``
        (tensors moved to device 0) and ``kwargs``, its buffers first refreshed as
        ``central_model()``'s are (BatchNorm statistics re-estimated for z). Gradients are
        tracked unless the caller disables them (``torch.no_grad()``)."""
        device = self.states[0].torch_device
        moved = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        self._refresh_central()
        return self._central(*moved, **kwargs)

    def _refresh_central(self) -> None:
        """The evaluated central model's buffers for the current z: float buffers from zbuf,
        BatchNorm statistics re-estimated for z when the last fit asked for it
        (training/batchnorm.py ``BNRecalibration``; on every rank alike, from the same samples),
        integer buffers (num_batches_tracked) from the first replica.

        Under torchrun only rank 0 carries the integer buffers: the other ranks' copies are rank
        0's, received at start-up and at the end of every fit (``_int_buffers_from_rank0``), so
        that the central model is the same on every rank without a collective when it is read.
        """
        self.scheduler.flush()
        first = self.states[0]
        self.bn_recalibration.refresh(self._central, self._central_buf, z=first.z, zbuf=first.zbuf,
                                      batch_size=self.batch_size, num_learners=self.num_learners,
                                      round_index=self.rounds_done)
        if self.comm is not None and not self.comm.is_main:
            return
        src = dict(self.states[0].replicas[0].named_buffers())
        for name, b in self._central.named_buffers():
            if not b.is_floating_point():
                b.copy_(src[name])

    def central_model(self) -> nn.Module:
        """The central average model z as a new ``nn.Module`` of the input model's class.

        Its state_dict has the input model's keys: trainable parameters from z; BatchNorm running
        statistics re-estimated for z's weights on ``fit(bn_recalibration_batches=...)`` batches
        of b training samples of the last fit when k > 1 (training/batchnorm.py; with k = 1 the
        replica's own, as plain PyTorch has them; without a fit, or with 0 batches, the
        replicas' mean at the last sync); other float buffers from the replicas' mean at the
        last sync; integer buffers (``num_batches_tracked``, counters) from the first
        replica; frozen parameters unchanged; the input model's gradient hooks on its
        parameters (``Tensor.register_hook``) and module hooks. Under torchrun the integer buffers
        are rank 0's first replica's on every rank (rank 0 reads its own; the others hold the
        ones rank 0 broadcast at start-up and at the end of every fit, one broadcast per fit and
        none per round), so the state_dict is bit-identical on every rank outside a fit.
        """
        self._refresh_central()
        out = copy_module(self._template)
        out.load_state_dict({k: v.detach().clone() for k, v in self._central.state_dict().items()})
        return out.eval()

    @torch.no_grad()
    def evaluate(self, dataset: Any, *, batch_size: int = 1000,
                 metric_fn: Callable[[Any, Any], Any] | None = None) -> tuple[float | None, float]:
        """Test accuracy (fraction) and mean loss of z on ``dataset``
        (training/evaluation.py ``evaluate_model``), with the central model's buffers as
        ``central_model()`` has them (BatchNorm statistics re-estimated for z).

        The accuracy is ``metric_fn(output, target)`` averaged over the samples when given;
        else the class accuracy of the output's class scores ``[N, C]`` (the output,
        ``output.logits`` of a HuggingFace ModelOutput, or the first tensor of a tuple or dict)
        against integer targets ``[N]``; None otherwise, with a ``UserWarning`` (once per plan)
        that says why and names ``metric_fn``.
        ``dataset``: a Dataset, or a DataLoader: the samples its sampler (or batch_sampler)
        yields are scored (training/evaluation.py ``eval_samples``), its collate_fn collates
        each batch of ``batch_size`` samples (its other settings are not used).
        """
        data, dataset = dataset, eval_samples(dataset)
        self._refresh_central()
        result = evaluate_model(self._central, self.loss_fn, dataset, batch_size=batch_size,
                                device=self.states[0].torch_device, metric_fn=metric_fn,
                                collate_fn=collate_of(data))
        self.last_eval_extras = result.extras  # a dict loss_fn's other entries (EvalRecord)
        if result.unscored and not self._unscored_warned:
            self._unscored_warned = True
            warnings.warn(f"{self.model_graph.name}: no test accuracy: {result.unscored}; "
                          "test_accuracy is None and target_accuracy cannot stop training",
                          UserWarning, stacklevel=2)
        return result.accuracy, result.loss

    # -- training -----------------------------------------------------------------------------

    def fit(
        self, train_dataset: Any, epochs: int = 1, *, eval_dataset: Any = None,
        shuffle: bool = True, seed: int = 0, target_accuracy: float | None = None,
        evals_per_epoch: int = 1, eval_batch_size: int = 1000, progress: bool = True,
        hooks: Sequence[Hook] = (), checkpoint_dir: str | None = None,
        checkpoint_every: int | None = None, resume: bool = False, log_dir: str | None = None,
        trace: str | None = None, policies: Sequence[Hook] = (),
        metrics_every: "int | MetricsMonitor | None" = 50, lr_scheduler: Any = None,
        lr_scheduler_interval: str = "epoch", metric_fn: Callable[[Any, Any], Any] | None = None,
        bn_recalibration_batches: int = 20, data_on_device: bool | str = "auto",
        max_grad_norm: float | None = None,
    ) -> History:
        """Train with SMA for ``epochs`` epochs (continuing from the plan's current state).

        Each of the k learners draws its own disjoint batch of b samples per round from one
        seeded order per epoch; a last partial round is dropped.

        Args:
            train_dataset: a torch Dataset of ``(inputs, target)`` samples (or of dicts of keyword
                inputs whose ``"labels"`` are the target, engine/inputs.py), or a DataLoader: its
                ``collate_fn`` gets each learner's b samples, its workers load the rounds ahead;
                the plan still picks the samples (docs/runtime.md, Your DataLoader).
            data_on_device: ``"auto"``, True or False: a TensorDataset's tensors ``[N, ...]`` on
                the plan's first device for the fit, each round's ``[k·b]`` samples gathered
                there (``"auto"``: on CUDA, if they take ≤ ¼ of its free memory); other data is
                copied to CUDA devices a round ahead (docs/runtime.md, Data on the device).
            max_grad_norm: every learner clips its own gradient to this 2-norm before its local
                step, as ``torch.nn.utils.clip_grad_norm_`` does (docs/optimizers.md); None:
                no clipping.
            eval_dataset: evaluated with z ``evals_per_epoch`` times per epoch (a DataLoader:
                the samples its sampler yields, each batch collated by its ``collate_fn``).
            metrics_every: N, rounds per metrics window (``History.metrics``; tuning/metrics.py),
                or a ``crossbow_graph.MetricsMonitor``; None: no metrics.
            lr_scheduler: a ``torch.optim.lr_scheduler`` scheduler over ``plan.optimizer``,
                stepped every ``lr_scheduler_interval`` (``"epoch"`` or ``"round"``;
                training/lr_schedule.py); ``History.lr`` has η per round.
            epochs, shuffle, seed, target_accuracy, evals_per_epoch, eval_batch_size, progress,
                hooks, checkpoint_dir, checkpoint_every, resume, log_dir, trace, policies,
                metric_fn, bn_recalibration_batches: the fit's options, as
                ``crossbow_graph.training.options.FitOptions`` documents them (the plan's
                auto-tuner, with ``replicas="auto"``, runs before ``hooks``).

        Returns:
            The History: per epoch training loss, test accuracy, samples/s, training seconds;
            the auto-tuner's decisions (``autotune``); the share of synchronisation time not
            hidden behind learning (``sync_unhidden_share``).

        Raises:
            ValueError: before the first round: an empty dataset or one smaller than a round,
                samples that are not ``(inputs, target)`` pairs or unlike the example inputs,
                labels outside the classes (the first batches are checked), a DataLoader with
                its own sampler, bad options (training/validate.py, docs/reliability.md),
                ``data_on_device`` not "auto"/True/False, or True for data not a TensorDataset,
                ``max_grad_norm`` ≤ 0 or not finite.
            TypeError: ``seed`` not an integer, ``target_accuracy`` or ``max_grad_norm`` not a
                number, ``metric_fn`` not callable.
            TaskError: a task failed (names the task, its device and the round).
            DivergenceError: every replica (of every rank) produced NaN/Inf in the same round.
            CheckpointError: ``resume`` found no readable checkpoint of this model and plan;
                ``checkpoint_dir`` is another fit's (in use, or with ``resume=False`` holding
                another run's checkpoints); a checkpoint cannot be written (a full disk).
            TrainingInterrupted: SIGTERM stopped the fit after a round, with a checkpoint
                (training/signals.py; a SystemExit of code 143).
        """
        tuner = [self.autotuner] if self.autotuner and (self.comm is None or self.comm.is_main) \
            else []
        hooks = tuner + list(as_hooks("hooks", hooks))
        metrics = metrics_every if isinstance(metrics_every, MetricsMonitor) or metrics_every is None \
            else MetricsMonitor(metrics_every)
        options = FitOptions(
            epochs=epochs, shuffle=shuffle, seed=seed, target_accuracy=target_accuracy,
            evals_per_epoch=evals_per_epoch, eval_batch_size=eval_batch_size, progress=progress,
            hooks=hooks, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
            resume=resume, log_dir=log_dir, trace=trace, policies=policies, metrics=metrics,
            lr_scheduler=lr_scheduler, lr_scheduler_interval=lr_scheduler_interval,
            metric_fn=metric_fn, bn_recalibration_batches=bn_recalibration_batches,
            data_on_device=data_on_device, max_grad_norm=max_grad_norm)
        history = Trainer(self, train_dataset, eval_dataset, options).run()
        if self.comm is not None:  # the central model's integer buffers: rank 0's everywhere
            self._int_buffers_from_rank0(replicas=False, round_index=self.rounds_done - 1)
        return history

    def adjust(self, adjustment: Adjustment) -> dict[str, Any]:
        """Change lr, b, α, τ, m or the learner mode (or reset every replica to z) between rounds,
        on every device: the one interface through which the run settings (``settings``) change
        (tuning/policy_base.py ``apply_adjustment``; docs/design-overview.md §5, Run settings).
        Policies, the auto-tuner, ``set_replicas``/``set_learner_mode``, the torchrun agreement
        and checkpoint resumes all call it. A change of b or m re-plans the learners and
        re-checks the memory bound.

        Returns:
            What changed, e.g. ``{"batch_size": 32}``.

        Raises:
            PlanError: the new b or m exceeds the memory budget (nothing changed).
            ValueError: α with k = 1; α or τ ≠ 1 with ``sync=SSGD()``.
        """
        return apply_adjustment(self, adjustment)
