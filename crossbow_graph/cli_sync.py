"""``crossbow-graph train``'s synchronisation flags, generated from the sync algorithms
(engine/sync/ ``ALGORITHMS``): ``--sync`` names one (its class name in snake case: sma, ssgd,
diloco, local_sgd, easgd), and every number field of an algorithm's dataclass is a flag of its
own (``alpha`` → ``--alpha``), its help the field's line in the class's ``Attributes:``. A flag
left out keeps the algorithm's default; one the chosen algorithm lacks is an error. DiLoCo's outer
optimizer, a factory rather than a number, is built from ``--outer-lr`` and ``--outer-momentum``."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import re
from typing import Any

import torch

from .engine import sync as sync_package
from .engine.sync import SyncAlgorithm

__all__ = ["DILOCO_H", "SyncFlag", "sync_name", "sync_algorithms", "sync_flags", "add_sync_flags",
           "sync_of"]

DILOCO_H = 16  # the default H of an algorithm whose sync_every has none (docs/benchmarking.md,
# DiLoCo on W1)
_REQUIRED = {"sync_every": DILOCO_H}  # a field without a default → the CLI's
_SCALARS = {"int": int, "float": float, "str": str, "bool": bool}
_OUTER = "outer_optimizer"  # a factory field, built from --outer-lr and --outer-momentum


@dataclasses.dataclass(frozen=True)
class SyncFlag:
    """One generated flag: ``--flag`` sets the field ``name`` (of type ``kind``) of the
    algorithms ``owners``; ``help`` is their ``Attributes:`` lines."""

    flag: str
    name: str
    kind: type
    owners: tuple[type[SyncAlgorithm], ...]
    help: str


def sync_name(cls: type) -> str:
    """``--sync``'s name of an algorithm class: SMA → sma, LocalSGD → local_sgd, DiLoCo → diloco."""
    return re.sub(r"(?<=[a-z])(?=[A-Z]{2,})", "_", cls.__name__).lower()


def sync_algorithms() -> dict[str, type[SyncAlgorithm]]:
    """``--sync``'s choices: name → the algorithm class, in ``ALGORITHMS``' order."""
    return {sync_name(cls): cls for cls in sync_package.ALGORITHMS}


def _scalar(field: dataclasses.Field) -> type | None:
    """The field's type when it is a number, a string or a bool (``None`` allowed), else None."""
    text = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    parts = [p.strip() for p in text.split("|") if p.strip() != "None"]
    return _SCALARS.get(parts[0]) if len(parts) == 1 else None


