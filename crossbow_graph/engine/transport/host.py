"""What a transport reaches of the engine it serves (``TransportHost``), given once when the
plan's engine is made (engine/transport/transports.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ..state.flat import DeviceState

__all__ = ["TransportHost"]


@dataclass(frozen=True, eq=False)
class TransportHost:
    """What a transport reaches of the engine it serves, given once (``Transport.attach``):
    ``states`` (the devices' DeviceStates), ``loss_fn``, ``sync_state`` (the algorithm's
    runtime state) and ``describe_sync`` (the algorithm in force, as plain data) for torchft's
    agreement and recovery; ``pending_faults``: this rank's fault events not yet shared with the
    other ranks (the all-reduce carries their count)."""

    states: list[DeviceState]
    loss_fn: Callable
    sync_state: Any
    describe_sync: Callable[[], dict[str, Any]]
    pending_faults: Callable[[], int]
