"""crossbow_graph: small-batch, many-replica training with synchronous model averaging (SMA).

``compile(model, ...)`` traces a PyTorch model (torch.fx, or an eager analysis) into a Plan of learner and
synchronisation tasks; ``Plan.fit`` runs it. See docs/design-overview.md and the README."""

from __future__ import annotations

from . import datasets, models
from .api import Plan, compile
from .compile_options import CompileOptions
from .compiler.tasks import Cost, Task, TaskKind
from .config import SGD, Adjustment
from .engine.settings import RunSettings
from .engine.sync import EASGD, SMA, SSGD, DiLoCo, LocalSGD
from .engine.transport.comm import Distributed
from .errors import (CheckpointError, CompilerError, DistributedError, DivergenceError, HookError,
                     PlanError, TaskError, TraceError, TraceWarning, TrainingInterrupted)
from .training.history import History
from .training.hooks import FitContext, Hook
from .training.options import FitOptions
from .tuning.autotune import AutoTune
from .tuning.metrics import MetricsMonitor
from .tuning.policies import (AdaptiveBatchSize, AutoReplicas, CosineLR, DivergenceGuard,
                              MultiStepLR, Policy, StepLR)

__all__ = [
    "compile", "CompileOptions", "Plan", "SGD", "SMA", "SSGD", "DiLoCo", "LocalSGD", "EASGD", "AutoTune", "Task",
    "TaskKind", "Cost", "History",
    "TraceError", "TraceWarning", "PlanError", "TaskError", "Distributed", "DistributedError", "CompilerError",
    "DivergenceError", "CheckpointError", "HookError", "TrainingInterrupted",
    "datasets", "models",
    "Policy", "Adjustment", "AutoReplicas", "AdaptiveBatchSize", "StepLR", "MultiStepLR",
    "CosineLR", "DivergenceGuard", "MetricsMonitor", "Hook", "FitContext", "FitOptions", "RunSettings",
]
__version__ = "0.1.0"
