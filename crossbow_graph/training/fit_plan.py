"""``FitPlan``: what a fit needs of a plan (api.Plan is one): its run settings and progress, the
devices' states, the rounds it runs, the central model it evaluates, the model it was compiled
from, and the one way to change the settings, ``adjust`` (docs/design-overview.md §1, §5)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

from torch import nn

if TYPE_CHECKING:
    from ..compiler.trace import ModelGraph
    from ..config import Adjustment
    from ..engine.rounds.runner import RoundRunner
    from ..engine.settings import RunSettings
    from ..engine.state.flat import DeviceState
    from ..engine.transport.comm import Comm
    from .progress import FitProgress
    from .run_record import RunRecord

__all__ = ["FitPlan", "CentralView"]


class CentralView(Protocol):
    """What a fit uses of the plan's central model z (training/central.py ``CentralModel``):
    its evaluation, its forward, its BatchNorm re-estimation, the last evaluation's extras and,
    under torchrun, rank 0's integer buffers."""

    recalibration: Any
    last_eval_extras: dict[str, float]

    def evaluate(self, dataset: Any, *, batch_size: int, metric_fn: Callable | None,
                 check: bool = True) -> tuple[float | None, float]: ...

    def forward(self, *args: Any, **kwargs: Any) -> Any: ...

    def int_buffers_from_rank0(self, *, replicas: bool, round_index: int = -1) -> None: ...


class FitPlan(Protocol):
    """What a fit, its hooks and its policies read and change of a plan.

    Attributes:
        settings: the run settings in force (η, b, α, τ, m, the learner mode, the optimizer, the
            sync algorithm), read once per round; changed only through ``adjust``.
        progress: how far the plan has trained (written by the fit, restored by checkpoints).
        states: one DeviceState per device of this process (z, the replicas' rows).
        rounds: the engine that runs its rounds (``RoundRunner``).
        central: its central model z, evaluated (``CentralView``).
        run_record: its set-up and checkpoints (training/run_record.py).
        comm: under torchrun this rank's place in the process group, else None.
        template, loss_fn, model_graph: the model every replica is cloned from, the loss, the
            traced model (inputs, outputs, name).
        autotuner: the auto-tuner hook (``replicas="auto"``), or None.
        devices, num_learners, num_parameters: the devices' names, k (every process), P.
        max_replicas_per_device: m that fits the memory budget (None: unbounded).
        fused_failure: why fused learners cannot run the model, or None."""

    settings: RunSettings
    progress: FitProgress
    states: list[DeviceState]
    rounds: RoundRunner
    central: CentralView
    run_record: RunRecord
    comm: Comm | None
    template: nn.Module
    loss_fn: Callable
    model_graph: ModelGraph
    autotuner: Any
    devices: list[str]
    num_learners: int
    num_parameters: int
    max_replicas_per_device: int | None
    fused_failure: str | None

    def adjust(self, adjustment: Adjustment) -> dict[str, Any]:
        """Change lr, b, α, τ, m or the learner mode between rounds; returns what changed."""
