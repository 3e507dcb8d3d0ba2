"""The GPU acceptance check's memory section (bench/gpu_acceptance.py runs it): (a) a plan's
measured peak against the compiler's estimate at m ∈ {1, 8, 32} (LeNet-5, b = 16, graph rounds:
its m rows, per-stream workspaces, the graph pool, pinned staging), (b) ``memory_reserved()``
flat over 500 graph rounds, (c) flat over 200 rounds after a failed capture (a model that
synchronises its stream: the warm-up's probe cannot see it, the capture fails)."""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any

import torch
from torch import nn

import crossbow_graph as cg
from acceptance_common import Section, card_facts, compile_plan, device_of, md_table, synthetic
from crossbow_graph.engine.capture_check import SimulatedGraphs
from crossbow_graph.engine.graphs import RoundGraph
from crossbow_graph.engine.race_check import RaceRecorder

__all__ = ["section_memory", "PEAK_OVER_ESTIMATE", "SyncLeNet", "ItemLeNet"]

PEAK_OVER_ESTIMATE = 1.25  # the measured peak may exceed the estimate by this much (memcheck's band)
PEAK_REPLICAS = (1, 8, 32)


class SyncLeNet(cg.models.LeNet5):
    """LeNet-5 whose forward synchronises its stream: no aten op, so the warm-up's probe does not
    see it, and a capturing stream cannot be synchronised: the capture fails."""

    def forward(self, x):
        torch.cuda.current_stream().synchronize()
        return super().forward(x)


class ItemLeNet(cg.models.LeNet5):
    """LeNet-5 whose forward reads a value on the host (the smoke run's uncapturable model: the
    warm-up's probe finds it, and no capture starts)."""

    def forward(self, x):
        return super().forward(x) * (1.0 + 0.0 * float(x.abs().max()))


class _Reserved(cg.Hook):
    """``torch.cuda.memory_reserved()`` after the rounds ``at`` (CUDA; None on the CPU); stops
    the fit after the last."""

    mutates_replicas = False

    def __init__(self, device: torch.device, at: tuple[int, ...]) -> None:
        self.device, self.at, self.reserved = device, at, {}

    def after_round(self, ctx) -> None:
        done = ctx.plan.rounds_done
        if done in self.at:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.reserved[done] = (torch.cuda.memory_reserved(self.device)
                                   if self.device.type == "cuda" else None)
        ctx.stop = ctx.stop or done >= self.at[-1]


def _graph_plan(model, device: torch.device, m: int, b: int) -> tuple[cg.Plan, Any]:
    """``model`` (LeNet-5-shaped) on ``device`` in graph rounds, and the context to fit it in:
    CUDA graphs on a GPU; on the CPU simulated graphs on simulated streams (a RaceRecorder)."""
    torch.manual_seed(0)
    cuda = device.type == "cuda"
    plan = cg.compile(model, (torch.randn(2, 1, 28, 28),), nn.functional.cross_entropy,
                      batch_size=b, devices=["cuda:0" if cuda else "cpu:0"], replicas=m,
                      executor="inline", optimizer=cg.SGD(lr=0.01, momentum=0.9), cuda_graphs=cuda)
    if cuda:
        return plan, contextlib.nullcontext()
    recorder = RaceRecorder().attach(plan.scheduler)
    plan.scheduler.round_graph = RoundGraph(SimulatedGraphs())
    return plan, recorder


