"""The options of ``Plan.fit``: one typed field each (default, doc, choices), checked when they
are built, before any training round (docs/options.md has their table)."""

# no ``from __future__ import annotations``: check_choices reads the Literal types of the fields

import dataclasses
import math
import os
import tempfile
from typing import Any, Callable, Literal

from ..errors import check_flag, is_count, is_real
from ..fields import check_choices, option
from .hooks import Hook
from .lr_schedule import LRInterval

__all__ = ["FitOptions", "as_hooks", "check_writable_dir"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FitOptions:
    """How ``Plan.fit`` trains: ``Plan.fit`` takes these as keyword arguments, or one
    ``options=FitOptions(...)``. Each field's default, choices and doc are its own
    (``dataclasses.fields(FitOptions)``, ``field.metadata["doc"]``; docs/options.md).
    ``hooks`` and ``policies`` are kept as tuples.

    Raises:
        ValueError: ``epochs``, ``evals_per_epoch``, ``eval_batch_size`` or ``metrics_every`` not
            an integer ≥ 1, ``bn_recalibration_batches`` not an integer ≥ 0, ``target_accuracy``
            outside (0, 1], ``target_loss`` not finite, ``data_on_device`` not ``"auto"``, True
            or False, ``max_grad_norm`` not a positive finite number, ``cpu_threads`` not
            ``"auto"``, None or an integer ≥ 1, a value not among a field's choices,
            ``resume=True`` or ``checkpoint_every`` without ``checkpoint_dir``, a ``trace`` path
            whose folder is missing or not writable, a ``log_dir`` that is a file or cannot be
            created or written.
        TypeError: ``metric_fn`` not callable, ``seed`` not an integer, ``target_accuracy``,
            ``target_loss`` or ``max_grad_norm`` not a number, ``shuffle`` not a bool or None,
            ``progress`` or ``resume`` not a bool, ``hooks``/``policies`` not a list of hook
            objects (one hook alone, or a class instead of an instance)."""

    epochs: int = option(1, doc=(
        "epochs to run (≥ 1); with resume=True, the epochs of the whole run"))
    shuffle: bool | None = option(None, doc=(
        "shuffle every epoch; False: the dataset's order (learner j gets batch number t·k + j "
        "in round t); None: a training DataLoader's own shuffle (DataLoader(shuffle=False), "
        "its default, keeps the order), else True"))
    seed: int = option(0, doc=(
        "seeds the data order and, at the start of the fit, this process's torch, Python random "
        "and NumPy global RNGs (dropout, a Dataset's augmentation); worker processes reseed "
        "every round from (seed, round, worker)"))
    target_accuracy: float | None = option(None, doc=(
        "stop once z's test accuracy (a fraction in (0, 1]) reaches it (needs an eval_dataset); "
        "None: run every epoch"))
    target_loss: float | None = option(None, doc=(
        "stop once z's test loss (loss_fn's mean over the eval_dataset: nats per token with "
        "models.lm_loss) is at or below it (needs an eval_dataset; with target_accuracy too, "
        "whichever is reached first); None: no loss target"))
    evals_per_epoch: int = option(1, doc=(
        "evaluations of z on the eval_dataset per epoch (the time-to-accuracy resolution)"))
    eval_batch_size: int = option(1000, doc="batch size of evaluation (≥ 1)")
    progress: bool = option(True, doc="show a progress bar")
    hooks: tuple[Hook, ...] = option((), doc=(
        "Hook objects called at fit, epoch, round and evaluation boundaries, in this order, "
        "after the plan's auto-tuner; their state_dict() is checkpointed"))
    checkpoint_dir: str | None = option(None, doc=(
        "write checkpoints of the whole state there every checkpoint_every rounds, at the end of "
        "every complete epoch and when SIGTERM stops the fit, the newest two kept; one fit at a "
        "time holds it (a lock), and with resume=False it must not hold another run's "
        "checkpoints (docs/reliability.md)"))
    checkpoint_every: int | None = option(None, doc=(
        "rounds between checkpoints (≥ 1); None: at epoch ends only"))
    resume: bool = option(False, doc=(
        "continue from the newest good checkpoint in checkpoint_dir, bit-identical to an "
        "uninterrupted run (under torchrun also on another number of processes, "
        "docs/distributed.md); without one there, start afresh; a setting this fit is set up "
        "with differently from the checkpoint's run keeps this fit's value, with a warning"))
    log_dir: str | None = option(None, doc=(
        "write per-round and per-epoch CSV, TensorBoard events and history.json there"))
    trace: str | None = option(None, doc=(
        "write a Chrome-trace JSON timeline of every task to this path (chrome://tracing, "
        "Perfetto): the global sync of round t under round t+1's learning is the overlap"))
    policies: tuple[Hook, ...] = option((), doc=(
        "hyper-parameter policies (crossbow_graph.Policy: AdaptiveBatchSize, StepLR, "
        "DivergenceGuard, ...; docs/policies.md), run after the hooks and the metrics; they "
        "change the plan through Plan.adjust"))
    metrics_every: "int | MetricsMonitor | None" = option(50, doc=(
        "N, rounds per metrics window (History.metrics: samples/s, loss, divergence, gradient "
        "noise scale), or a crossbow_graph.MetricsMonitor; run after the hooks and before the "
        "policies; None: no metrics"))
    lr_scheduler: Any = option(None, doc=(
        "a torch.optim.lr_scheduler scheduler built over Plan.optimizer, stepped after the "
        "policies every lr_scheduler_interval (ReduceLROnPlateau after every evaluation, with "
        "z's test loss); History.lr has η per round"))
    lr_scheduler_interval: LRInterval = option("epoch", doc=(
        "when lr_scheduler steps: once per epoch, per round (of k·b samples), or per batch of b "
        "(len(DataLoader) steps an epoch, a Dataset's ⌈N/b⌉, spread over its rounds: a schedule "
        "sized as a plain loop sizes it ends with the fit whatever k is)"))
    metric_fn: Callable[[Any, Any], Any] | None = option(None, doc=(
        "metric_fn(output, target) -> a batch's mean accuracy in [0, 1] (a float or 0-dim "
        "tensor): z's test_accuracy is its mean over the eval_dataset; None: the class accuracy "
        "of the output's [N, C] scores against integer targets [N], or for any other output "
        "None, with a warning"))
    bn_recalibration_batches: int = option(20, doc=(
        "training batches of b on which z's BatchNorm statistics are re-estimated for z's "
        "weights before every evaluation and in central_model() (the evaluated copy only; "
        "k = 1 and models without BatchNorm skip it); 0: the replicas' mean statistics"))
    data_on_device: bool | Literal["auto"] = option("auto", doc=(
        "True: a TensorDataset's tensors on the plan's first device for the fit, each round "
        "gathered there; 'auto': so on CUDA when they take ≤ ¼ of its free memory; False: "
        "gathered on the host; on CUDA other batches are copied a round ahead (docs/runtime.md)"))
    cpu_threads: int | Literal["auto"] | None = option("auto", doc=(
        "torch's intra-op threads during the fit: 'auto' on CPU devices as many as cores are "
        "free at its start (other processes' load measured; shared among a host's torchrun "
        "ranks; at most torch's setting), an integer ≥ 1 that many, None torch's setting; "
        "given back after the fit (History.cpu_threads; docs/runtime.md)"))
    max_grad_norm: float | None = option(None, doc=(
        "every learner clips its own gradient to this 2-norm before its local step, as "
        "torch.nn.utils.clip_grad_norm_ does: g_j ← g_j·min(1, max_grad_norm/(‖g_j‖₂ + 1e-6)) "
        "(docs/optimizers.md); None: no clipping"))

    def __post_init__(self) -> None:
        object.__setattr__(self, "hooks", as_hooks("hooks", self.hooks))
        object.__setattr__(self, "policies", as_hooks("policies", self.policies))
        for name in ("shuffle", "progress", "resume"):
            if not (name == "shuffle" and self.shuffle is None):
                check_flag(name, getattr(self, name))
        if self.metric_fn is not None and not callable(self.metric_fn):
            raise TypeError(f"metric_fn={self.metric_fn!r}: must be callable as "
                            "metric_fn(output, target) -> the batch's accuracy, or None")
        if not is_count(self.epochs):
            raise ValueError(f"epochs={self.epochs!r}: must be an integer ≥ 1")
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed={seed!r}: must be an integer, e.g. seed=0")
        _check_target_accuracy(self.target_accuracy)
        _check_target_loss(self.target_loss)
        _check_max_grad_norm(self.max_grad_norm)
        if self.max_grad_norm is not None:  # a NumPy number too: a Python float for the kernels
            object.__setattr__(self, "max_grad_norm", float(self.max_grad_norm))
        every = self.metrics_every
        if not (every is None or isinstance(every, Hook) or is_count(every)):
            raise ValueError(f"metrics_every={every!r}: must be an integer ≥ 1 (rounds per "
                             "window), a crossbow_graph.MetricsMonitor, or None (no metrics)")
        if not is_count(self.evals_per_epoch):
            raise ValueError(f"evals_per_epoch={self.evals_per_epoch!r}: must be an integer ≥ 1 "
                             "(evaluations of z per epoch), e.g. 1")
        if not is_count(self.bn_recalibration_batches, 0):
            raise ValueError(f"bn_recalibration_batches={self.bn_recalibration_batches!r}: must be "
                             "an integer ≥ 0 (training batches of b per re-estimation of z's "
                             "BatchNorm statistics; 0 turns it off), e.g. 20")
        if not is_count(self.eval_batch_size):
            raise ValueError(f"eval_batch_size={self.eval_batch_size!r}: must be an integer ≥ 1, "
                             "e.g. 1000")
        where = self.data_on_device
        if not (where is True or where is False or (isinstance(where, str) and where == "auto")):
            raise ValueError(f"data_on_device={where!r}: use 'auto' (the default: "
                             "a TensorDataset on a CUDA device when it fits in a quarter of the "
                             "free memory), True or False")
        _check_cpu_threads(self.cpu_threads)
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume=True needs checkpoint_dir, the directory to resume from")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError(f"checkpoint_every={self.checkpoint_every!r} needs checkpoint_dir, the "
                             "directory to write the checkpoints to")
        if self.trace is not None:
            _check_trace_path(self.trace)
        if self.log_dir is not None:
            check_writable_dir("log_dir", self.log_dir)
        check_choices(self)


