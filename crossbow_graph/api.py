"""The public entry point: ``compile(model, ...) -> Plan`` and ``Plan.fit`` (docs/design-overview.md §1)."""

from __future__ import annotations

import functools
from operator import attrgetter
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .build import (PlanParts, build_parts, build_states, check_inputs, join_plan, resolve_devices,
                    settle_learner_mode)
from .compile_options import CompileOptions
from .compiler import inspect as _inspect
from .compiler.passes import build_task_graph
from .config import SGD, Adjustment, LearnerMode
from .engine.adjust import apply_adjustment
from .engine.backends.graphs.capture import RoundGraph
from .engine.backends.process.conv_choice import CpuConv
from .engine.executors import Executor
from .engine.learning.fused import FusedProbe
from .engine.scheduler import Scheduler
from .engine.settings import settings_view
from .engine.state.flat import MemoryFormat
from .engine.state.precision import Precision
from .engine.sync import SMA, SyncAlgorithm
from .engine.transport.comm import Distributed
from .fields import options_of
from .kernels.select import KernelBackend, plan_kernels
from .training.central import CentralModel
from .training.checkpoint import load_plan_state_dict, plan_state_dict
from .training.history import History
from .training.hooks import Hook
from .training.options import FitOptions
from .training.progress import FitProgress
from .training.run_record import RunRecord
from .training.trainer import Trainer
from .training.user_model import UserModel
from .tuning.autotune import AutoTune, AutoTuner
from .tuning.metrics import MetricsMonitor

__all__ = ["compile", "Plan", "resolve_devices", "plan_settings", "plan_summary"]


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
    """Trace ``model`` and compile it into a runnable, inspectable plan of SMA training on
    k = G·m replicas (docs/api.md, compile; docs/design-overview.md §2); ``model`` is not modified.

    Args:
        model: the ``nn.Module`` to train (floating-point parameters).
        example_inputs: one batch: a tuple of positional inputs (``(x,)``, ``x [N, ...]``) or a
            dict of keyword inputs.
        loss_fn: ``loss_fn(output, target) -> scalar`` (batch mean), or None: the model's own loss.
        the other keywords: the options (``CompileOptions``, docs/options.md; ``batch_size``
            is required), or all of them as one ``options=CompileOptions(...)``.

    Raises:
        TraceError: the example inputs do not run, or (``strict_trace``) torch.fx cannot trace.
        ValueError, TypeError: a bad argument (docs/api.md, compile; docs/reliability.md).
        ImportError, CompilerError: the Triton or C kernels asked for cannot be built.
        PlanError: the plan is unsound, e.g. the replicas do not fit ``memory_budget``.
        DistributedError: under torchrun, the ranks' plans differ."""
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


