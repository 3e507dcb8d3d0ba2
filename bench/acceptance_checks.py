"""The GPU acceptance check's correctness sections (bench/gpu_acceptance.py runs them).

- ``races``: (a) a short fit in each learner mode (BatchNorm, evaluation, checkpoints, metrics) in
  a child process under PyTorch's CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``: an unsynchronised
  access raises); (b) for each stream kind of ``engine.streams.STREAM_KINDS`` a seeded fit whose
  streams of that kind sleep ~20 ms (``torch.cuda._sleep``) before their work every round, against
  the same fit undelayed: w, z and zbuf must be equal bit for bit (and two undelayed fits too);
  fits ``RACE_SCENARIOS``: per_replica, fused, S-SGD with nothing between rounds, and one with
  evaluation, checkpoints and metrics reading the state on the default stream mid-fit.
- ``reference``: the same seeded fits on the GPU and on the CPU (kernel_backend "torch"; TF32 off,
  deterministic cuDNN) and kernel_backend "triton" against "torch" on the GPU, both learner modes:
  w, z, zbuf within rtol 1e-4, atol 1e-5.
- ``nccl``: torchrun with one rank; the rank joins an NCCL process group, fits through
  ``Distributed(backend="nccl")`` (z checksummed every round) and matches the same fit without it.

In a smoke run: the race probes with a ``RaceRecorder`` as the streams (engine/race_check.py: no
unordered access may be found), the "device" the CPU (Triton in its interpreter), gloo instead of
NCCL; the sanitizer's child runs unsanitised.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

import crossbow_graph as cg
from acceptance_common import (ATOL, RTOL, BNNet, Section, bitwise_equal, child_timeout, close,
                               compile_plan, device_of, exact, max_diff, md_table, state_of,
                               sync, synthetic)
from crossbow_graph.engine.race_check import RaceRecorder
from crossbow_graph.engine.streams import STREAM_KINDS

__all__ = ["section_races", "section_reference", "section_nccl", "run_sanitize", "run_nccl_rank",
           "DelayStream", "RACE_SCENARIOS", "sanitizer_timeout", "rank_timeout"]

DELAY_MS = 20.0  # the race probes' sleep per stream and round
CHILD_S = 25.0  # a child's least seconds: two imports of torch, CUDA (and NCCL) start, two fits


def sanitizer_timeout(budget_s: float) -> float | None:
    """The sanitizer child's limit in a races section of ``budget_s`` (the delay probes follow)."""
    return child_timeout(budget_s * 0.6, floor=CHILD_S)


def rank_timeout(budget_s: float) -> float | None:
    """The torchrun child's limit in an nccl section of ``budget_s``."""
    return child_timeout(budget_s - 2, floor=CHILD_S)
SCRIPT = str(Path(__file__).resolve().parent / "gpu_acceptance.py")  # the children's entry point


# -- races -------------------------------------------------------------------------------------

class DelayStream(cg.Hook):
    """Before every round, makes the streams of ``kind`` sleep ``cycles`` GPU cycles before their
    work (``CudaStreams.delay`` of the scheduler's streams, made here if the round has not made
    them yet); ``delayed_rounds`` counts the rounds that ran on those streams with the delay set."""

    mutates_replicas = False

    def __init__(self, kind: str, cycles: int) -> None:
        self.kind, self.cycles, self.streams, self.delayed_rounds = kind, cycles, None, 0

    def before_round(self, ctx) -> None:
        self.streams = ctx.plan.scheduler._streams()
        self.streams.delay[self.kind] = self.cycles

    def after_round(self, ctx) -> None:
        streams = ctx.plan.scheduler._streams()
        self.delayed_rounds += streams is self.streams and streams.delay.get(self.kind) == self.cycles


_READERS = dict(evals_per_epoch=2, checkpoint_every=3, metrics_every=2)  # D's reads mid-fit
RACE_SCENARIOS = {  # name → (compile keywords, fit keywords); all but the last: nothing between rounds
    "per_replica, SMA": (dict(learner_mode="per_replica"), {}),
    "fused, SMA": (dict(learner_mode="fused"), {}),
    "per_replica, S-SGD": (dict(learner_mode="per_replica", sync=cg.SSGD()), {}),
    "per_replica, SMA, evaluation, checkpoints, metrics": (dict(learner_mode="per_replica"), _READERS),
}


