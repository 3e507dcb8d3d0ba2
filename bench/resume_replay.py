"""Kill-at-random-points replay: does a fit killed (SIGKILL) or stopped (SIGTERM) at any point and
resumed from its checkpoint end with the uninterrupted fit's training state AND History?

Each configuration runs once uninterrupted in a process of its own; then each case runs it in a
new process with ``checkpoint_dir`` (every C rounds), sends SIGKILL or SIGTERM to that process at
a point drawn at random (round R, and one of these phases), resumes the same fit in another new
process with ``resume=True``, and compares:

- ``round``: in round R's ``after_round`` before the checkpoint hook (a hook of the fit's own);
- ``next``: in the ``before_round`` after round R (its checkpoint and evaluation done);
- ``eval``: inside ``metric_fn`` at the first evaluation after round R;
- ``epoch``: in the first ``after_epoch`` after round R;
- ``time``: SIGKILL from the parent R·0.03 s after the fit starts (anywhere, a checkpoint's
  write included).

The state is every tensor of ``Plan.state_dict()`` (``torch.equal``); the History is every field
but the clocks (samples/s, seconds, sync shares). Prints one line per case and a summary; exit
status 1 when a case differs.

Under torchrun (``torchrun_*``: 2 ranks) rank 0 is killed or stopped (torchrun then ends the
other rank) and writes the result; the ``time`` phase is not drawn there.

    python bench/resume_replay.py [--cases 26] [--seed 0] [--configs mlp_inline_plateau ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import Subset, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crossbow_graph as cg  # noqa: E402
from crossbow_graph.errors import TrainingInterrupted  # noqa: E402
from crossbow_graph.tuning.metrics import MetricsMonitor  # noqa: E402
from crossbow_graph.tuning.policies import AdaptiveBatchSize  # noqa: E402

__all__ = ["CONFIGS", "main"]

PHASES = ("round", "next", "eval", "epoch", "time")
_CLOCKS = {"samples_per_s", "train_seconds", "sync_unhidden_share", "time_to_accuracy_s",
           "sync_seconds", "sync_exposed_seconds", "seconds", "autotune", "cuda_graphs"}


# -- the configurations ------------------------------------------------------------------------

def _blobs(n: int, seed: int) -> TensorDataset:
    """n samples x [n, 20], y = the argmax of a fixed linear map of x (4 classes), 10 % flipped."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(20, 4, generator=torch.Generator().manual_seed(99))
    x = torch.randn(n, 20, generator=g)
    y = (x @ w).argmax(1)
    flip = torch.rand(n, generator=g) < 0.1
    y[flip] = torch.randint(0, 4, (int(flip.sum()),), generator=g)
    return TensorDataset(x, y)


def _mlp_plan(**kw) -> cg.Plan:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))
    args = dict(batch_size=8, devices=1, replicas=2, executor="inline",
                optimizer=cg.SGD(lr=0.05, momentum=0.9), cpu_conv="aten")
    args.update(kw)
    return cg.compile(net, (torch.zeros(2, 20),), nn.functional.cross_entropy, **args)


def _lenet_plan(**kw) -> cg.Plan:
    torch.manual_seed(0)
    args = dict(batch_size=8, devices=1, replicas=2, executor="inline",
                optimizer=cg.SGD(lr=0.02, momentum=0.9))
    args.update(kw)
    return cg.compile(cg.models.lenet5(), (torch.zeros(1, 1, 28, 28),), nn.functional.cross_entropy,
                      **args)


def _mnist() -> tuple[Any, Any]:
    return (Subset(cg.datasets.mnist(train=True), range(1024)),
            Subset(cg.datasets.mnist(train=False), range(256)))


def _plateau(plan: cg.Plan) -> dict:
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(plan.optimizer, factor=0.5, patience=0)
    return {"lr_scheduler": sched}