def _check_cpu_threads(value: object) -> None:
    """ValueError unless ``value`` is ``"auto"``, None or an integer ≥ 1."""
    if value is None or (isinstance(value, str) and value == "auto") or is_count(value):
        return
    raise ValueError(f"cpu_threads={value!r}: use 'auto' (threads from the free cores), an "
                     "integer ≥ 1, or None (torch's setting as it is)")


def as_hooks(name: str, hooks: object) -> tuple:
    """``hooks`` (the argument ``name``) as a tuple; None is none.

    Raises:
        TypeError: one hook not in a list, something not iterable, a class instead of an
            instance, or an item that is not a crossbow_graph.Hook (a plain function, say)."""
    if hooks is None:
        return ()
    if isinstance(hooks, Hook):
        raise TypeError(f"{name}={hooks!r}: pass a list of hooks, e.g. {name}=[{type(hooks).__name__}(...)]")
    try:
        items = tuple(hooks)
    except TypeError:
        raise TypeError(f"{name}={hooks!r}: must be a list of hook objects") from None
    for h in items:
        if isinstance(h, type):
            raise TypeError(f"{name}: {h.__name__} is a class, not a hook: pass an instance, "
                            f"e.g. {name}=[{h.__name__}()]")
        if not isinstance(h, Hook):
            missing = [m for m in _HOOK_METHODS if not callable(getattr(h, m, None))]
            why = f"no {', '.join(missing)}" if missing else "not a crossbow_graph.Hook"
            fn = getattr(h, "__name__", None) if callable(h) else None
            what = f"the function {fn}" if fn else f"{h!r} (of type {type(h).__name__})"
            raise TypeError(
                f"{name}: {what} is not a hook ({why}): the fit calls a hook's methods at its "
                "boundaries and reads what it declares; subclass crossbow_graph.Hook and "
                f"override the one you need, e.g. class Every(cg.Hook): def after_round(self, "
                f"ctx): {fn or 'f'}(ctx); then {name}=[Every()]")
    return items