def probe_fit(scenario: str, device: torch.device, tmp: Path, *, smoke: bool,
              kind: str | None = None, cycles: int = 0, kernel_backend: str = "auto") -> dict:
    """A seeded fit of BNNet (m = 2, 8 rounds of b = 8; smoke: b = 4) as ``RACE_SCENARIOS``
    says, evaluated at its end; with ``kind``, that kind of stream delayed. Returns its state,
    wall seconds, rounds, the races a RaceRecorder found (smoke) and the rounds delayed."""
    compile_kw, fit_kw = RACE_SCENARIOS[scenario]
    b = 4 if smoke else 8
    data, evals = synthetic("bnnet", 8 * 2 * b, device), synthetic("bnnet", 16, device, seed=1)
    plan = compile_plan("bnnet", device, b=b, kernel_backend="torch" if smoke else kernel_backend,
                    **compile_kw)
    rec = RaceRecorder().attach(plan.scheduler) if smoke else None
    hooks = [DelayStream(kind, cycles)] if kind else []
    shutil.rmtree(tmp, ignore_errors=True)  # each probe a fresh run: a fit refuses another's
    tmp.mkdir(parents=True)                 # checkpoints (docs/reliability.md)
    sync(device)
    t0 = time.perf_counter()
    with rec if rec is not None else contextlib.nullcontext():
        plan.fit(data, 1, seed=0, progress=False, hooks=hooks, eval_dataset=evals,
                 checkpoint_dir=str(tmp), **{"evals_per_epoch": 1, "metrics_every": None} | fit_kw)
        state = state_of(plan)
    seconds = time.perf_counter() - t0
    return {"state": state, "seconds": seconds, "rounds": plan.rounds_done,
            "races": [str(r) for r in rec.races] if rec is not None else [],
            "delayed_rounds": hooks[0].delayed_rounds if hooks else 0}


