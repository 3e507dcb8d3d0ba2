"""The sections of the GPU acceptance check, one subcommand each (bench/gpu_acceptance.sh runs them).

    python bench/gpu_acceptance.py SECTION --work DIR [--smoke] [--budget-s S]

Each section writes ``DIR/SECTION.json``: ``{"section", "status": "pass" | "fail" | "skip",
"key": one line of key numbers, "notes": [lines], "tables": {title: markdown}, "data": {...}}``
(``data["targets"]``: the decisive targets it checked); bench/acceptance_report.py turns them
into ``$OUT/summary.md``. A section exits 1 when it fails.

- ``env``: the GPU, torch, CUDA, cuDNN and Triton versions; the card's facts that scale the
  targets (its name, device-to-device copy GB/s, µs per node of a CUDA graph of tiny kernels, µs
  per eager launch); meanwhile, in a child process, the Triton kernels every later section
  launches are compiled in parallel for the card's compute capability
  (bench/acceptance_kernels.py, kernels/precompile.py).
- ``decisive``, ``bandwidth``, ``throughput``, ``profile``: bench/acceptance_speed.py.
- ``w1``: bench/acceptance_w1.py. ``memory``: bench/acceptance_memory.py.
- ``races``, ``reference``, ``nccl``: bench/acceptance_checks.py.

``--smoke`` runs every section on the CPU at tiny sizes (bench/gpu_acceptance.sh --smoke, in the
test suite): Triton in its interpreter (a few kernels compiled for sm_90 all the same), gloo
instead of NCCL, simulated streams and graphs; what only a GPU can do is recorded as skipped, and
each target as a check only a GPU can make.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import acceptance_checks as checks  # noqa: E402
import acceptance_memory  # noqa: E402
import acceptance_speed as speed  # noqa: E402
import acceptance_w1  # noqa: E402
import sma_kernel  # noqa: E402
from acceptance_common import Section  # noqa: E402

__all__ = ["main", "SECTIONS", "CHILDREN"]

SMOKE_PRECOMPILED = 1  # specs a smoke run compiles for sm_90 (the GPU run: every listed one)


def section_env(args, sec: Section) -> None:
    """Versions and the card's facts, while the child ``precompile`` compiles the kernels."""
    started = time.perf_counter()
    triton = _triton()
    child = _start_precompile(args) if triton is not None else None
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
        env["card"] = card_facts_measured(p.name)
    sec.data = env
    card = env.get("card", {})
    sec.key = (f"torch {env['torch']}, triton {triton_version}, {env.get('gpu', 'no GPU')}" +
               (f"; copy {card['copy_GBps']:,.0f} GB/s, {card['graph_node_us']:.2f} µs per graph "
                f"node, {card['eager_launch_us']:.1f} µs per eager launch" if card else ""))
    sec.check(args.smoke or torch.cuda.is_available(),
              "no CUDA GPU: run `bash bench/gpu_acceptance.sh --smoke` on a CPU")
    _wait_precompile(args, sec, child, started)


def card_facts_measured(name: str) -> dict:
    """The card's facts that scale the targets (bench/acceptance_speed.py): its name, the median
    device-to-device copy bandwidth (GB/s, read + write), µs per node of a replayed CUDA graph of
    200 dependent one-element adds, µs per eager launch of the same add (host-bound)."""
    x = torch.zeros(1, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(200):
            x.add_(1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    end.synchronize()
    node_us = start.elapsed_time(end) * 1e3 / (20 * 200)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2000):
        x.add_(1)
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - t0) * 1e6 / 2000
    return {"name": name, "copy_GBps": sma_kernel.copy_bandwidth(3) / 1e9,
            "graph_node_us": node_us, "eager_launch_us": eager_us}


def _triton():
    """The triton module, or None where it is not installed (the env section records it; the
    other sections import it only through the kernels, which say how to install it)."""
    try:
        return importlib.import_module("triton")
    except ImportError:
        return None


def _start_precompile(args) -> subprocess.Popen:
    """The child ``precompile``: forked compile workers, no CUDA."""
    cmd = [sys.executable, __file__, "precompile", "--work", str(args.work),
           "--arch", str(args.arch), "--budget-s", str(args.budget_s)] + ["--smoke"] * args.smoke
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_precompile(args, sec: Section, child: subprocess.Popen | None, started: float) -> None:
    if child is None:
        sec.notes.append("Triton not installed: no kernel precompiled")
        return
    left = None if math.isinf(args.budget_s) else max(1.0, args.budget_s - (time.perf_counter() - started))
    try:
        out, _ = child.communicate(timeout=left)
    except subprocess.TimeoutExpired:
        child.kill()
        out, _ = child.communicate()
    print(out[-5000:], flush=True)  # into acceptance.log
    path = args.work / "precompile.json"
    if not sec.check(child.returncode == 0 and path.exists(),
                     f"precompile child exited {child.returncode} (acceptance.log has its output)"):
        return
    done = json.loads(path.read_text())
    sec.data["precompile"] = done
    sec.notes.append(done["line"] + (f"; smoke: {done['listed']} listed for a GPU run"
                                     if args.smoke else ""))
    if done["failed"]:  # they compile at their first launch instead, as without precompiling
        sec.notes.append(f"kernels that did not precompile (JIT-compiled at their first launch "
                         f"instead): {done['failed'][:3]}")


def run_precompile(args) -> int:
    """The child of ``env``: the listed kernels (bench/acceptance_kernels.py) compiled for
    ``sm_<arch>`` on every CPU but one, within the budget; ``DIR/precompile.json``."""
    import acceptance_kernels
    from crossbow_graph.kernels.precompile import precompile

    specs = acceptance_kernels.acceptance_specs()
    todo = specs[:SMOKE_PRECOMPILED] if args.smoke else specs
    done = precompile(todo, arch=args.arch, workers=1 if args.smoke else None,
                      timeout_s=None if math.isinf(args.budget_s) else max(1.0, args.budget_s - 3))
    out = {"line": done.line(), "listed": len(specs), "compiled": len(done.compiled),
           "cached": len(done.cached), "failed": done.failed, "pending": len(done.pending),
           "seconds": done.seconds, "workers": done.workers, "arch": done.arch}
    (args.work / "precompile.json").write_text(json.dumps(out, indent=2))
    print(done.line(), flush=True)
    return 0


SECTIONS = {"env": section_env, "decisive": speed.section_decisive,
            "bandwidth": speed.section_bandwidth, "throughput": speed.section_throughput,
            "w1": acceptance_w1.section_w1, "memory": acceptance_memory.section_memory,
            "profile": speed.section_profile, "races": checks.section_races,
            "reference": checks.section_reference, "nccl": checks.section_nccl}
CHILDREN = {"sanitize": checks.run_sanitize, "nccl-rank": checks.run_nccl_rank,
            "stage-mnist": acceptance_w1.stage_mnist, "precompile": run_precompile}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("section", choices=[*SECTIONS, *CHILDREN])
    ap.add_argument("--work", type=Path, required=True, help="folder for the section's JSON")
    ap.add_argument("--smoke", action="store_true", help="on the CPU, tiny sizes")
    ap.add_argument("--budget-s", type=float, default=60.0,
                    help="seconds the section may take (it stops starting work after that)")
    ap.add_argument("--arch", type=int, default=90,
                    help="the compute capability the kernels are compiled for (90: sm_90)")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        torch.set_num_threads(1)
        args.budget_s = math.inf  # the smoke run is not timed: it runs every cell
    if args.section in CHILDREN:
        return CHILDREN[args.section](args)
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