def _config(plan_fn: Callable[[], cg.Plan], extra: Callable[[cg.Plan], dict] = lambda p: {},
            data: Callable[[], tuple[Any, Any]] = lambda: (_blobs(1024, 1), _blobs(256, 2)),
            epochs: int = 3, **fit) -> Callable[[], tuple[cg.Plan, dict]]:
    def build() -> tuple[cg.Plan, dict]:
        plan = plan_fn()
        train, test = data()
        kw = dict(train_dataset=train, eval_dataset=test, epochs=epochs, evals_per_epoch=8,
                  progress=False, seed=3, metrics_every=MetricsMonitor(8, measure_rounds=4))
        kw.update(fit)
        kw.update(extra(plan))
        return plan, kw
    return build


CONFIGS: dict[str, Callable[[], tuple[cg.Plan, dict]]] = {
    "mlp_inline_plateau": _config(_mlp_plan, _plateau),
    "mlp_process_plateau": _config(lambda: _mlp_plan(executor="process"), _plateau),
    "mlp_target": _config(_mlp_plan, target_accuracy=0.8),
    "mlp_adaptive_batch": _config(_mlp_plan, policies=[AdaptiveBatchSize(
        max_batch_size=64, cooldown_epochs=0.05, settle_windows=2)]),
    "mlp_diloco": _config(lambda: _mlp_plan(sync=cg.DiLoCo(sync_every=4))),
    "mlp_local_sgd": _config(lambda: _mlp_plan(sync=cg.LocalSGD(sync_every=4))),
    "torchrun_mlp_plateau": _config(_mlp_plan, _plateau),  # 2 ranks (torchrun)
    "lenet_adaptive_batch_process": _config(
        lambda: _lenet_plan(executor="process", cpu_conv="auto"), data=_mnist, epochs=2,
        policies=[AdaptiveBatchSize(max_batch_size=64, cooldown_epochs=0.05, settle_windows=2)]),
}


# -- one run (a child process) -----------------------------------------------------------------

class _Killer(cg.Hook):
    """Sends ``sig`` to this process at round ``at``'s ``phase`` (module docstring); disarmed
    with ``at`` < 0. Present in every run of a configuration (hook state is keyed by position)."""

    def __init__(self, sig: int, at: int, phase: str) -> None:
        self.sig, self.at, self.phase, self.plan = sig, at, phase, None

    def fire(self, phase: str, rounds_done: int, exact: bool = True) -> None:
        if self.at >= 0 and phase == self.phase and (rounds_done == self.at if exact
                                                     else rounds_done >= self.at):
            self.at = -1  # once (SIGTERM: the fit goes on to the round's end)
            os.kill(os.getpid(), self.sig)

    def before_fit(self, ctx) -> None:
        self.plan = ctx.plan
        if self.phase == "time":
            print("started", flush=True)

    def after_round(self, ctx) -> None:
        self.fire("round", ctx.plan.rounds_done)

    def before_round(self, ctx) -> None:
        self.fire("next", ctx.plan.rounds_done)

    def after_epoch(self, ctx, record) -> None:
        self.fire("epoch", ctx.plan.rounds_done, exact=False)

    def metric(self, output, target) -> float:
        self.fire("eval", self.plan.rounds_done, exact=False)
        return float((output.argmax(1) == target).float().mean())


def _history(h: cg.History) -> Any:
    """The History as plain values without its clocks."""
    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in _CLOCKS}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return strip(h.to_dict())


def _child(name: str, out: str, ckpt: str | None, kill: str, resume: bool, every: int) -> int:
    rank0 = os.environ.get("RANK", "0") == "0"  # under torchrun rank 0 is killed and reports
    sig, at, phase = kill.split(":") if kill and rank0 else ("KILL", "-1", "round")
    killer = _Killer(getattr(signal, f"SIG{sig}"), int(at), phase)
    plan, kw = CONFIGS[name]()
    kw = dict(kw, hooks=[killer], metric_fn=killer.metric)
    if ckpt is not None:
        kw.update(checkpoint_dir=ckpt, checkpoint_every=every, resume=resume)
    try:
        history = plan.fit(**kw)
    except TrainingInterrupted:
        return 143
    if not rank0:
        return 0
    state = plan.state_dict()
    tensors = {f"{d}.{k}": s[k] for d, s in enumerate(state["states"])
               for k in ("w", "v", "z", "z_prev", "buf", "zbuf")}
    torch.save({"state": tensors, "history": _history(history)}, out)
    return 0