def sleep_cycles(ms: float) -> int:
    """GPU cycles of ``torch.cuda._sleep`` that last about ``ms`` milliseconds (measured)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    for _ in range(2):  # the first wakes the clocks
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
    return int(cycles * ms / start.elapsed_time(end))


def _delay_probes(args, sec: Section, device: torch.device, tmp: Path, stop_at: float) -> list[list]:
    """(b): each scenario's fit undelayed (twice on a GPU: the fits are deterministic) and with
    each stream kind delayed; every round must run with the delay, and change nothing."""
    cycles = 0 if args.smoke else sleep_cycles(DELAY_MS)
    sec.data["sleep_cycles"] = cycles
    rows = []
    for i, scenario in enumerate(RACE_SCENARIOS):
        if time.perf_counter() > stop_at:
            sec.notes.append(f"{scenario}: not probed (over the section's {args.budget_s:.0f} s)")
            continue
        try:
            base = probe_fit(scenario, device, tmp / "base", smoke=args.smoke)
        except Exception as exc:
            sec.check(False, f"{scenario}, undelayed: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        # smoke: the sleep is simulated (the RaceRecorder orders by events, not time), so one
        # kind per scenario, in turn, exercises each kind's DelayStream
        kinds = STREAM_KINDS if not args.smoke else STREAM_KINDS[i % len(STREAM_KINDS):][:1]
        runs = [("undelayed again", None)] * (not args.smoke) + [(k, k) for k in kinds]
        for label, kind in runs:
            try:
                r = probe_fit(scenario, device, tmp / label.replace(" ", "_"), smoke=args.smoke,
                              kind=kind, cycles=cycles)
            except Exception as exc:
                sec.check(False, f"{scenario}, {label}: {type(exc).__name__}: {str(exc)[:300]}")
                rows.append([scenario, label, "error", "—", "—", "—"])
                continue
            same = bitwise_equal(r["state"], base["state"])
            sec.check(same, f"{scenario}: {label}: w, z or zbuf differ from the undelayed fit "
                            f"(max |Δ| {max_diff(r['state'], base['state']):.3g})")
            sec.check(not base["races"] and not r["races"],
                      f"{scenario}, {label}: unordered accesses: {(base['races'] + r['races'])[:3]}")
            if kind is not None:
                sec.check(r["delayed_rounds"] == r["rounds"], f"{scenario}: {kind} delayed in "
                          f"{r['delayed_rounds']} of {r['rounds']} rounds")
            extra = "—" if args.smoke else f"{1e3 * (r['seconds'] - base['seconds']):+.0f}"
            races = "—" if not args.smoke else str(len(base["races"]) + len(r["races"]))
            rows.append([scenario, label, "equal" if same else "DIFFER",
                         f"{r['delayed_rounds']} of {r['rounds']}" if kind else "—", extra, races])
    return rows


def _sanitizer_probe(args, sec: Section, tmp: Path) -> list[list]:
    """(a): the child process ``sanitize`` under TORCH_CUDA_SANITIZER=1 (a smoke run: its fits in
    this process, unsanitised)."""
    if args.smoke:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = run_sanitize(argparse.Namespace(work=tmp, smoke=True))
        out = out.getvalue()
    else:
        cmd = [sys.executable, SCRIPT, "sanitize", "--work", str(tmp)]
        try:
            proc = subprocess.run(cmd, env={**os.environ, "TORCH_CUDA_SANITIZER": "1"},
                                  capture_output=True, text=True,
                                  timeout=sanitizer_timeout(args.budget_s))
            out, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out, rc = f"{exc.stdout or ''}{exc.stderr or ''}\ntimed out", 124
    print(out[-20_000:], flush=True)  # into acceptance.log
    results = [json.loads(line[len("SANITIZE "):]) for line in out.splitlines()
               if line.startswith("SANITIZE ")]
    sec.check(rc == 0 and len(results) == 2, f"sanitizer child exited {rc} with {len(results)} "
              "of 2 results (acceptance.log has its output)")
    rows = []
    for r in results:
        sec.check(r["ok"], f"sanitizer, {r['mode']}: {r['error']}")
        verdict = ("no race found" if r["ok"] else r["error"][:120]) if not args.smoke else \
            "ran unsanitised (the sanitizer needs CUDA)" if r["ok"] else r["error"][:120]
        rows.append([f"{r['mode']}, SMA", "TORCH_CUDA_SANITIZER=1", verdict])
    if args.smoke:
        sec.notes.append("skip (smoke): PyTorch's CUDA sanitizer needs CUDA; its fits ran "
                         "unsanitised on the CPU")
    return rows


def section_races(args, sec: Section) -> None:
    device = device_of(args)
    if not args.smoke:
        exact()
    tmp, stop_at = args.work / "races", time.perf_counter() + args.budget_s
    san = _sanitizer_probe(args, sec, tmp / "sanitize")
    sec.tables["(a) PyTorch's CUDA sanitizer (kernel_backend='torch', BatchNorm, evaluation, "
               "checkpoints, metrics)"] = md_table(["fit", "run", "result"], san)
    rows = _delay_probes(args, sec, device, tmp / "delay", stop_at)
    how = ("a RaceRecorder as the streams; the sleep is simulated" if args.smoke else
           f"each stream of the kind sleeps {DELAY_MS:.0f} ms ({sec.data['sleep_cycles']:,} "
           "cycles) before its work, every round")
    sec.tables[f"(b) delayed streams against the undelayed fit, bitwise ({how})"] = md_table(
        [f"fit (BNNet, m = 2, b = {4 if args.smoke else 8}, 8 rounds)", "delayed", "w, z, zbuf", "rounds delayed", "extra ms",
         "races found"], rows)
    bad = sum(1 for r in rows if r[2] != "equal")
    sec.key = f"{len(rows) - bad} of {len(rows)} fits bitwise equal to the undelayed one; sanitizer " + \
        ("clean" if all(r[2] in ("no race found",) for r in san) and san else
         "skipped (smoke)" if args.smoke else "found something")


def run_sanitize(args) -> int:
    """The child of the sanitizer probe: one short fit per learner mode, one JSON line each."""
    device = device_of(args)
    if not args.smoke:
        exact()
    for mode in ("per_replica", "fused"):
        data, evals = synthetic("bnnet", 64, device), synthetic("bnnet", 16, device, seed=1)
        try:
            plan = compile_plan("bnnet", device, kernel_backend="torch", learner_mode=mode)
            shutil.rmtree(args.work / mode, ignore_errors=True)  # a fresh run's directory
            plan.fit(data, 1, seed=0, progress=False, eval_dataset=evals, evals_per_epoch=1,
                     checkpoint_dir=str(args.work / mode), checkpoint_every=2, metrics_every=2)
            state_of(plan)
            result = {"mode": mode, "ok": True, "error": ""}
        except Exception as exc:  # CUDASanitizerErrors (maybe inside a TaskError), or a failure
            chain, e = [], exc
            while e is not None and len(chain) < 6:
                chain.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                e = e.__cause__ or e.__context__
            result = {"mode": mode, "ok": False, "error": " ← ".join(chain)[:600]}
        print("SANITIZE " + json.dumps(result), flush=True)
    return 0


# -- reference ---------------------------------------------------------------------------------

def _ref_fit(name: str, device: torch.device, mode: str, backend: str, rounds: int) -> dict:
    m, b = 2, 8
    plan = compile_plan(name, device, m=m, b=b, kernel_backend=backend, learner_mode=mode)
    plan.fit(synthetic(name, rounds * m * b, device), 1, shuffle=False, seed=0, progress=False,
             metrics_every=None)
    return state_of(plan)


def section_reference(args, sec: Section) -> None:
    device = device_of(args)
    exact()
    rounds = 4 if args.smoke else 8
    rows = []
    for name in ("bnnet", "lenet5"):
        for mode in ("per_replica", "fused"):
            try:
                ref = _ref_fit(name, torch.device("cpu"), mode, "torch", rounds)
                dev_torch = _ref_fit(name, device, mode, "torch", rounds)
                dev_triton = _ref_fit(name, device, mode, "triton", rounds)
            except Exception as exc:
                sec.check(False, f"{name}, {mode}: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            for label, a, b in ((f"{device.type} torch vs CPU torch", dev_torch, ref),
                                (f"{device.type} triton vs {device.type} torch", dev_triton, dev_torch)):
                ok = close(a, b)
                sec.check(ok, f"{name}, {mode}: {label}: max |Δ| {max_diff(a, b):.3g} over "
                              f"rtol {RTOL}, atol {ATOL}")
                rows.append([name, mode, label, f"{max_diff(a, b):.2e}", "yes" if ok else "NO"])
    sec.tables[f"w, z, zbuf after {rounds} rounds (m = 2, b = 8, SGD momentum 0.9; "
               f"rtol {RTOL}, atol {ATOL})"] = md_table(
        ["model", "learner mode", "comparison", "max |Δ|", "within"], rows)
    sec.data["rows"] = rows
    if args.smoke:
        sec.notes.append("smoke: the 'device' is the CPU (Triton in its interpreter)")
    worst = max((float(r[3]) for r in rows), default=float("nan"))
    sec.key = f"{sum(r[4] == 'yes' for r in rows)} of {len(rows)} within tolerance; max |Δ| {worst:.2e}"


# -- nccl --------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def section_nccl(args, sec: Section) -> None:
    result = args.work / "nccl-rank.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           SCRIPT, "nccl-rank", "--work", str(args.work)] + ["--smoke"] * args.smoke
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              timeout=rank_timeout(args.budget_s))
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, rc = f"{exc.stdout or ''}{exc.stderr or ''}\ntimed out", 124
    print(out[-20_000:], flush=True)
    if not sec.check(rc == 0 and result.exists(), f"torchrun exited {rc} (acceptance.log has its output)"):
        return
    r = json.loads(result.read_text())
    sec.data = r
    sec.check(r["backend"] == r["expected_backend"], f"the process group's backend is {r['backend']}, "
              f"not {r['expected_backend']}")
    sec.check(r["close"], f"z differs from the fit without the process group: max |Δ| {r['max_diff']:.3g}")
    sec.key = (f"{r['backend']}, 1 rank, {r['rounds']} rounds on {r['device']}, z checksummed every "
               f"round; against the fit without torch.distributed: max |Δ| {r['max_diff']:.2e}")
    sec.notes.append("the CLI under torchrun with one rank runs without a process group "
                     "(engine/comm.py torchrun_env: WORLD_SIZE 1), so the rank joins the group itself")
    if args.smoke:
        sec.notes.append("smoke: gloo on the CPU instead of NCCL")


def run_nccl_rank(args) -> int:
    """The torchrun rank: the fit without a process group, then with one (NCCL on a GPU)."""
    import torch.distributed as dist

    device = device_of(args)
    backend = "gloo" if args.smoke else "nccl"
    rounds, m, b = 8, 2, 8
    data, evals = synthetic("bnnet", rounds * m * b, device), synthetic("bnnet", 16, device, seed=1)
    fit = dict(shuffle=False, seed=0, progress=False, metrics_every=None, eval_dataset=evals)
    alone = compile_plan("bnnet", device, m=m, b=b)
    alone.fit(data, 1, **fit)
    z_alone = alone.central_weights().cpu()
    if device.type == "cuda":
        torch.cuda.setdevice_of(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, init_method="env://")
    try:
        torch.manual_seed(0)
        plan = cg.compile(BNNet(), (torch.randn(2, 1, 8, 8),), nn.functional.cross_entropy,
                          batch_size=b, devices="auto" if not args.smoke else 1, replicas=m,
                          executor="inline", optimizer=cg.SGD(lr=0.05, momentum=0.9),
                          distributed=cg.Distributed(backend=backend, checksum_every=1))
        assert plan.comm is not None, "the plan did not join the process group"
        plan.fit(data, 1, **fit)
        z = plan.central_weights().cpu()
        out = {"backend": plan.comm.backend, "expected_backend": backend, "rounds": plan.rounds_done,
               "device": plan.devices[0], "world_size": plan.comm.world_size,
               "max_diff": float((z - z_alone).abs().max()),
               "close": bool(torch.allclose(z, z_alone, rtol=1e-5, atol=1e-6))}
    finally:
        dist.destroy_process_group()
    (args.work / "nccl-rank.json").write_text(json.dumps(out))
    return 0
