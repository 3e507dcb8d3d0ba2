"""The synchronisation algorithms, one class each behind one protocol (docs/design-overview.md
§2; ``base.SyncAlgorithm``): ``SMA`` (synchronous model averaging), ``SSGD`` (synchronous SGD),
``DiLoCo`` (an outer optimizer over z every H rounds), ``LocalSGD`` (periodic model averaging)
and ``EASGD`` (elastic averaging with its own centre rate). The engine calls their methods and
never branches on their type."""

from __future__ import annotations

from .base import SyncAlgorithm, SyncContext, SyncState
from .diloco import DILOCO_OUTER, DiLoCo
from .easgd import EASGD
from .local_sgd import LocalSGD
from .outer import OuterOptimizer
from .sma import SMA
from .ssgd import SSGD

__all__ = ["SyncAlgorithm", "SyncContext", "SyncState", "SMA", "SSGD", "DiLoCo", "LocalSGD", "EASGD",
           "DILOCO_OUTER", "OuterOptimizer", "ALGORITHMS"]

#: The package's algorithms, as ``compile``'s error for another ``sync`` names them.
ALGORITHMS: tuple[type[SyncAlgorithm], ...] = (SMA, SSGD, DiLoCo, LocalSGD, EASGD)