_HOOK_METHODS = ("before_fit", "before_epoch", "before_round", "after_round", "after_eval",
                 "after_epoch", "after_fit")  # what the fit calls on every hook (training/hooks.py)


def _check_trace_path(trace: object) -> None:
    """ValueError unless the timeline can be written to ``trace`` (a file in an existing,
    writable directory): it is written after the last round, when an error would lose it."""
    if not isinstance(trace, (str, os.PathLike)):
        raise TypeError(f"trace={trace!r}: must be a file path, e.g. trace='run.json'")
    folder = os.path.dirname(os.path.abspath(trace))
    if os.path.isdir(trace):
        raise ValueError(f"trace={str(trace)!r} is a directory; pass a file path, e.g. "
                         f"trace={os.path.join(str(trace), 'run.json')!r}")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"trace={str(trace)!r}: its folder {folder!r} does not exist or is not "
                         "writable; create it or pass a path in a writable folder")


def check_writable_dir(argument: str, directory: object) -> None:
    """Create ``directory`` (the argument ``argument``, e.g. ``"checkpoint_dir"``) if missing and
    write and remove a probe file in it (``os.access`` says yes to root even where writes fail).

    Raises:
        TypeError: not a path. ValueError: a file, or a directory that cannot be created or
            written (the message names the argument, the path and the OS error)."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"{argument}={directory!r}: must be a directory path, e.g. {argument}='runs/w1'")
    directory = str(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"{argument}={directory!r} is a file, not a directory; pass a "
                         "directory (it is created if missing)")
    step = "cannot be created"
    try:
        os.makedirs(directory, exist_ok=True)
        step = "is not writable: creating a file in it fails"
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".probe-", suffix=".tmp")
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"{argument}={directory!r} {step} ({type(exc).__name__}: "
                         f"{exc.strerror or exc}); pass a writable directory") from exc


def _check_target_loss(target_loss: object) -> None:
    """TypeError/ValueError for a ``target_loss`` that is not None or a finite number."""
    if target_loss is None:
        return
    if not is_real(target_loss):
        raise TypeError(f"target_loss={target_loss!r}: must be a number, z's test loss to stop at "
                        "(e.g. 2.4 nats per token), or None")
    if not math.isfinite(target_loss):
        raise ValueError(f"target_loss={target_loss!r}: must be a finite number, z's test loss to "
                         "stop at (e.g. 2.4 nats per token), or None")


def _check_target_accuracy(target_accuracy: object) -> None:
    """TypeError/ValueError for a ``target_accuracy`` that is not None or a fraction in (0, 1]."""
    if target_accuracy is None:
        return
    if not is_real(target_accuracy):
        raise TypeError(f"target_accuracy={target_accuracy!r}: must be a fraction in (0, 1], "
                        "e.g. 0.99, or None")
    if not 0 < target_accuracy <= 1:
        guess = (f"; did you mean {target_accuracy / 100:g}?"
                 if 10 <= target_accuracy <= 100 else "")
        raise ValueError(f"target_accuracy={target_accuracy!r}: must be a fraction in (0, 1] "
                         f"of the eval_dataset's samples, e.g. 0.99{guess}")


def _check_max_grad_norm(max_grad_norm: object) -> None:
    """TypeError/ValueError for a ``max_grad_norm`` that is not None or a positive finite number."""
    if max_grad_norm is None:
        return
    if not is_real(max_grad_norm):
        raise TypeError(f"max_grad_norm={max_grad_norm!r}: must be a positive number, the largest "
                        "2-norm of a learner's gradient, e.g. max_grad_norm=1.0, or None (no "
                        "clipping)")
    if not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
        raise ValueError(f"max_grad_norm={max_grad_norm!r}: must be a positive finite number, "
                         "e.g. max_grad_norm=1.0; pass None (the default) for no clipping")
