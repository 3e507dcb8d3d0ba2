"""The public entry point: ``compile(model, ...) -> Plan`` and ``Plan.fit`` (docs/design-overview.md §1)."""

from __future__ import annotations

import copy
import pathlib
import warnings
from operator import attrgetter
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .build import (PlanParts, build_parts, check_inputs, resolve_devices, settle_learner_mode,
                    torch_device)
from .compile_options import CompileOptions
from .compiler import inspect as _inspect
from .config import LEARNER_MODES, SGD, Adjustment, LearnerMode
from .engine.comm import Distributed, plan_facts
from .engine.conv_choice import CpuConv
from .engine.optim import OptimizerRows, as_local_optimizer
from .engine.precision import Precision
from .engine.fused import vmap_failure
from .engine.graphs import RoundGraph
from .engine.scheduler import Executor, Scheduler
from .engine.settings import RunSettings, settings_view
from .engine.sync import SMA, SyncAlgorithm
from .engine.state import (DeviceState, FlatLayout, MemoryFormat, channels_last_weights, copy_module,
                           float_buffers_named, trainable_named)
from .errors import is_count
from .fields import options_of
from .kernels.select import KernelBackend, plan_kernels
from .training.batchnorm import BNRecalibration
from .training.checkpoint import load_plan_state_dict, plan_state_dict
from .training.data import collate_of
from .training.evaluation import eval_samples, evaluate_model
from .training.history import History
from .training.hooks import Hook
from .training.options import FitOptions
from .training.progress import FitProgress
from .training.run_setup import RunRecord
from .training.trainer import Trainer
from .tuning.autotune import AutoTune, AutoTuner
from .tuning.metrics import MetricsMonitor
from .tuning.policy_base import apply_adjustment

__all__ = ["compile", "Plan", "resolve_devices"]


