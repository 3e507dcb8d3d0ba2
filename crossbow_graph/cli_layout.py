"""``crossbow-graph train``'s devices and replicas from ``--devices``, ``--replicas`` and the
policies (docs/policies.md: a policy that needs k ≥ 2 learners gets them by default)."""

from __future__ import annotations

import math
import sys

from .build import resolve_devices

__all__ = ["learner_layout"]


def learner_layout(devices_flag: str | None, replicas_flag: int | str | None,
                   policies: list) -> tuple[int | str, int | str]:
    """``devices`` and ``replicas`` for ``compile``: the flags as given; where neither is given,
    'auto' × 1, or, when a policy needs more learners (``Policy.min_learners``) than the devices
    'auto' finds, enough replicas per device for it, with a note on stderr.

    Args:
        devices_flag: ``--devices`` ('auto' or a count), None when not given.
        replicas_flag: ``--replicas`` (a count or 'auto'), None when not given.
        policies: the fit's policies.

    Raises:
        ValueError: ``--devices`` neither 'auto' nor a count."""
    devices = "auto" if devices_flag is None else devices_flag
    if devices != "auto" and not devices.isdigit():
        raise ValueError(f"--devices {devices}: use 'auto' (every GPU, else one CPU device) or a "
                         "count such as 2")
    devices = devices if devices == "auto" else int(devices)
    if replicas_flag is not None or devices_flag is not None:
        return devices, 1 if replicas_flag is None else replicas_flag
    need = max((p.min_learners for p in policies), default=1)
    found = len(resolve_devices(devices))
    if need <= found:
        return devices, 1
    replicas = math.ceil(need / found)
    names = ", ".join(type(p).__name__ for p in policies if p.min_learners > found)
    print(f"note: {names} needs k ≥ {need} learners: training {replicas} replicas on each of "
          f"{found} device(s) (--devices or --replicas choose otherwise)", file=sys.stderr,
          flush=True)
    return devices, replicas