# -- the parent --------------------------------------------------------------------------------

def _run(args: list[str], kill_after_s: float | None = None) -> int:
    cmd = [sys.executable, os.path.abspath(__file__), "child", *args]
    if args[0].startswith("torchrun"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(port)] + cmd[1:]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if kill_after_s is not None:
        def kill_later() -> None:
            proc.stdout.readline()  # "started"
            time.sleep(kill_after_s)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        threading.Thread(target=kill_later, daemon=True).start()
    _, err = proc.communicate()
    if proc.returncode not in (0, 143, -9, 1):
        sys.stderr.write(err[-3000:])
    return proc.returncode


def _differences(a: dict, b: dict) -> list[str]:
    state = [k for k in a["state"] if not torch.equal(a["state"][k], b["state"][k])]
    hist = [k for k in a["history"] if a["history"][k] != b["history"].get(k)]
    return ([f"state {', '.join(state)}"] if state else []) + \
        ([f"history {', '.join(hist)}"] if hist else [])


def _first_difference(a: Any, b: Any, where: str = "") -> str:
    """Where two plain values first differ, and both values there."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a:
            if a[k] != b.get(k):
                return _first_difference(a[k], b.get(k), f"{where}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{where}[{i}]")
    return f"{where}: {str(a)[:300]} != {str(b)[:300]}"


def _case(name: str, whole: dict, rng: random.Random, work: str, i: int) -> tuple[str, list[str]]:
    rounds = max(whole["history"]["epochs"][-1]["rounds"], 1) * len(whole["history"]["epochs"])
    phase = rng.choice(PHASES[:-1] if name.startswith("torchrun") else PHASES)  # (rank 0's pid)
    sig = "KILL" if phase == "time" else rng.choice(["KILL", "TERM"])
    at = rng.randrange(1, max(2, rounds - 1))
    every = rng.choice([1, 4, 8, 11])
    ckpt, out = os.path.join(work, f"ckpt{i}"), os.path.join(work, f"out{i}.pt")
    label = f"{name} {sig} {phase} {at if phase != 'time' else f'{at * 0.03:.1f}s'} every {every}"
    if phase == "time":
        rc = _run([name, out, ckpt, f"KILL:-1:time", "0", str(every)], kill_after_s=at * 0.03)
    else:
        rc = _run([name, out, ckpt, f"{sig}:{at}:{phase}", "0", str(every)])
    if rc == 0:
        return label + " (not reached)", []
    rc2 = _run([name, out, ckpt, "", "1", str(every)])
    if rc2 != 0:
        return label, [f"the resumed run exited {rc2}"]
    return label + f" (exit {rc})", _differences(whole, torch.load(out, weights_only=False))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "child":
        name, out, ckpt, kill, resume, every = argv[1:]
        return _child(name, out, None if ckpt == "-" else ckpt, kill, resume == "1", int(every))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=26)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="print each History's first "
                        "difference")
    parser.add_argument("--configs", nargs="*", choices=sorted(CONFIGS), default=sorted(CONFIGS))
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    bad = 0
    summary = {"cases": 0, "state_identical": 0, "history_identical": 0}
    with tempfile.TemporaryDirectory() as work:
        wholes = {}
        for name in args.configs:
            out = os.path.join(work, f"{name}-whole.pt")
            assert _run([name, out, "-", "", "0", "1"]) == 0, name
            wholes[name] = torch.load(out, weights_only=False)
        for i in range(args.cases):
            name = args.configs[i % len(args.configs)]
            label, diffs = _case(name, wholes[name], rng, work, i)
            summary["cases"] += 1
            summary["state_identical"] += not any(d.startswith("state") for d in diffs)
            summary["history_identical"] += not any(d.startswith("history") for d in diffs)
            bad += bool(diffs)
            print(f"{label:60s} {'identical' if not diffs else 'DIFFERS: ' + '; '.join(diffs)}",
                  flush=True)
            if diffs and args.verbose:
                resumed = torch.load(os.path.join(work, f"out{i}.pt"), weights_only=False)
                print("    " + _first_difference(wholes[name]["history"], resumed["history"]))
    print(json.dumps(summary))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
