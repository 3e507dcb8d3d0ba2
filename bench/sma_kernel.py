"""Benchmark of the SMA update (docs/design-overview.md §2 steps 1–3, §4; protocol in docs/benchmarking.md).

CPU: the C kernels (kernels/sma_cpu.c, the CPU default when a C compiler is there) and the
vectorised torch implementation on flat ``[m, P]`` buffers (kernels/torch_ref.py) against a naive loop
over replicas and parameter tensors (what a user without flat buffers writes), one whole round
each: the local step + correction of every replica, the device sum, the central update. Reports
the median time per round of each and their ratios.

CUDA: the fused Triton kernels (kernels/triton_sma.py) and the torch implementation, on rows padded
to a multiple of 32 elements as a CUDA DeviceState holds them (the Triton kernel on contiguous rows
too, "P-apart"); for the local kernel, achieved bytes/s against the floor of ((3m+1) reads +
(2m+1) writes) × 4P bytes per round (W, V, G of every replica and Z read; W, V of every replica
and acc_d written), and that as a fraction of the bandwidth of a plain device-to-device copy
measured in the same run. Every timed launch follows a 256 MiB read (``L2Flush``), so its data
comes from memory, not from the L2 cache (LeNet-5's whole working set fits in an H200's 60 MB L2),
and is timed alone by CUDA events.

Sizes: LeNet-5 (61,706), ResNet-32 (464,154), ResNet-50 (25,557,032) parameter tensors, built
from the real layer shapes; m ∈ {1, 2, 4, 8}. A and B are interleaved (A B A B …) and medians
reported. Prints a table; writes JSON under bench/runs/ (not committed).

    python bench/sma_kernel.py                 # CPU (ResNet-50 only at m ≤ 2: memory, time)
    python bench/sma_kernel.py --device cuda   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's crossbow_graph

from crossbow_graph.engine.state.flat import row_length  # noqa: E402
from crossbow_graph.kernels.c_sma import CSMAKernels  # noqa: E402
from crossbow_graph.kernels.torch_ref import (TorchSMAKernels, sma_central_update, sma_local_update)  # noqa: E402

__all__ = ["model_shapes", "naive_round", "bench_cuda", "copy_bandwidth", "nominal_bandwidth",
           "L2Flush", "main"]

LR, MOMENTUM, MU_Z = 0.01, 0.9, 0.9


def _resnet_cifar(n: int = 5) -> list[tuple[int, ...]]:
    """ResNet-6n+2 for CIFAR (He et al. 2016, §4.2; option-A shortcuts): 464,154 for n = 5."""
    shapes = [(16, 3, 3, 3), (16,), (16,)]
    c_in = 16
    for width in (16, 32, 64):
        for _ in range(n):
            shapes += [(width, c_in, 3, 3), (width,), (width,), (width, width, 3, 3), (width,), (width,)]
            c_in = width
    return shapes + [(10, 64), (10,)]


def _resnet50() -> list[tuple[int, ...]]:
    """ResNet-50 (He et al. 2016, torchvision layout, 1000 classes): 25,557,032 parameters."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    c_in = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(width, c_in, 1, 1), (width,), (width,), (width, width, 3, 3), (width,),
                       (width,), (4 * width, width, 1, 1), (4 * width,), (4 * width,)]
            if b == 0:
                shapes += [(4 * width, c_in, 1, 1), (4 * width,), (4 * width,)]
            c_in = 4 * width
    return shapes + [(1000, 2048), (1000,)]


def model_shapes() -> dict[str, list[tuple[int, ...]]]:
    """Parameter tensor shapes by model name."""
    from crossbow_graph.models import lenet5

    return {"lenet5": [tuple(p.shape) for p in lenet5().parameters()],
            "resnet32": _resnet_cifar(5), "resnet50": _resnet50()}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@torch.no_grad()
