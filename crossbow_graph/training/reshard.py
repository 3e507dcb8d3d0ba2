"""A checkpoint's learners on another number of ranks (docs/distributed.md, Resuming on another
number of processes): ``split_for_ranks`` gives each of R′ ranks its plan state.

A checkpoint holds rank 0's plan state and RNG states, and per other rank r = 1 … R−1
``peers[r − 1] = {"states": [...], "losses": [n], "rng": {...}}``; ``world_size`` is R (absent:
one process). Learners are numbered j = (r·G + d)·m + i (training/fit_data.py ``rank_rows``); a
new learner's loss scale is the smallest saved one."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["split_for_ranks", "saved_world_size", "saved_learners"]


def saved_world_size(state: dict[str, Any]) -> int:
    """R, the ranks that wrote checkpoint ``state`` (1 for a checkpoint without the field)."""
    return state.get("world_size", 1)


def _saved_ranks(state: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Per saved rank its device states (``plan_state_dict``'s ``states``)."""
    return [state["plan"]["states"]] + [p["states"] for p in state.get("peers", [])]


def saved_learners(state: dict[str, Any]) -> int:
    """k, the learners of checkpoint ``state``: Σ over its ranks and devices of the replicas."""
    return sum(len(dev["first_step"]) for devs in _saved_ranks(state) for dev in devs)


def split_for_ranks(state: dict[str, Any], world_size: int
                    ) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Each of ``world_size`` new ranks' ``(plan state, RNG states or None)`` from checkpoint
    ``state`` (the module docstring's rule). The plan states keep the saved devices and replicas
    per rank; ``load_plan_state_dict`` checks them against the plan.

    Raises:
        ValueError: the saved ranks differ in devices or replicas (not a checkpoint of this
            version)."""
    ranks = _saved_ranks(state)
    peers = state.get("peers", [])
    rngs = [state["rng"]] + [p["rng"] for p in peers]
    plan = state["plan"]
    losses = [plan["losses"]] + [p.get("losses", torch.zeros(0)) for p in peers]
    # each rank's convolution library per b (a rank the checkpoint did not have measures its own)
    convs = [plan.get("cpu_conv_choices", {})] + [p.get("cpu_conv_choices", {}) for p in peers]
    if world_size == len(ranks):
        return [({**plan, "states": devs, "losses": loss, "cpu_conv_choices": conv}, rng)
                for devs, loss, conv, rng in zip(ranks, losses, convs, rngs)]
    losses[0] = torch.cat([losses[0], *losses[world_size:]])  # dropped ranks' into rank 0's
    G, m = len(ranks[0]), len(ranks[0][0]["first_step"])
    if any(len(devs) != G or any(len(d["first_step"]) != m for d in devs) for devs in ranks):
        raise ValueError("the checkpoint's ranks hold different numbers of devices or replicas")
    saved = [(dev, i) for devs in ranks for dev in devs for i in range(m)]  # global learner order
    scales = [dev["loss_scales"][0] for devs in ranks for dev in devs
              if dev.get("loss_scales") is not None]
    fresh = {"ints": ranks[0][0]["int_buffers"][0],
             "scale": torch.cat(scales).min() if scales else None}
    out = []
    for r in range(world_size):
        devices = []
        for d in range(G):
            first = (r * G + d) * m
            rows = [saved[j] if j < len(saved) else None for j in range(first, first + m)]
            devices.append(_device_state(ranks[0][d], rows, fresh))
        mine = losses[r] if r < len(ranks) else torch.zeros(0)
        conv = convs[r] if r < len(convs) else {}
        out.append(({**plan, "states": devices, "losses": mine, "cpu_conv_choices": conv},
                    rngs[r] if r < len(rngs) else None))
    return out


def _device_state(base: dict[str, Any], rows: list[tuple[dict[str, Any], int] | None],
                  fresh: dict[str, Any]) -> dict[str, Any]:
    """A device's saved state (``plan_state_dict``'s per-device dict) of ``len(rows)`` replicas:
    row i is saved replica ``rows[i] = (device state, row)``, or new (None); z, z_prev, zbuf and
    the name are ``base``'s (every device's and rank's copies are equal)."""
    z, zbuf = base["z"], base["zbuf"]

    def stack(key: str, new: torch.Tensor) -> torch.Tensor:
        return torch.stack([src[key][i] if src is not None else new for src, i in _pairs(rows)])

    out = {"name": base["name"], "z": z, "z_prev": base["z_prev"], "zbuf": zbuf,
           "w": stack("w", z), "v": stack("v", torch.zeros_like(base["v"][0])),
           "buf": stack("buf", zbuf),
           "first_step": [src["first_step"][i] if src is not None else True
                          for src, i in _pairs(rows)],
           "int_buffers": [dict(src["int_buffers"][i]) if src is not None else
                           {n: t.clone() for n, t in fresh["ints"].items()}
                           for src, i in _pairs(rows)]}
    if base.get("loss_scales") is not None:  # float16 learners (engine/state/precision.py)
        scale = [src["loss_scales"][0][i] if src is not None else fresh["scale"]
                 for src, i in _pairs(rows)]
        good = [src["loss_scales"][1][i] if src is not None else
                torch.zeros((), dtype=base["loss_scales"][1].dtype) for src, i in _pairs(rows)]
        out["loss_scales"] = (torch.stack(scale), torch.stack(good))
    else:
        out["loss_scales"] = None
    opt = base.get("optimizer_rows")
    if opt is not None:  # a row optimizer (engine/state/optim.py OptimizerRows): age 0 is fresh state
        out["optimizer_rows"] = {
            "age": torch.stack([src["optimizer_rows"]["age"][i] if src is not None else
                                torch.zeros_like(opt["age"][0]) for src, i in _pairs(rows)]),
            "state": {key: torch.stack([src["optimizer_rows"]["state"][key][i] if src is not None
                                        else torch.zeros_like(t[0]) for src, i in _pairs(rows)])
                      for key, t in opt["state"].items()}}
    else:
        out["optimizer_rows"] = None
    return out


def _pairs(rows: list[tuple[dict[str, Any], int] | None]) -> list[tuple[dict[str, Any] | None, int]]:
    """``rows`` with a new replica as ``(None, 0)``."""
    return [(None, 0) if row is None else row for row in rows]