def _flat_rounds(sec: Section, device: torch.device, model, at: tuple[int, ...], data) -> dict:
    """A graph-rounds fit (m = 4) of ``model`` until round ``at[-1]``: the reserved memory at each
    round of ``at``, its captures and replays, and why graph rounds stopped (if they did)."""
    plan, context = _graph_plan(model, device, 4, 8 if device.type == "cpu" else 16)
    hook = _Reserved(device, at)
    epochs = -(-at[-1] * 4 * plan.batch_size // len(data))
    with context:
        plan.fit(data, epochs, progress=False, metrics_every=None, hooks=[hook])
    rg = plan.scheduler.round_graph
    return {"reserved": hook.reserved, "rounds": plan.rounds_done, "captures": rg.captures,
            "replays": rg.replays, "failure": rg.failure}


def _peak_rows(args, sec: Section, device: torch.device) -> list[list]:
    """(a): per m, the estimate (m × memory per learner) and, on a GPU, the peak allocated from
    the plan's compile through 12 graph rounds."""
    data = synthetic("lenet5", 4096 if not args.smoke else 512, device)
    rows = []
    for m in PEAK_REPLICAS if not args.smoke else (2,):
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        plan, context = _graph_plan(cg.models.lenet5(), device, m, 16 if not args.smoke else 8)
        estimate = m * int(plan.task_graph.graph["memory_per_learner_bytes"])
        with context:
            plan.fit(data, 1, progress=False, metrics_every=None,
                     hooks=[_Reserved(device, (6 if args.smoke else 12,))])
        peak = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            sec.check(peak <= PEAK_OVER_ESTIMATE * estimate,
                      f"m={m}: peak {peak / 2**20:.1f} MiB over {PEAK_OVER_ESTIMATE}× the estimate "
                      f"{estimate / 2**20:.1f} MiB")
        rows.append([m, f"{estimate / 2**20:.1f}", f"{peak / 2**20:.1f}" if peak else "—",
                     f"{peak / estimate:.2f}" if peak else "—",
                     plan.scheduler.round_graph.replays])
        del plan
    return rows


def section_memory(args, sec: Section) -> None:
    device, t0 = device_of(args), time.perf_counter()
    gpu = device.type == "cuda"
    rows = _peak_rows(args, sec, device)
    sec.tables[f"(a) LeNet-5 at b = {16 if gpu else 8} in graph rounds: peak allocated against the "
               f"estimate (limit {PEAK_OVER_ESTIMATE}×)"] = md_table(
        ["m", "estimate MiB", "peak MiB", "peak ÷ estimate", "replays"], rows)
    data = synthetic("lenet5", 8192 if gpu else 512, device)
    steady = _flat_rounds(sec, device, cg.models.lenet5(), (50, 550) if gpu else (5, 10), data)
    failed = _flat_rounds(sec, device, SyncLeNet() if gpu else ItemLeNet(),
                          (20, 220) if gpu else (5, 10), data)
    sec.data.update(peak=rows, steady=steady, failed=failed)
    sec.check(steady["replays"] > 0 and steady["failure"] is None,
              f"(b) graph rounds did not replay: {steady}")
    sec.check(failed["captures"] == 0 and failed["failure"] is not None,
              f"(c) the uncapturable model captured: {failed}")
    flat = []
    for label, r in (("(b) graph rounds", steady), ("(c) after a failed capture", failed)):
        (a, ra), (b, rb) = sorted(r["reserved"].items())
        if gpu:
            sec.check(ra == rb, f"{label}: memory_reserved() grew from {ra:,} to {rb:,} bytes "
                                f"between rounds {a} and {b}")
        flat.append([label, f"{a} → {b}", f"{ra:,} → {rb:,}" if gpu else "— (GPU only)",
                     r["captures"], r["replays"], r["failure"] or "—"])
    sec.tables["memory_reserved() over many rounds (LeNet-5, m = 4)"] = md_table(
        ["fit", "rounds", "bytes reserved", "captures", "replays", "why graph rounds stopped"], flat)
    card = card_facts(args.work).get("name", "the CPU")
    sec.key = (f"{card}: peak ÷ estimate {', '.join(r[3] for r in rows)} at m = "
               f"{', '.join(str(r[0]) for r in rows)}; reserved flat: " +
               ("yes" if gpu and not sec.failures else "GPU only" if not gpu else "see notes"))
    if not gpu:
        sec.notes.append("smoke: simulated graphs on the CPU; the peak, memory_reserved() and a "
                         "capture that fails after a clean warm-up need CUDA (here the warm-up's "
                         "probe stops the host read's capture before it starts)")
    sec.data["seconds"] = time.perf_counter() - t0