def naive_round(params, grads, bufs, z, z_prev, *, lr, momentum, alpha, central_momentum):
    """One SMA round, a tensor at a time: ``params[j][i]`` is replica j's i-th parameter tensor
    (likewise ``grads``, ``bufs``); ``z[i]``, ``z_prev[i]`` the central model's."""
    acc = [torch.zeros_like(t) for t in z]
    for j in range(len(params)):
        for i, p in enumerate(params[j]):
            buf = bufs[j][i].mul_(momentum).add_(grads[j][i])
            c = (p - z[i]).mul_(alpha)
            acc[i].add_(c)
            p.add_(buf, alpha=-lr).sub_(c)
    for i in range(len(z)):
        step = acc[i].add(z[i] - z_prev[i], alpha=central_momentum)
        z_prev[i].copy_(z[i])
        z[i].add_(step)


def _flat_round(backend, w, v, g, z, z_prev, *, alpha):
    acc = backend.local_update(w, v, g, z, lr=LR, momentum=MOMENTUM, nesterov=False,
                               weight_decay=0.0, alpha=alpha)
    backend.central_update(z, z_prev, acc, central_momentum=MU_Z)


_Torch = TorchSMAKernels()  # the flat torch implementation, as a backend


def round_floor_bytes(m: int, P: int) -> int:
    """Bytes a whole round must move: the local update's (3m+1) reads + (2m+1) writes and the
    central update's 3 reads (z, z_prev, C) + 2 writes, of 4P bytes each."""
    return ((3 * m + 1) + (2 * m + 1) + 5) * 4 * P


def cpu_copy_bandwidth(reps: int) -> float:
    """Bytes/s of a 256 MiB copy (read + write counted) on this thread, median of ``reps``."""
    src = torch.randn(2**26)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return statistics.median(2 * src.numel() * 4 / _time_cpu(lambda: dst.copy_(src), 0.2)
                             for _ in range(reps))


def _time_cpu(fn, min_s: float) -> float:
    """Seconds per call: calls repeated until ``min_s`` has passed."""
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return elapsed / n


def bench_cpu(name, shapes, m, reps, min_s):
    """Median seconds per round of the flat torch implementation and of the naive loop."""
    P = sum(_numel(s) for s in shapes)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(m, P, generator=gen)
    g = torch.randn(m, P, generator=gen) * 1e-3
    v = torch.zeros(m, P)
    z, z_prev = w.mean(0), w.mean(0)
    alpha = 1.0 / m

    def split(row):
        out, off = [], 0
        for s in shapes:
            out.append(row[off:off + _numel(s)].clone().view(s))
            off += _numel(s)
        return out

    params = [split(w[j]) for j in range(m)]  # separate tensors, as a user's replicas
    grads = [split(g[j]) for j in range(m)]
    bufs = [split(v[j]) for j in range(m)]
    zs, zps = split(z), split(z_prev)
    c_backend = CSMAKernels()
    wc, vc, zc, zpc = w.clone(), v.clone(), z.clone(), z_prev.clone()
    # same numbers first (one round each), then time
    _flat_round(_Torch, w, v, g, z, z_prev, alpha=alpha)
    naive_round(params, grads, bufs, zs, zps, lr=LR, momentum=MOMENTUM, alpha=alpha,
                central_momentum=MU_Z)
    torch.testing.assert_close(torch.cat([t.flatten() for t in zs]), z, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([t.flatten() for t in params[-1]]), w[-1], atol=1e-5,
                               rtol=1e-5)
    _flat_round(c_backend, wc, vc, g, zc, zpc, alpha=alpha)
    torch.testing.assert_close(zc, z, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wc, w, atol=1e-5, rtol=1e-5)

    def flat():
        _flat_round(_Torch, w, v, g, z, z_prev, alpha=alpha)

    def c_round():
        _flat_round(c_backend, wc, vc, g, zc, zpc, alpha=alpha)

    def naive():
        naive_round(params, grads, bufs, zs, zps, lr=LR, momentum=MOMENTUM, alpha=alpha,
                    central_momentum=MU_Z)

    flat_s, naive_s, c_s = [], [], []
    _time_cpu(flat, min_s), _time_cpu(naive, min_s), _time_cpu(c_round, min_s)  # warm-up
    for _ in range(reps):  # interleaved A B C A B C
        flat_s.append(_time_cpu(flat, min_s))
        naive_s.append(_time_cpu(naive, min_s))
        c_s.append(_time_cpu(c_round, min_s))
    f, n, c = statistics.median(flat_s), statistics.median(naive_s), statistics.median(c_s)
    floor = round_floor_bytes(m, P)
    return {"model": name, "m": m, "P": P, "tensors": len(shapes), "floor_bytes": floor,
            "torch_flat_bytes_per_s": floor / f, "torch_flat_s": f,
            "c_s": c, "c_bytes_per_s": floor / c, "ratio_flat_over_c": f / c,
            "naive_loop_s": n, "ratio_naive_over_flat": n / f,
            "spread_flat_s": [min(flat_s), max(flat_s)], "spread_naive_s": [min(naive_s), max(naive_s)]}