def _required(field: dataclasses.Field) -> bool:
    """The field has no default (an algorithm's constructor needs it)."""
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` entries of ``cls``'s docstring: name → its text on one line."""
    docs: dict[str, str] = {}
    lines = (inspect.getdoc(cls) or "").splitlines()
    inside, name = False, None
    for line in lines:
        if line.strip() == "Attributes:":
            inside = True
        elif inside and line and not line.startswith(" "):
            break
        elif inside and (m := re.match(r"^ {4}(\w+): (.*)$", line)):
            name, docs[m[1]] = m[1], m[2]
        elif inside and name and line.startswith("     "):
            docs[name] += " " + line.strip()
    return docs


def sync_flags() -> dict[str, SyncFlag]:
    """The flags of every algorithm's number fields, by flag; a field several algorithms share
    (``sync_every``, ``alpha``) is one flag whose help names each one's meaning (the first
    clause of its ``Attributes:`` line; a field without a default: the CLI's, ``DILOCO_H``)."""
    found: dict[str, SyncFlag] = {}
    for name, cls in sync_algorithms().items():
        docs = _attribute_docs(cls)
        for field in dataclasses.fields(cls):
            kind = _scalar(field)
            if kind is None:
                continue
            flag = "--" + field.name.replace("_", "-")
            text = re.split(r"; |\. |\.$", docs.get(field.name, field.name))[0].replace("``", "")
            if _required(field):
                text += (f" (default {_REQUIRED[field.name]})" if field.name in _REQUIRED
                         else " (required)")
            line = f"{name}: {text}"
            old = found.get(flag)
            found[flag] = SyncFlag(flag, field.name, kind, (old.owners if old else ()) + (cls,),
                                   f"{old.help}; {line}" if old else line)
    return found


def add_sync_flags(train: argparse.ArgumentParser) -> None:
    """``train``'s ``--sync``, the generated flags (``sync_flags``, default None: the algorithm's
    own), and DiLoCo's ``--outer-lr``, ``--outer-momentum``."""
    names = sync_algorithms()
    train.add_argument("--sync", default="sma", choices=tuple(names),
                       help="the sync algorithm, with the flags of its settings below: "
                            + ", ".join(f"{n} ({cls.__name__})" for n, cls in names.items()))
    for spec in sync_flags().values():
        if spec.kind is bool:
            train.add_argument(spec.flag, action=argparse.BooleanOptionalAction, default=None,
                               help=spec.help)
        else:
            train.add_argument(spec.flag, type=spec.kind, default=None, help=spec.help)
    train.add_argument("--outer-lr", type=float, default=None, help="diloco: its outer SGD's lr "
                       "(default 0.7)")
    train.add_argument("--outer-momentum", type=float, default=None,
                       help="diloco: its outer SGD's momentum in [0, 1), Nesterov when > 0 (default "
                            "0.9; --outer-lr 1 --outer-momentum 0 is local SGD: z the replicas' mean)")


def sync_of(args: argparse.Namespace) -> SyncAlgorithm:
    """``--sync``'s algorithm with the generated flags given (the others at its defaults; a field
    without a default at the CLI's, ``DILOCO_H`` for H) and, for DiLoCo, an outer SGD of
    ``--outer-lr``, ``--outer-momentum``.

    Raises:
        ValueError: a flag of another algorithm's setting, an outer-optimizer flag without
            ``--sync diloco``, an outer lr ≤ 0 or momentum outside [0, 1); what the algorithm
            raises for a bad value."""
    cls = sync_algorithms()[args.sync]
    given: dict[str, Any] = {}
    for spec in sync_flags().values():
        value = getattr(args, spec.name)
        if value is None:
            continue
        if cls not in spec.owners:
            owners = ", ".join(o.__name__ for o in spec.owners)
            raise ValueError(f"{spec.flag} with --sync {args.sync}: it is a setting of {owners}, "
                             f"not of {cls.__name__}; drop {spec.flag}, or use --sync "
                             f"{sync_name(spec.owners[0])}")
        given[spec.name] = value
    for field in dataclasses.fields(cls):
        if _required(field) and field.name not in given:
            if field.name not in _REQUIRED:
                raise ValueError(f"--sync {args.sync} needs --{field.name.replace('_', '-')} "
                                 f"({cls.__name__}.{field.name} has no default)")
            given[field.name] = _REQUIRED[field.name]
    if _OUTER in {f.name for f in dataclasses.fields(cls)}:
        given[_OUTER] = _outer_optimizer(args)
    else:
        for flag in ("--outer-lr", "--outer-momentum"):
            if getattr(args, flag[2:].replace("-", "_")) is not None:
                owners = [n for n, c in sync_algorithms().items()
                          if _OUTER in {f.name for f in dataclasses.fields(c)}]
                raise ValueError(f"{flag} with --sync {args.sync}: it sets an outer optimizer, "
                                 f"which {cls.__name__} has not; add --sync {owners[0]}, or drop it")
    return cls(**given)


def _outer_optimizer(args: argparse.Namespace) -> Any:
    """An outer SGD (DiLoCo's ``outer_optimizer``) from ``--outer-lr`` (0.7) and
    ``--outer-momentum`` (0.9, Nesterov when > 0)."""
    lr = 0.7 if args.outer_lr is None else args.outer_lr
    momentum = 0.9 if args.outer_momentum is None else args.outer_momentum
    if not lr > 0:
        raise ValueError(f"--outer-lr {lr:g}: the outer SGD's lr must be > 0, e.g. 0.7")
    if not 0 <= momentum < 1:
        raise ValueError(f"--outer-momentum {momentum:g}: must be in [0, 1), e.g. 0.9 (0: none)")
    return functools.partial(torch.optim.SGD, lr=lr, momentum=momentum, nesterov=momentum > 0)
