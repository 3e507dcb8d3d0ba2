"""``compile``'s building around the Plan (docs/design-overview.md §1): the checks of the model,
its example inputs and loss (``check_inputs``); the devices, torchrun's process group, the update
kernels, the traced model and the task graph (``build_parts``); the learner mode of the built
plan (``settle_learner_mode``); the plan's replicas (``build_states``)."""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

import networkx as nx
import torch
from torch import nn

from .compile_options import CompileOptions
from .compiler.analysis import estimate_memory
from .compiler.arguments import check_trace_arguments
from .compiler.fingerprint import computation_fingerprint
from .compiler.outputs import model_loss
from .compiler.passes import build_task_graph
from .compiler.trace import ModelGraph, trace_model
from .config import Adjustment
from .engine.backends.graphs.capture import cuda_graphs_refusal
from .engine.data.inputs import CallFlags
from .engine.learning.fused import fused_mode_message
from .engine.settings import RunSettings
from .engine.state.flat import (DeviceState, FlatLayout, channels_last_weights, check_grad_hooks,
                                copy_module, float_buffers_named, model_dtype, trainable_named)
from .engine.state.optim import OptimizerRows, as_local_optimizer
from .engine.state.precision import check_precision
from .engine.transport.comm import Comm, Distributed
from .engine.transport.ft import FaultTolerantSync, check_fault_tolerant
from .engine.transport.transports import Transport, choose_transport
from .errors import PlanError
from .kernels.protocol import SMAKernels
from .kernels.select import select_backend
from .training.central import start_from_rank0

if TYPE_CHECKING:
    from .training.fit_plan import FitPlan