def compile(  # noqa: A001 - the public name the design asks for
    model: nn.Module, example_inputs: tuple[Any, ...] | dict[str, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    *, batch_size: int | None = None, devices: int | str | Sequence[str] = 1,
    replicas: int | str = "auto", learner_mode: LearnerMode = "per_replica",
    executor: Executor = "auto",
    autotune: AutoTune | None = None, optimizer: "SGD | torch.optim.Optimizer" = SGD(),
    sync: SyncAlgorithm = SMA(), concrete_args: dict[str, Any] | None = None,
    leaf_modules: Sequence[type[nn.Module]] = (), memory_budget: int | None = None,
    verify: bool = True, kernel_backend: KernelBackend = "auto",
    distributed: Distributed | None = None, precision: Precision = "fp32",
    strict_trace: bool = False, memory_format: MemoryFormat = "auto", cuda_graphs: bool = False,
    cpu_conv: CpuConv = "auto", options: CompileOptions | None = None,
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
        batch_size, devices, replicas, learner_mode, executor, autotune, optimizer, sync,
            concrete_args, leaf_modules, memory_budget, verify, kernel_backend, distributed,
            precision, strict_trace, memory_format, cuda_graphs, cpu_conv: the options, as
            ``CompileOptions`` documents them (defaults, choices: docs/options.md);
            ``batch_size`` (b) is required.
        options: all of them as one ``CompileOptions(...)``, instead of the keywords.

    Returns:
        The Plan.

    Raises:
        TraceError: the example inputs do not run through the model, or (``strict_trace``)
            torch.fx cannot trace it.
        ValueError: a bad argument (batch size, replicas, devices, a value not among an
            option's choices, ``cuda_graphs=True`` without CUDA devices; a model without
            trainable float parameters or with a post-accumulate-grad hook; ``loss_fn=None``
            without a loss; ``"fused"`` for a model vmap cannot run; a meta example input;
            ``options`` and a keyword both given; docs/reliability.md).
        TypeError: ``loss_fn`` not callable or a loss class, a flag not a bool, a tracing
            argument, ``options`` not a CompileOptions.
        ImportError, CompilerError: the Triton or C kernels asked for cannot be built.
        PlanError: the plan is unsound, e.g. the replicas do not fit ``memory_budget``.
        DistributedError: under torchrun, the ranks' plans differ (names the difference).
    """
    keywords = dict(
        batch_size=batch_size, devices=devices, replicas=replicas, learner_mode=learner_mode,
        executor=executor, autotune=autotune, optimizer=optimizer, sync=sync,
        concrete_args=concrete_args, leaf_modules=leaf_modules, memory_budget=memory_budget,
        verify=verify, kernel_backend=kernel_backend, distributed=distributed,
        precision=precision, strict_trace=strict_trace, memory_format=memory_format,
        cuda_graphs=cuda_graphs, cpu_conv=cpu_conv)
    options = options_of(CompileOptions, keywords, options, "compile")
    check_inputs(model, example_inputs, loss_fn, options)
    plan = Plan(model, example_inputs, options, build_parts(model, example_inputs, loss_fn, options))
    plan.kernels  # emits the plan's update kernels now (cached; the scheduler launches these)
    settle_learner_mode(plan, options)
    return plan


class Plan:
    """A compiled SMA training plan: the task graph of one round and the state it runs on.

    Attributes:
        task_graph: ``networkx.DiGraph``; node attribute ``"task"`` holds a Task; it records the
            b and m it was planned for (re-planned when they change).
        model_graph: the traced model (fx GraphModule, shapes, parameter inventory).
        options: the ``CompileOptions`` of ``compile`` (as given: the settings in force, which
            ``adjust`` changes, are ``settings``).
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
        progress: how far it has trained (training/progress.py ``FitProgress``: written by the
            fit loop); ``epochs_done``, ``rounds_done``, ``round_in_epoch``,
            ``position_in_epoch`` and ``train_seconds`` are read-only views of it.
        precision: the learners' precision, ``"fp32"``, ``"bf16"`` or ``"fp16"`` (read-only).
    """

    batch_size = settings_view("batch_size", "b, samples per learner per round (read-only).")
    replicas_per_device = settings_view("replicas_per_device", "m, replicas per device (read-only).")
    learner_mode = settings_view("learner_mode", "'per_replica' or 'fused' (read-only).")
    sync = settings_view("sync", "The sync algorithm with its α and τ (H) in force (read-only).")
    epochs_done = property(attrgetter("progress.epochs_done"), doc="Complete epochs (read-only).")
    rounds_done = property(attrgetter("progress.rounds_done"), doc="Rounds run (read-only).")
    round_in_epoch = property(attrgetter("progress.round_in_epoch"),
                              doc="Rounds done in an unfinished epoch (read-only).")
    position_in_epoch = property(attrgetter("progress.position_in_epoch"),
                                 doc="Samples of the unfinished epoch's order used (read-only).")
    train_seconds = property(attrgetter("progress.train_seconds"),
                             doc="Training seconds of the complete epochs (read-only).")

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The local optimiser as the user gave it (a torch.optim optimizer; for
        ``crossbow_graph.SGD`` a one-group ``torch.optim.SGD`` over the plan's own copy of the
        model): never stepped, its ``param_groups`` hold the settings in force. Build an LR
        scheduler over it (``fit(lr_scheduler=...)``); ``settings.optimizer`` maps its groups
        to the replicas (engine/optim.py)."""
        return self.settings.optimizer.optimizer

    def __init__(self, model: nn.Module, example_inputs: Any, options: CompileOptions,
                 parts: PlanParts) -> None:
        task_graph, comm, ft = parts.task_graph, parts.comm, parts.ft
        self.options = options
        self.model_graph = parts.model_graph
        self.task_graph = task_graph
        self.loss_fn = parts.loss_fn
        self._template = copy_module(model).train()  # with its parameters' gradient hooks
        self._params = FlatLayout.of(trainable_named(self._template), channels_last_weights(
            self._template, options.memory_format,
            {torch_device(d).type for d in task_graph.graph["devices"]}, example_inputs))
        self._buffers = FlatLayout.of(float_buffers_named(self._template))
        local = as_local_optimizer(options.optimizer, model, self._template,
                                   [name for name, *_ in self._params.entries])
        sync = options.sync
        sync.check_optimizer(local)  # ValueError: e.g. SSGD with AdamW
        self.settings = RunSettings(optimizer=local, sync=sync, batch_size=options.batch_size,
                                    replicas_per_device=int(task_graph.graph["replicas_per_device"]),
                                    learner_mode=options.learner_mode)
        self.states = [
            DeviceState(name, torch_device(name), self._template, self.replicas_per_device,
                        self._params, self._buffers, precision=options.precision)
            for name in self.devices
        ]
        if not local.kernel:
            for s in self.states:
                s.optim_rows = OptimizerRows(local, s)
        self._central = copy.deepcopy(self._template).to(self.states[0].torch_device).eval()
        self._central_buf = self.states[0].zbuf.clone()  # [Q] the evaluated central model's buffers
        self.states[0].bind_central(self._central, self._central_buf)
        self.bn_recalibration = BNRecalibration(self._central)  # set by every fit
        self.scheduler = Scheduler(
            task_graph, self.states, self.loss_fn, self.settings,
            executor="inline" if ft is not None and options.executor == "auto" else options.executor,
            kernels=parts.kernels, comm=comm, cpu_conv=options.cpu_conv,
            round_graph=RoundGraph() if options.cuda_graphs else None, ft=ft)
        self.memory_budget = parts.memory_budget
        self.autotuner = AutoTuner(options.autotune or AutoTune()) if options.tuned else None
        self.comm = comm  # under torchrun: this rank's place in the process group (engine/comm.py)
        self._example_inputs = tree_map(  # fused_failure's dry run
            lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, example_inputs)
        self._fused_failure: tuple[str | None] | None = None  # (failure,) once probed
        if comm is not None:
            comm.agree(plan_facts(self), "the plan")
            self._start_from_rank0()
            self._int_buffers_from_rank0(replicas=True)
        self.progress = FitProgress()  # epochs, rounds, seconds: written by the fit loop
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
        return self.options.verify

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
        if self.scheduler.ft is not None:
            text += "\n" + self.scheduler.ft.describe()
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
        max_grad_norm: float | None = None, options: FitOptions | None = None,
    ) -> History:
        """Train with SMA for ``epochs`` epochs (continuing from the plan's current state).

        Each of the k learners draws its own disjoint batch of b samples per round from one
        seeded order per epoch; a last partial round is dropped.

        Args:
            train_dataset: a torch Dataset of ``(inputs, target)`` samples (or of dicts of keyword
                inputs whose ``"labels"`` are the target, engine/inputs.py), or a DataLoader: its
                ``collate_fn`` gets each learner's b samples, its workers load the rounds ahead;
                the plan still picks the samples (docs/runtime.md, Your DataLoader).
            eval_dataset: evaluated with z ``evals_per_epoch`` times per epoch (a DataLoader:
                the samples its sampler yields, each batch collated by its ``collate_fn``).
            epochs, shuffle, seed, target_accuracy, evals_per_epoch, eval_batch_size, progress,
                hooks, checkpoint_dir, checkpoint_every, resume, log_dir, trace, policies,
                metrics_every, lr_scheduler, lr_scheduler_interval, metric_fn,
                bn_recalibration_batches, data_on_device, max_grad_norm: the fit's options, as
                ``FitOptions`` documents them (defaults, choices: docs/options.md); the plan's
                auto-tuner, with ``replicas="auto"``, runs before ``hooks``.
            options: all of them as one ``FitOptions(...)``, instead of the keywords.

        Returns:
            The History: per epoch training loss, test accuracy, samples/s, training seconds;
            the auto-tuner's decisions (``autotune``); the share of synchronisation time not
            hidden behind learning (``sync_unhidden_share``).

        Raises:
            ValueError: before the first round: an empty dataset or one smaller than a round,
                samples that are not ``(inputs, target)`` pairs or unlike the example inputs,
                labels outside the classes (the first batches are checked), a DataLoader with
                its own sampler, bad options (``FitOptions``, training/validate.py,
                docs/reliability.md), ``data_on_device=True`` for data not a TensorDataset,
                ``options`` and a keyword both given.
            TypeError: an option of the wrong type (``FitOptions``), ``options`` not a FitOptions.
            TaskError: a task failed (names the task, its device and the round).
            DivergenceError: every replica (of every rank) produced NaN/Inf in the same round.
            CheckpointError: ``resume`` found no readable checkpoint of this model and plan;
                ``checkpoint_dir`` is another fit's (in use, or with ``resume=False`` holding
                another run's checkpoints); a checkpoint cannot be written (a full disk).
            TrainingInterrupted: SIGTERM stopped the fit after a round, with a checkpoint
                (training/signals.py; a SystemExit of code 143).
        """
        keywords = dict(
            epochs=epochs, shuffle=shuffle, seed=seed, target_accuracy=target_accuracy,
            evals_per_epoch=evals_per_epoch, eval_batch_size=eval_batch_size, progress=progress,
            hooks=hooks, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
            resume=resume, log_dir=log_dir, trace=trace, policies=policies,
            metrics_every=metrics_every, lr_scheduler=lr_scheduler,
            lr_scheduler_interval=lr_scheduler_interval, metric_fn=metric_fn,
            bn_recalibration_batches=bn_recalibration_batches, data_on_device=data_on_device,
            max_grad_norm=max_grad_norm)
        options = options_of(FitOptions, keywords, options, "fit")
        tuner = [self.autotuner] if self.autotuner and (self.comm is None or self.comm.is_main) \
            else []
        every = options.metrics_every
        metrics = every if isinstance(every, MetricsMonitor) or every is None else MetricsMonitor(every)
        history = Trainer(self, train_dataset, eval_dataset, options, hooks=tuner + list(options.hooks),
                          metrics=metrics).run()
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
