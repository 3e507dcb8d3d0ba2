"""Bit-identity of a change to the engine: the final z and every replica of ten configurations.

    python scripts/bit_identity.py save OUT.pt [--only NAME ...]   # run them, write the tensors
    python scripts/bit_identity.py compare A.pt B.pt               # torch.equal, per configuration

Run ``save`` on the commit before a change and on the change, then ``compare``: a refactoring
that changes no number prints ``identical`` for every configuration. Each configuration trains
LeNet-5 on the first 2,048 MNIST samples (``cg.datasets.mnist``) from seed 0, except ``cli``
(the default ``crossbow-graph train``, whole MNIST) and ``torchrun`` (``crossbow-graph train``
under ``torchrun --nproc-per-node 2``), which run the CLI and read its last checkpoint. Worker
processes use one convolution library (``cpu_conv="aten"``), which ``"auto"`` would measure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crossbow_graph as cg  # noqa: E402
from crossbow_graph.training.checkpoint_files import load_latest  # noqa: E402

__all__ = ["CONFIGS", "main"]

N_TRAIN = 2048


def _data() -> torch.utils.data.Dataset:
    train = cg.datasets.mnist(train=True)
    return torch.utils.data.Subset(train, range(N_TRAIN))


def _plan(**kw) -> cg.Plan:
    torch.manual_seed(0)
    model = cg.models.lenet5()
    args = dict(batch_size=16, devices=1, replicas=2, executor="inline",
                optimizer=cg.SGD(lr=0.02, momentum=0.9), cpu_conv="aten")
    args.update(kw)
    if callable(args["optimizer"]):
        args["optimizer"] = args["optimizer"](model)
    return cg.compile(model, (torch.zeros(1, 1, 28, 28),), F.cross_entropy, **args)


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    """z, z_prev, every replica's w and v, the buffers, of a ``plan_state_dict``."""
    out = {}
    for d, s in enumerate(state["states"]):
        for key in ("w", "v", "z", "z_prev", "buf", "zbuf"):
            out[f"{d}.{key}"] = s[key]
    return out


def _fit(plan: cg.Plan, epochs: int = 2, **kw) -> dict[str, torch.Tensor]:
    plan.fit(_data(), epochs, progress=False, seed=0, **kw)
    return _tensors(plan.state_dict())


class _Changes(cg.Policy):
    """η at round 20, b at round 40, m at round 60 (rounds of the whole run)."""

    def after_round(self, ctx) -> None:
        t = ctx.plan.rounds_done
        if t == 20:
            self.adjust(ctx, lr=0.01, reason="test")
        elif t == 40:
            self.adjust(ctx, batch_size=8, reason="test")
        elif t == 60:
            self.adjust(ctx, replicas_per_device=3, reason="test")


def _process() -> dict:
    return _fit(_plan(executor="process"))


def _process_fused() -> dict:
    return _fit(_plan(executor="process", learner_mode="fused", replicas=3))


def _inline_fused() -> dict:
    return _fit(_plan(learner_mode="fused", replicas=4, devices=2))


def _ssgd() -> dict:
    return _fit(_plan(sync=cg.SSGD(), replicas=2, devices=2))


def _diloco() -> dict:
    return _fit(_plan(sync=cg.DiLoCo(sync_every=4),
                      optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)))


def _policy() -> dict:
    return _fit(_plan(executor="process"), policies=[_Changes()])


def _lr_scheduler() -> dict:
    plan = _plan(optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), replicas=2)
    rounds = 2 * (N_TRAIN // (2 * 16))
    sched = torch.optim.lr_scheduler.OneCycleLR(plan.optimizer, max_lr=4e-3, total_steps=rounds)
    return _fit(plan, lr_scheduler=sched, lr_scheduler_interval="round")


def _lr_scheduler_process() -> dict:
    plan = _plan(executor="process", optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.02))
    sched = torch.optim.lr_scheduler.StepLR(plan.optimizer, step_size=1, gamma=0.5)
    return _fit(plan, epochs=3, lr_scheduler=sched)


def _resumed() -> dict:
    with tempfile.TemporaryDirectory() as ckpt:
        _plan(executor="process").fit(_data(), 1, progress=False, seed=0, checkpoint_dir=ckpt)
        return _fit(_plan(executor="process"), checkpoint_dir=ckpt, resume=True)


def _streams() -> dict:
    from crossbow_graph.testing.race_check import RaceRecorder
    plan = _plan(replicas=3)
    with RaceRecorder().attach(plan.rounds):
        return _fit(plan)


def _cli(extra: list[str], torchrun: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as ckpt:
        cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", "29533", "-m", "crossbow_graph"] if torchrun
               else [sys.executable, "-m", "crossbow_graph"])
        cmd += ["train", "--quiet", "--checkpoint-dir", ckpt] + extra
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"} if torchrun
                       else None)
        _, state = load_latest(ckpt)
        return _tensors(state["plan"])


CONFIGS: dict[str, Callable[[], dict]] = {
    "cli": lambda: _cli([]),
    "process": _process,
    "process_fused": _process_fused,
    "inline_fused_2dev": _inline_fused,
    "ssgd": _ssgd,
    "diloco": _diloco,
    "policy_lr_b_m": _policy,
    "lr_scheduler_onecycle": _lr_scheduler,
    "lr_scheduler_process": _lr_scheduler_process,
    "resumed": _resumed,
    "simulated_streams": _streams,
    "torchrun": lambda: _cli(["--epochs", "1", "--train-samples", "4096"], torchrun=True),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    save = sub.add_parser("save")
    save.add_argument("out")
    save.add_argument("--only", nargs="*", choices=sorted(CONFIGS))
    compare = sub.add_parser("compare")
    compare.add_argument("a")
    compare.add_argument("b")
    args = parser.parse_args(argv)
    if args.cmd == "save":
        results = {}
        for name in args.only or CONFIGS:
            print(f"{name} ...", flush=True)
            results[name] = CONFIGS[name]()
        torch.save(results, args.out)
        print(f"wrote {args.out}")
        return 0
    a, b = torch.load(args.a), torch.load(args.b)
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name:24s} only in {'A' if name in a else 'B'}")
            continue
        diff = [k for k in a[name] if k not in b[name] or not torch.equal(a[name][k], b[name][k])]
        bad += bool(diff)
        print(f"{name:24s} {'identical' if not diff else 'DIFFERS: ' + ', '.join(diff)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