class Plan(_inspect.Inspectable):
    """A compiled SMA training plan: the task graph of one round and the state it runs on
    (docs/api.md, The Plan).

    Attributes:
        model_graph: the traced model (fx GraphModule, shapes, parameter inventory).
        options: ``compile``'s CompileOptions, as given.
        settings: the run settings in force (engine/settings.py ``RunSettings``), changed only
            through ``adjust``; ``batch_size``, ``replicas_per_device``, ``learner_mode`` and
            ``sync`` are read-only views of it.
        states: one DeviceState per device (engine/state/flat.py).
        rounds: the engine that runs the rounds (engine/scheduler.py ``Scheduler``).
        central: the evaluated central model (training/central.py ``CentralModel``).
        user_model: the module given to ``compile``, held weakly (training/user_model.py).
        memory_budget: bytes per device for learners (None: unbounded).
        autotuner: the AutoTuner hook that ``fit`` runs (``replicas="auto"``), else None.
        comm: under torchrun this rank's place in the process group, else None.
        progress: how far it has trained (training/progress.py ``FitProgress``);
            ``epochs_done``, ``rounds_done``, ``round_in_epoch``, ``position_in_epoch`` and
            ``train_seconds`` are read-only views of it.
        run_record: its set-up and checkpoints (training/run_record.py)."""

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
    bn_recalibration = property(attrgetter("central.recalibration"),
                                doc="z's BatchNorm re-estimation (training/batchnorm.py).")
    last_eval_extras = property(attrgetter("central.last_eval_extras"),
                                doc="The last ``evaluate``'s other loss entries.")
    task_graph = property(attrgetter("rounds.task_graph"), doc=(
        "``networkx.DiGraph`` of one round (node attribute ``\"task\"``: a Task; read-only)."))
    optimizer = property(attrgetter("settings.optimizer.optimizer"), doc=(
        "The local optimiser as given (never stepped; its ``param_groups`` hold the settings in "
        "force; docs/optimizers.md)."))
    template = property(attrgetter("_template"), doc=(
        "The module every replica is cloned from (training mode, never trained; read-only)."))
    num_parameters = property(attrgetter("_params.size"),
                              doc="P, trainable scalars per replica (tied parameters once).")
    verify = property(attrgetter("options.verify"), doc=(
        "Whether the verifier runs between the compiler passes, also when ``adjust`` re-plans."))

    fused_failure = property(attrgetter("_fused_probe.failure"), doc=(
        "Why ``learner_mode=\"fused\"`` cannot run this model (torch.func.vmap's error in a dry "
        "run, engine/learning/fused.py ``FusedProbe``), or None; probed once (docs/runtime.md)."))

    def __init__(self, model: nn.Module, example_inputs: Any, options: CompileOptions,
                 parts: PlanParts) -> None:
        self.options, self.model_graph, self.loss_fn = options, parts.model_graph, parts.loss_fn
        self._template, self._params, self.settings, self.states = build_states(
            model, example_inputs, options, parts.task_graph)
        self.central = CentralModel(self, self._params)
        self.user_model = UserModel(model, self._template)  # holds z after every fit
        self.rounds = Scheduler(
            parts.task_graph, self.states, self.loss_fn, self.settings, executor=parts.executor,
            kernels=parts.kernels, transport=parts.transport, comm=parts.comm,
            cpu_conv=options.cpu_conv, round_graph=RoundGraph() if options.cuda_graphs else None)
        self.memory_budget = parts.memory_budget
        self.autotuner = AutoTuner(options.autotune or AutoTune()) if options.tuned else None
        self.comm = parts.comm
        self._fused_probe = FusedProbe(self._template, example_inputs)
        self.progress = FitProgress()
        self.run_record = RunRecord()
        join_plan(self, parts)  # torchrun: the ranks agree and start from rank 0's state

    # -- shape of the plan ------------------------------------------------------------------

    @property
    def precision(self) -> str:
        """The learners' precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (engine/state/precision.py)."""
        return self.states[0].precision

    @property
    def num_learners(self) -> int:
        """k = G·m, over every process under torchrun."""
        return len(self.devices) * self.replicas_per_device * (self.comm.world_size if self.comm else 1)

    @property
    def max_replicas_per_device(self) -> int | None:
        """``memory_budget // memory_per_learner_bytes``, at least 1 (None: unbounded)."""
        mem = self.task_graph.graph.get("memory_per_learner_bytes")
        if self.memory_budget is None or not mem:
            return None
        return max(1, self.memory_budget // mem)

    @property
    def kernels(self) -> list:
        """The SMA update kernels this plan runs, one per specialisation (docs/kernels.md); with
        ``cuda_graphs=True`` those of its graph rounds (hyper-parameters in device tensors)."""
        return plan_kernels(self.rounds.kernels, self.states,
                            self.settings.update_facts(self.num_learners),
                            graphs=self.rounds.executors.round_graph is not None)

    # -- inspection (compiler/inspect.py ``Inspectable``; docs/compiler.md §5) ----------------

    def inspected_settings(self) -> dict[str, Any]:
        return plan_settings(self)

    def summary(self) -> str:
        """A table per device: replicas, tasks, GFLOP per round, memory (MiB); then the totals."""
        return plan_summary(self)

    @staticmethod
    def from_json(text: str) -> "_inspect.PlanView":
        """``to_json``'s output as an inspectable PlanView (``fit`` raises PlanError).

        Raises:
            ValueError: not a plan document. PlanError: the task graph fails the verifier."""
        return _inspect.from_json(text)

    # -- checkpoints (training/checkpoint.py; docs/reliability.md, Checkpoints) ----------------

    def state_dict(self) -> dict[str, Any]:
        """The training state as CPU tensors and plain values."""
        return plan_state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` in place.

        Raises:
            CheckpointError: the state is of another model or of a plan with other devices,
                replicas or parameters (the message names the first difference)."""
        load_plan_state_dict(self, state)

    # -- the central average model (training/central.py; docs/design-overview.md §2) -----------

    def central_weights(self, device: int = 0) -> torch.Tensor:
        """A copy of device ``device``'s z, ``[P]``, in ``named_parameters()`` order; float64 for
        a float64 model, else float32."""
        return self.central.weights(device)

    def replica_weights(self) -> torch.Tensor:
        """A copy of every replica's parameters, ``[k, P]``, device-major (j = d·m + r)."""
        return self.central.replica_weights()

    def central_forward(self, *args: Any, **kwargs: Any) -> Any:
        """z in evaluation mode on ``args`` (tensors moved to device 0) and ``kwargs``, with the
        buffers of ``central_model()``; gradients tracked unless disabled."""
        return self.central.forward(*args, **kwargs)

    def central_model(self) -> nn.Module:
        """z as a new ``nn.Module`` of the input model's class with its state_dict keys
        (evaluation mode; buffers: docs/api.md, The central model)."""
        return self.central.copy()

    def evaluate(self, dataset: Any, *, batch_size: int = 1000,
                 metric_fn: Callable[[Any, Any], Any] | None = None) -> tuple[float | None, float]:
        """(accuracy, mean loss) of z on ``dataset`` (a Dataset or DataLoader, checked as
        ``fit(eval_dataset=)``: ValueError, TypeError); accuracy is ``metric_fn``'s mean, else the
        class accuracy, else None with a UserWarning once (training/evaluation.py; docs/api.md)."""
        return self.central.evaluate(dataset, batch_size=batch_size, metric_fn=metric_fn)

    # -- training -----------------------------------------------------------------------------

    def fit(
        self, train_dataset: Any, epochs: int = 1, *, eval_dataset: Any = None,
        shuffle: bool | None = None, seed: int = 0, target_accuracy: float | None = None,
        target_loss: float | None = None, evals_per_epoch: int = 1, eval_batch_size: int = 1000, progress: bool = True,
        hooks: Sequence[Hook] = (), checkpoint_dir: str | None = None,
        checkpoint_every: int | None = None, resume: bool = False, log_dir: str | None = None,
        trace: str | None = None, policies: Sequence[Hook] = (),
        metrics_every: "int | MetricsMonitor | None" = 50, lr_scheduler: Any = None,
        lr_scheduler_interval: str = "epoch", metric_fn: Callable[[Any, Any], Any] | None = None,
        bn_recalibration_batches: int = 20, data_on_device: bool | str = "auto",
        max_grad_norm: float | None = None, cpu_threads: int | str | None = "auto",
        options: FitOptions | None = None,
    ) -> History:
        """Train with SMA for ``epochs`` epochs, continuing from the plan's state (docs/api.md, fit).

        Args:
            train_dataset: a Dataset of ``(inputs, target)`` samples (or of dicts of keyword
                inputs with ``"labels"``), or a DataLoader (docs/runtime.md, Your DataLoader).
            eval_dataset: evaluated with z ``evals_per_epoch`` times per epoch, or None.
            the other keywords: the fit's options, as ``FitOptions`` documents them
                (docs/options.md); ``options``: all of them as one ``FitOptions``.

        Returns:
            The History (training/history.py).

        Raises:
            ValueError: before the first round: bad data or options (docs/reliability.md).
            TypeError: an option of the wrong type, ``options`` not a FitOptions.
            TaskError: a task failed (names the task, its device and the round).
            DivergenceError: every replica produced NaN/Inf in the same round.
            CheckpointError: no checkpoint to resume, another fit's ``checkpoint_dir``, a
                checkpoint that cannot be written.
            TrainingInterrupted: SIGTERM stopped the fit after a round (training/signals.py)."""
        keywords = dict(
            epochs=epochs, shuffle=shuffle, seed=seed, target_accuracy=target_accuracy,
            target_loss=target_loss, evals_per_epoch=evals_per_epoch, eval_batch_size=eval_batch_size, progress=progress,
            hooks=hooks, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
            resume=resume, log_dir=log_dir, trace=trace, policies=policies,
            metrics_every=metrics_every, lr_scheduler=lr_scheduler,
            lr_scheduler_interval=lr_scheduler_interval, metric_fn=metric_fn,
            bn_recalibration_batches=bn_recalibration_batches, data_on_device=data_on_device,
            max_grad_norm=max_grad_norm, cpu_threads=cpu_threads)
        options = options_of(FitOptions, keywords, options, "fit")
        tuner = [self.autotuner] if self.autotuner and (self.comm is None or self.comm.is_main) \
            else []
        every = options.metrics_every
        metrics = every if isinstance(every, MetricsMonitor) or every is None else MetricsMonitor(every)
        trainer = Trainer(self, train_dataset, eval_dataset, options,
                          hooks=tuner + list(options.hooks), metrics=metrics)
        return self.user_model.around_fit(  # docs/api.md, Your model after a fit
            self.central, trainer.run, comm=self.comm, last_round=lambda: self.rounds_done - 1)

    def adjust(self, adjustment: Adjustment) -> dict[str, Any]:
        """Change lr, b, α, τ, m or the learner mode (or reset every replica to z) between
        rounds: the one interface through which ``settings`` change (engine/adjust.py;
        docs/design-overview.md §5, Run settings). Returns what changed, e.g.
        ``{"batch_size": 32}``.

        Raises:
            PlanError: the new b or m exceeds the memory budget (nothing changed).
            ValueError: α with k = 1; α or τ ≠ 1 with ``sync=SSGD()``."""
        replan = functools.partial(build_task_graph, self.model_graph, devices=self.devices,
                                   memory_budget_bytes=self.memory_budget, verify=self.verify)
        return apply_adjustment(self.rounds, adjustment,
                                replan=lambda b, m: replan(replicas_per_device=m, batch_size=b),
                                fused_failure=lambda: self.fused_failure,
                                model_name=type(self._template).__name__)

    def set_replicas(self, replicas_per_device: int) -> None:
        """``adjust(Adjustment(replicas_per_device=m))`` (docs/runtime.md, Changing m).

        Raises:
            ValueError: m not an integer ≥ 1. PlanError: m replicas exceed the memory budget."""
        self.adjust(Adjustment(replicas_per_device=replicas_per_device))

    def set_learner_mode(self, mode: str) -> None:
        """``adjust(Adjustment(learner_mode=mode))``, from the next round on.

        Raises:
            ValueError: an unknown mode."""
        self.adjust(Adjustment(learner_mode=mode))


def plan_settings(plan: "Plan") -> dict[str, Any]:
    """A compiled plan's settings as plain data for ``summary`` and ``to_json``: the optimizer,
    the sync algorithm (its description and ``summary_rule``), α and γ for its k learners."""
    sync, state, k = plan.sync, plan.rounds.sync_state, plan.num_learners
    return {"optimizer": plan.settings.optimizer.describe(), "sync": sync.describe(state),
            "sync_rule": sync.summary_rule(k, state), "alpha": sync.alpha_for(k),
            "centre_gain": sync.centre_gain(k)}


def plan_summary(plan: "Plan") -> str:
    """``summary`` of a compiled plan; under torchrun a last line with the bytes each process
    hands to the global sync's all-reduce (``Distributed.sync_bytes``)."""
    text = _inspect.summary(plan.task_graph, plan_settings(plan))
    if plan.comm is not None:
        d = plan.comm.settings
        text += (f"\nglobal sync over {plan.comm.world_size} processes: "
                 f"{d.sync_bytes(plan.num_parameters, plan.states[0].buf.shape[1]):,} bytes "
                 f"per process per sync ({d.sync_dtype} corrections)")
    membership = plan.rounds.transport.describe()  # torchft's live replica groups
    if membership is not None:
        text += "\n" + membership
    return text