L2_FLUSH_BYTES = 256 * 2**20  # over 4× the 50–60 MB L2 of an H100/H200
HEAD_START_CYCLES = 1_000_000  # ~0.5 ms of GPU sleep: the host queues the timed launch meanwhile


class L2Flush:
    """Evicts the GPU's L2 cache before a timed launch: reads a buffer of ``nbytes`` (reading, so
    that the evicted lines are clean and no write-back of the flush's own data falls in the timed
    launch), then sleeps ``HEAD_START_CYCLES`` so that the host has queued the launch when the GPU
    reaches it (the time measured is the GPU's, not the host's launch overhead).

    Args:
        device: where the timed kernels run; on a CPU device the flush reads its buffer and the
            timer is the host clock (the smoke run of bench/gpu_acceptance.sh).
        nbytes: the buffer's size in bytes.
    """

    def __init__(self, device: torch.device | str = "cuda", nbytes: int = L2_FLUSH_BYTES) -> None:
        self.device = torch.device(device)
        self.buf = torch.ones(nbytes // 4, device=self.device)  # [nbytes / 4] float32
        self.sink = torch.empty((), device=self.device)

    def __call__(self) -> None:
        torch.sum(self.buf, dim=0, out=self.sink)
        if self.device.type == "cuda":
            torch.cuda._sleep(HEAD_START_CYCLES)


def _time_launches(fn, iters: int, flush: L2Flush) -> float:
    """Median seconds of one call of ``fn`` over ``iters`` calls, each after ``flush()`` (its data
    out of L2); on CUDA timed by events around the call alone."""
    if flush.device.type != "cuda":
        times = []
        for _ in range(iters):
            flush()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        flush()
        start.record()
        fn()
        end.record()
    events[-1][1].synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def _time_cuda(fn, iters: int) -> float:
    """Mean seconds per call of ``fn`` over ``iters`` back-to-back calls (a large copy's rate)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def copy_bandwidth(reps: int) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted), the median of ``reps``."""
    src = torch.empty(2**28, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    return statistics.median(2 * src.numel() * 4 / _time_cuda(lambda: dst.copy_(src), 20)
                             for _ in range(reps))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t [m, P]`` in rows ``row_length(P)`` apart, as a CUDA DeviceState allocates them."""
    m, P = t.shape
    full = torch.zeros(m, row_length(P, t.device), dtype=t.dtype, device=t.device)
    full[:, :P] = t
    return full[:, :P]


def nominal_bandwidth() -> float | None:
    """The GPU's nominal memory bandwidth in bytes/s: 2 (double data rate) × memory clock ×
    bus width (H200: 2 × 3.2 GHz × 6144 bits ≈ 4.9 TB/s); None where torch does not report them."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None


def bench_cuda(name, P, m, reps, iters, peak, device="cuda", flush: L2Flush | None = None):
    """Median seconds of one Triton local update on padded rows (what a CUDA DeviceState holds)
    and on contiguous rows, of one torch local update, and of the central updates, with their
    data out of L2 (``flush`` before each launch); bytes/s against the floor and ``peak``
    (bytes/s, e.g. the copy bandwidth; None: no fraction). On a CPU ``device`` the Triton
    kernels run in its interpreter (a check of the code path, not a bandwidth)."""
    from crossbow_graph.kernels.triton_sma import TritonSMAKernels

    flush = flush or L2Flush(device)
    tri = TritonSMAKernels()
    dev = torch.device(device)
    w = _rows(torch.randn(m, P, device=dev))  # [m, P], rows padded as engine/state/flat.py pads them
    v, g = _rows(torch.zeros(m, P, device=dev)), _rows(torch.randn(m, P, device=dev) * 1e-3)
    w_c, v_c, g_c = w.contiguous(), v.contiguous(), g.contiguous()  # rows P apart
    z, z_prev = w.mean(0), w.mean(0)
    c = torch.zeros_like(z)
    kw = dict(lr=LR, momentum=MOMENTUM, nesterov=False, weight_decay=0.0, alpha=1.0 / m)
    outs = []
    for backend in (tri, _Torch):  # compile, warm up, and the same numbers on copies
        wc, vc, zc, zpc = _rows(w.clone()), _rows(v.clone()), z.clone(), z_prev.clone()
        acc = backend.local_update(wc, vc, g, zc, **kw)
        backend.central_update(zc, zpc, acc, central_momentum=MU_Z)
        outs.append((wc, vc, zc, zpc))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    tri.local_update(w_c.clone(), v_c.clone(), g_c, z.clone(), **kw)  # compile the P-stride spec
    if w.is_cuda:
        torch.cuda.synchronize()
    t_tri, t_flat, t_torch, t_ctri, t_ctorch = [], [], [], [], []
    for _ in range(reps):  # interleaved A B A B
        t_tri.append(_time_launches(lambda: tri.local_update(w, v, g, z, **kw), iters, flush))
        t_flat.append(_time_launches(lambda: tri.local_update(w_c, v_c, g_c, z, **kw), iters, flush))
        t_torch.append(_time_launches(lambda: sma_local_update(w, v, g, z, **kw), iters, flush))
        t_ctri.append(_time_launches(lambda: tri.central_update(z, z_prev, c, central_momentum=MU_Z),
                                     iters, flush))
        t_ctorch.append(_time_launches(lambda: sma_central_update(z, z_prev, c, central_momentum=MU_Z),
                                       iters, flush))
    floor = ((3 * m + 1) + (2 * m + 1)) * 4 * P
    central_floor = 5 * 4 * P  # z, z_prev, C read; z, z_prev written
    tt, to = statistics.median(t_tri), statistics.median(t_torch)
    tc = statistics.median(t_ctri)
    return {"model": name, "m": m, "P": P, "floor_bytes": floor, "triton_local_s": tt,
            "torch_local_s": to, "triton_bytes_per_s": floor / tt, "torch_bytes_per_s": floor / to,
            "triton_fraction_of_copy_bw": floor / tt / peak if peak else None,
            "torch_over_triton": to / tt,
            "triton_contiguous_rows_local_s": statistics.median(t_flat),
            "triton_central_s": tc, "triton_central_bytes_per_s": central_floor / tc,
            "torch_central_s": statistics.median(t_ctorch),
            "spread_triton_local_s": [min(t_tri), max(t_tri)], "l2_flushed": True}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--models", default="lenet5,resnet32,resnet50")
    ap.add_argument("--replicas", default="1,2,4,8", help="values of m")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions (median)")
    ap.add_argument("--min-s", type=float, default=0.05, help="CPU: seconds per repetition")
    ap.add_argument("--iters", type=int, default=50, help="CUDA: launches per repetition")
    ap.add_argument("--cpu-max-elements", type=float, default=6e7,
                    help="CPU: skip configurations with m·P above this (memory, time)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU: torch intra-op threads (1: on a shared 2-core machine, 2 threads "
                         "that wait on each other's core made rounds ~500× slower)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/runs/...)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    shapes = model_shapes()
    ms = [int(x) for x in args.replicas.split(",")]
    names = args.models.split(",")
    rows, meta = [], {"device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "host": platform.node(), "utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      "reps": args.reps, "lr": LR, "momentum": MOMENTUM, "central_momentum": MU_Z}
    if args.device == "cpu":
        copy_bw = cpu_copy_bandwidth(args.reps)
        meta["copy_bytes_per_s"] = copy_bw
        print(f"CPU, {args.threads} thread(s): 256 MiB copy {copy_bw / 1e9:.1f} GB/s; GB/s below = "
              "round floor ((3m+1)+(2m+1)+5)·4P bytes / flat torch time")
        print(f"{'model':<10}{'m':>3}{'P':>12}{'tensors':>8}{'C ms':>9}{'GB/s':>7}{'flat torch ms':>15}"
              f"{'GB/s':>7}{'torch/C':>9}{'naive loop ms':>15}{'naive/flat':>12}")
        for name in names:
            P = sum(_numel(s) for s in shapes[name])
            for m in ms:
                if m * P > args.cpu_max_elements:
                    print(f"{name:<10}{m:>3}{P:>12,}   skipped: m·P > {args.cpu_max_elements:.0e}")
                    continue
                r = bench_cpu(name, shapes[name], m, args.reps, args.min_s)
                rows.append(r)
                print(f"{name:<10}{m:>3}{P:>12,}{r['tensors']:>8}{r['c_s'] * 1e3:>9.3f}"
                      f"{r['c_bytes_per_s'] / 1e9:>7.1f}{r['torch_flat_s'] * 1e3:>15.3f}"
                      f"{r['torch_flat_bytes_per_s'] / 1e9:>7.1f}{r['ratio_flat_over_c']:>9.2f}"
                      f"{r['naive_loop_s'] * 1e3:>15.3f}{r['ratio_naive_over_flat']:>12.2f}")
        if rows:
            ratios = [r["ratio_naive_over_flat"] for r in rows]
            meta["median_ratio_naive_over_flat"] = statistics.median(ratios)
            meta["median_ratio_flat_over_c"] = statistics.median(r["ratio_flat_over_c"] for r in rows)
            print(f"median naive/flat over {len(rows)} configurations: {statistics.median(ratios):.2f}×; "
                  f"torch/C: {meta['median_ratio_flat_over_c']:.2f}×")
    else:
        import triton

        meta["triton"] = triton.__version__
        meta["gpu"] = torch.cuda.get_device_name()
        peak = copy_bandwidth(args.reps)
        meta["copy_bytes_per_s"] = peak
        meta["nominal_bytes_per_s"] = nominal_bandwidth()
        flush = L2Flush("cuda")
        print(f"{meta['gpu']}: device-to-device copy {peak / 1e9:,.0f} GB/s; each timed launch "
              f"after a {L2_FLUSH_BYTES >> 20} MiB read (its data out of L2)")
        print("triton: rows padded to 32 elements (engine/state/flat.py); P-apart: contiguous rows")
        print(f"{'model':<10}{'m':>3}{'P':>12}{'triton µs':>11}{'GB/s':>8}{'of copy':>9}"
              f"{'P-apart µs':>12}{'torch µs':>10}{'GB/s':>8}{'torch/tri':>10}"
              f"{'central tri/torch µs':>22}")
        for name in names:
            P = sum(_numel(s) for s in shapes[name])
            for m in ms:
                r = bench_cuda(name, P, m, args.reps, args.iters, peak, flush=flush)
                rows.append(r)
                print(f"{name:<10}{m:>3}{P:>12,}{r['triton_local_s'] * 1e6:>11.1f}"
                      f"{r['triton_bytes_per_s'] / 1e9:>8.0f}{r['triton_fraction_of_copy_bw']:>9.0%}"
                      f"{r['triton_contiguous_rows_local_s'] * 1e6:>12.1f}"
                      f"{r['torch_local_s'] * 1e6:>10.1f}{r['torch_bytes_per_s'] / 1e9:>8.0f}"
                      f"{r['torch_over_triton']:>10.2f}"
                      f"{r['triton_central_s'] * 1e6:>11.1f}/{r['torch_central_s'] * 1e6:<10.1f}")
    out = Path(args.out) if args.out else ROOT / "bench" / "runs" / (
        f"sma_kernel_{args.device}_{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {os.path.relpath(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