__all__ = ["PlanParts", "check_inputs", "build_parts", "build_states", "loss_inputs_hint",
           "settle_learner_mode", "plan_facts", "join_plan",
           "resolve_devices",
           "devices_and_comm", "cuda_memory_budget", "check_host_memory", "host_memory_bytes",
           "torch_device"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanParts:
    """What ``build_parts`` makes for a Plan from the model and the options."""

    model_graph: ModelGraph  # the traced (or measured) model
    task_graph: nx.DiGraph  # one round's tasks for the devices, m and b of the options
    loss_fn: Callable  # the user's loss, or the model's own (compiler/outputs.py model_loss)
    kernels: SMAKernels  # the SMA update kernels' backend
    comm: Comm | None  # under torchrun: this rank's place in the process group
    ft: FaultTolerantSync | None  # Distributed(fault_tolerant=True): this torchft replica group
    transport: Transport  # how the global sync's sums cross devices and processes, chosen once
    executor: str  # the executor option in force ("auto" is "inline" under torchft)
    memory_budget: int | None  # bytes per device: the option's, or a GPU's free memory


def check_inputs(model: nn.Module, example_inputs: Any, loss_fn: Any,
                 options: CompileOptions) -> None:
    """``compile``'s checks, before any tracing, of what is not an option: ``loss_fn``, the model
    (``check_model``), the tracing arguments and the precision against the model's dtype.

    Raises:
        TypeError, ValueError: as ``compile`` documents them."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, target), or None (the "
                        f"model's own output.loss), got {type(loss_fn).__name__}")
    if isinstance(loss_fn, type):  # the class itself is callable too: loss_fn(output, target) builds one
        prefix = "nn." if loss_fn.__module__.startswith("torch.nn") else ""
        raise TypeError(f"loss_fn={prefix}{loss_fn.__name__} is a class, not a loss: pass an "
                        f"instance: {prefix}{loss_fn.__name__}()")
    check_model(model)
    check_trace_arguments(model, example_inputs, options.concrete_args, options.leaf_modules)
    check_precision(options.precision, model_dtype(trainable_named(model)))


def build_parts(model: nn.Module, example_inputs: Any, loss_fn: Callable | None,
                options: CompileOptions) -> PlanParts:
    """``compile`` after its checks: the devices and torchrun's process group, the update
    kernels' backend, the traced model and the task graph.

    Raises:
        TraceError, ValueError, ImportError, CompilerError, PlanError, DistributedError: as
            ``compile`` documents them."""
    fault_tolerant = options.distributed is not None and options.distributed.fault_tolerant
    if fault_tolerant and options.cuda_graphs:
        raise ValueError("Distributed(fault_tolerant=True) with cuda_graphs=True: a replica "
                         "group's global sync runs torchft's quorum and all-reduce on the host "
                         "every round, which a CUDA graph cannot hold; leave cuda_graphs=False "
                         "(the rounds run on CUDA streams)")
    if fault_tolerant:  # the group's learners: every rank's when torchrun started several
        learners = None if options.tuned else options.replicas * len(
            resolve_devices(options.devices)) * int(os.environ.get("WORLD_SIZE", "1") or 1)
        check_fault_tolerant(options.sync, options.executor, learners)
    names, comm = devices_and_comm(options.devices, options.distributed)
    # after torchrun's process group: the Managers of a group of several ranks meet in its store;
    # ImportError without torchft
    ft = FaultTolerantSync(options.distributed, names[0], comm) if fault_tolerant else None
    if options.cuda_graphs and (refusal := cuda_graphs_refusal(names)):
        raise ValueError(refusal)
    kernels = select_backend(options.kernel_backend, "cuda" if names[0].startswith("cuda") else "cpu",
                             model_dtype(trainable_named(model)))
    model_graph = trace_model(model, example_inputs, concrete_args=options.concrete_args,
                              leaf_modules=options.leaf_modules, strict=options.strict_trace)
    check_batch_norm(model_graph, options.batch_size)
    if loss_fn is None and not model_graph.output_has_loss:
        raise ValueError(f"loss_fn=None trains on the loss {model_graph.name} computes itself "
                         "(output.loss or output['loss']), but its output on the example inputs "
                         f"has none: {loss_inputs_hint(model)}, or pass a loss_fn(output, target)")
    memory_budget = options.memory_budget
    m = 1 if options.tuned else options.replicas
    if memory_budget is None and names[0].startswith("cuda"):
        memory_budget = cuda_memory_budget(names)
    elif memory_budget is None:
        check_host_memory(model_graph, names, m, options.batch_size, host_memory_bytes())
    graph = build_task_graph(model_graph, devices=names, replicas_per_device=m,
                             batch_size=options.batch_size, memory_budget_bytes=memory_budget,
                             verify=options.verify)
    if comm is not None and not options.sync.across_processes:
        raise ValueError(f"sync={type(options.sync).__name__}() runs in one process (its global "
                         "step is not summed across torchrun ranks); use SMA, DiLoCo or LocalSGD "
                         "under torchrun")
    transport = choose_transport(on_cpu=names[0].startswith("cpu"), comm=comm, ft=ft)
    return PlanParts(model_graph=model_graph, task_graph=graph,
                     loss_fn=model_loss if loss_fn is None else loss_fn, kernels=kernels,
                     comm=comm, ft=ft, transport=transport, memory_budget=memory_budget,
                     executor="inline" if ft is not None and options.executor == "auto"
                     else options.executor)


def join_plan(plan: "FitPlan", parts: PlanParts) -> None:
    """A built plan joins the other processes: every torchft replica group of a quorum must be
    compiled with the same hyper-parameters (``FaultTolerantSync.expect``); under torchrun the
    ranks agree on the plan (``plan_facts``; DistributedError) and start from rank 0's replicas,
    z and integer buffers."""
    if parts.ft is not None:
        parts.ft.expect(plan.settings.optimizer.describe(), plan.settings.batch_size)
    if parts.comm is not None:
        parts.comm.agree(plan_facts(plan), "the plan")
        start_from_rank0(plan.states, parts.comm)
        plan.central.int_buffers_from_rank0(replicas=True)


def loss_inputs_hint(model: nn.Module) -> str:
    """What to put among the example inputs for ``model`` to compute its own loss, read from its
    forward's parameters: ``return_loss=True`` (a flag every forward then gets, as CLIP takes
    it), or the labels (a HuggingFace model with a head)."""
    try:
        names = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        names = {}
    if "return_loss" in names:
        return (f"{type(model).__name__}.forward computes its loss with return_loss=True: put "
                "it among the example inputs, e.g. {'input_ids': ids, 'pixel_values': pixels, "
                "'return_loss': True} (a bool or number there is a flag every forward gets)")
    if "labels" in names or not names:
        return ("put the labels among the example inputs, e.g. {'input_ids': ids, 'labels': "
                "labels}")
    return (f"give the inputs its loss needs among the example inputs (its forward takes "
            f"{', '.join(names)})")


def build_states(model: nn.Module, example_inputs: Any, options: CompileOptions,
                 task_graph: nx.DiGraph) -> tuple[nn.Module, FlatLayout, RunSettings, list[DeviceState]]:
    """The template (a copy of ``model`` in training mode, with its gradient hooks), the flat
    layout of its trainable parameters ``[P]``, the run settings and one DeviceState per device.

    Raises:
        ValueError: the sync algorithm does not accept the optimizer (e.g. SSGD with AdamW)."""
    devices = list(task_graph.graph["devices"])
    template = copy_module(model).train()
    params = FlatLayout.of(trainable_named(template), channels_last_weights(
        template, options.memory_format, {torch_device(d).type for d in devices}, example_inputs))
    buffers = FlatLayout.of(float_buffers_named(template))
    local = as_local_optimizer(options.optimizer, model, template,
                               [name for name, *_ in params.entries])
    options.sync.check_optimizer(local)
    settings = RunSettings(optimizer=local, sync=options.sync, batch_size=options.batch_size,
                           replicas_per_device=int(task_graph.graph["replicas_per_device"]),
                           learner_mode=options.learner_mode)
    flags = CallFlags.of(model, example_inputs)
    states = [DeviceState(name, torch_device(name), template, settings.replicas_per_device,
                          params, buffers, precision=options.precision, call_flags=flags)
              for name in devices]
    if not local.kernel:
        for s in states:
            s.optim_rows = OptimizerRows(local, s, options.sync.shares_second_moment)
    return template, params, settings, states


def settle_learner_mode(plan: "FitPlan", options: CompileOptions) -> None:
    """With ``learner_mode="fused"`` for a model vmap cannot run (``Plan.fused_failure``):
    ValueError, or with ``replicas="auto"`` a warning (to ``compile``'s caller) and the plan
    switched to ``"per_replica"``."""
    if options.learner_mode == "fused" and plan.fused_failure is not None:
        message = fused_mode_message(type(plan.template).__name__, plan.fused_failure)
        if not options.tuned:
            raise ValueError(message)
        warnings.warn(f"{message}; replicas='auto' starts with per_replica", stacklevel=3)
        plan.adjust(Adjustment(learner_mode="per_replica"))


def resolve_devices(devices: int | str | Sequence[str]) -> list[str]:
    """Device names for ``devices``.

    ``"auto"``: every CUDA GPU (``cuda:0`` …), else one CPU device. An int G: G devices — GPUs
    when that many exist, else G logical CPU devices ``cpu:0 … cpu:G−1``. A list: those names.

    Raises:
        ValueError: G < 1, an empty list, an unknown name, or a CUDA device that does not exist."""
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
    if not names:
        raise ValueError(f"devices={devices!r} names no device; use devices=1 (the CPU, or a GPU "
                         "when there is one), 'auto', or a list of names such as ['cpu:0'] or "
                         "['cuda:0', 'cuda:1']")
    for name in names:
        kind, _, idx = str(name).partition(":")
        if kind not in ("cpu", "cuda") or (idx and not idx.isdigit()):
            raise ValueError(f"device '{name}': use 'cpu:N' (a logical CPU device) or 'cuda:N'")
        if kind == "cuda" and int(idx or 0) >= n_cuda:
            raise ValueError(f"device '{name}' does not exist: this machine has {n_cuda} CUDA GPUs")
    if len(set(names)) != len(names):
        raise ValueError(f"devices {names} name a device twice")
    return names


def torch_device(name: str) -> torch.device:
    """The torch device of a plan's device name: ``cpu:N`` (a logical CPU device) is the CPU."""
    return torch.device("cpu") if name.startswith("cpu") else torch.device(name)


def check_model(model: nn.Module) -> None:
    """TypeError unless ``model`` is an nn.Module; ValueError unless it has trainable
    floating-point parameters, none on the meta device (nor a buffer) and no
    post-accumulate-grad hook (``check_grad_hooks``)."""
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


def check_batch_norm(model_graph: ModelGraph, batch_size: int) -> None:
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


def cuda_memory_budget(names: Sequence[str]) -> int:
    """Bytes the plan may use per GPU: the smallest over ``names`` of what the device has free
    (``torch.cuda.mem_get_info``) plus what this process's caching allocator already reserved
    there (reusable), so that other processes' memory and the CUDA context are left out."""
    budgets = []
    for name in names:
        device = torch_device(name)
        free, _total = torch.cuda.mem_get_info(device)
        budgets.append(int(free) + int(torch.cuda.memory_reserved(device)))
    return min(budgets)


def host_memory_bytes() -> int | None:
    """Bytes this process can still take on the host: ``MemAvailable`` of /proc/meminfo (else
    the available pages), bounded by a cgroup v2 limit (``memory.max − memory.current``, a
    container's); None where neither can be read."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            left = max(0, int(limit) - used)
            available = left if available is None else min(available, left)
    except (OSError, ValueError):
        pass
    return available


def check_host_memory(model_graph: ModelGraph, names: Sequence[str], replicas_per_device: int,
                      batch_size: int, available: int | None) -> None:
    """CPU devices without a ``memory_budget``: PlanError when the replicas' state (every
    learner's parameters, gradients, optimizer rows and buffers, and the device's flat z, z_prev,
    acc and zbuf; docs/compiler.md §3) with one learner's activations and workspace per device
    exceeds the host's ``available`` bytes (None: unknown, no check), before any replica is
    built. The logical CPU devices share the host. The message gives the arithmetic and the
    largest m that fits: m·own + shared + step ≤ available / G."""
    if available is None:
        return
    m, mib, per_device = replicas_per_device, 2**20, available // len(names)
    est = estimate_memory(model_graph.analysis, batch_size, m)
    own = est.params + est.grads + est.optimizer + est.buffers  # each learner's rows
    shared = est.flat_share * m  # the device's z, z_prev, acc, zbuf
    step = est.activations + est.workspace  # one learner's forward and backward at a time
    need = m * own + shared + step
    if need <= per_device:
        return
    fit = max(0, (per_device - shared - step) // own) if own else 0
    devices = f"{len(names)} CPU devices, each " if len(names) > 1 else ""
    advice = (f"at most {fit:,} replicas per device fit: lower replicas to {fit:,} or fewer"
              if fit else "not even one replica fits: use a smaller model or batch size")
    parts = " + ".join(f"{name} {value / mib:.3g}" for name, value in (
        ("params", est.params), ("grads", est.grads), ("optimizer", est.optimizer),
        ("buffers", est.buffers)) if value >= mib / 1000)
    raise PlanError(
        f"replicas={m:,}: {devices}{m:,} replicas × {own / mib:.3g} MiB of state per learner "
        f"({parts} MiB) + {shared / mib:.3g} MiB of the device's central model + {step / mib:.3g} "
        f"MiB for one learner's step at batch {batch_size} = {need / mib:,.0f} MiB, more than the "
        f"{per_device / mib:,.0f} MiB this machine has available{' per device' if devices else ''}"
        f"; {advice} (or bound it yourself with memory_budget=)")


def devices_and_comm(devices: int | str | Sequence[str],
                     distributed: Distributed | None) -> tuple[list[str], Comm | None]:
    """The device names (``resolve_devices``) and, under torchrun, this rank's Comm. On GPUs
    under torchrun the ranks of a machine take disjoint GPUs (NCCL refuses two ranks on one):
    with ``devices="auto"`` local rank r takes ``cuda:r``; with a count G, ``cuda:r·G`` …
    ``cuda:r·G+G−1``; a list of names is taken as given.

    Raises:
        ValueError: a count G whose GPUs for this local rank do not exist on the machine."""
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


def plan_facts(plan: "FitPlan") -> dict[str, Any]:
    """What every rank's plan must share: the model's fingerprint (parameter and buffer names,
    shapes, dtypes), the computation's (compiler/fingerprint.py: the modules, the traced forward,
    the loss function), devices per process, replicas, batch size, optimiser and SMA settings, the
    learners' precision, the flat rows' layout (which weights lie channels-last)."""
    template = plan.template
    model = [(n, tuple(p.shape), str(p.dtype)) for n, p in template.named_parameters()]
    model += [(n, tuple(b.shape), str(b.dtype)) for n, b in template.named_buffers()]
    return {
        "model": (type(template).__name__, model),
        "computation": computation_fingerprint(template, plan.model_graph.module, plan.loss_fn),
        "devices per process": len(plan.devices),
        "replicas per device": ("auto" if plan.autotuner is not None
                                else plan.settings.replicas_per_device),
        "batch_size": plan.settings.batch_size,
        "optimizer": plan.settings.optimizer.describe(),
        "sync": plan.settings.sync.describe(plan.rounds.sync_state),
        "precision": plan.states[0].precision,
        "channels-last weights": sorted(plan.states[0].params.channels_last),  # the rows' layout
        "sync dtype": plan.comm.settings.sync_dtype if plan.comm is not None else "fp32",
    }
