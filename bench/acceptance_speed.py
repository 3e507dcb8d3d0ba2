"""The GPU acceptance check's speed sections (bench/gpu_acceptance.py runs them): ``decisive``
(LeNet-5 at b = 16 in every system, its two targets checked), ``bandwidth`` (the SMA kernel
against the copy bandwidth, checked), ``throughput`` and ``profile`` (kernels and host µs per
round of the targets' systems: what explains a miss).

The targets (docs/benchmarking.md, "GPU acceptance") are first-principles figures for one H200
(``REFERENCE``); a launch-bound target scales with the card's measured µs per graph node against
the reference's, a bandwidth-bound one is a share of the card's measured copy bandwidth, and a
ratio needs no scaling. A section names the card it checked them on.
"""

from __future__ import annotations

import math
import time
from functools import partial

import torch
from torch.utils.data import TensorDataset

import acceptance_cells as cells
import sma_kernel
from acceptance_common import (Section, card_facts, device_of, fmt, md_table, model_of, run_cell,
                               synthetic)

__all__ = ["section_decisive", "section_throughput", "section_bandwidth", "section_profile",
           "REFERENCE", "graph_rate_target"]

# the targets' card, from first principles (not measured): its copy bandwidth and µs per node of
# a CUDA graph of tiny dependent kernels; a measured card's targets scale from these
REFERENCE = {"card": "H200", "copy_GBps": 4000.0, "graph_node_us": 1.5}
GRAPH_RATE = 200e3  # LeNet-5, b = 16, per_replica graph rounds at m = 4: samples/s on REFERENCE
FUSED_OVER_EAGER = 10.0  # fused graph rounds at m = 16 over plain eager, both at b = 16
KERNEL_SHARE = 0.8  # the SMA local kernel at ResNet-50's size, m = 8: of the measured copy GB/s
# plain PyTorch at b = 16 on REFERENCE (printed beside the cells, not checked)
PLAIN_RANGES = {"plain eager": (30e3, 55e3), "plain graph": (100e3, 180e3)}


def graph_rate_target(card: dict) -> tuple[float, str]:
    """The graph-rounds target on ``card`` (``card_facts``) and how it was scaled: launch-bound,
    so × the reference's µs per graph node over the card's."""
    node = card.get("graph_node_us")
    if not node:
        return GRAPH_RATE, f"{REFERENCE['card']} figure, unscaled (no launch latency measured)"
    scale = REFERENCE["graph_node_us"] / node
    return GRAPH_RATE * scale, (f"{GRAPH_RATE / 1e3:.0f} k on {REFERENCE['card']} × "
                                f"{REFERENCE['graph_node_us']} / {node:.2f} µs per graph node "
                                f"on {card.get('name', 'this card')}")


def _decisive_systems(args, data: TensorDataset, b: int) -> list[tuple[str, object]]:
    """LeNet-5 at b in every system, the targets' cells first."""
    seconds, warmup = (0.1, 5) if args.smoke else (0.4, 10)  # warm-up > 4: graphs replay
    ms = (4,) if args.smoke else (1, 4, 16, 32)
    cuda = not args.smoke
    big = 16 if cuda else 4

    def plain(graph):
        torch.manual_seed(0)
        rate = cells.plain_graph_rate if graph else cells.plain_rate
        return lambda: rate(model_of("lenet5"), b, data, seconds, warmup)

    def crossbow(mode, m, graphs):
        return lambda: cells.crossbow_rate(model_of("lenet5"), b, mode, data, seconds, warmup,
                                           m=m, graphs=graphs)

    first = [("plain eager", plain(False))] + [("plain graph", plain(True))] * cuda
    first += [("per_replica graphs m=4", crossbow("per_replica", 4, True)),
              (f"fused graphs m={big}", crossbow("fused", big, True))]
    done = {label for label, _ in first}
    rest = [(f"{mode} {'graphs' if g else 'eager'} m={m}", crossbow(mode, m, g))
            for m in ms for mode in ("per_replica", "fused") for g in (True, False)]
    return first + [(label, run) for label, run in rest if label not in done]


def section_decisive(args, sec: Section) -> None:
    """LeNet-5 at b = 16 in every system: plain eager and in one graph, crossbow_graph per_replica
    and fused, eager and in graph rounds, m ∈ {1, 4, 16, 32} (smoke: b = 8, m = 4); the
    targets: per_replica graph rounds at m = 4 ≥ 200 k samples/s (scaled to the card), fused
    graph rounds at m = 16 ≥ 10× plain eager."""
    start, device = time.perf_counter(), device_of(args)
    b = 8 if args.smoke else 16
    data = synthetic("lenet5", 512 if args.smoke else 8192, device)
    cell = {"model": "lenet5", "b": b}
    sec.data["cells"] = [cell]
    for label, run in _decisive_systems(args, data, b):
        if time.perf_counter() - start > args.budget_s:
            sec.notes.append(f"{label} not run: over the section's {args.budget_s:.0f} s")
            continue
        run_cell(sec, cell, label, run)
    _decisive_targets(args, sec, cell)
    rows = []
    for label in [k for k in cell if k not in ("model", "b") and not k.endswith(" graphs")]:
        low, high = PLAIN_RANGES.get(label, (None, None))
        rows.append([label, fmt(cell[label]), cell.get(f"{label} graphs", "—"),
                     "—" if low is None else f"{low / 1e3:.0f}–{high / 1e3:.0f} k on H200"])
    sec.tables[f"LeNet-5 at b = {b}, synthetic data on the device: samples/s"] = md_table(
        ["system", "samples/s", "CUDA graphs", "first-principles range"], rows)
    best = max((cell[k] for k in cell if "graphs m=" in k and not k.endswith(" graphs")
                and cell[k] == cell[k]), default=None)
    sec.key = (f"plain eager {fmt(cell.get('plain eager'))}, plain graph "
               f"{fmt(cell.get('plain graph'))}, best crossbow graph rounds {fmt(best)} samples/s")
    if args.smoke:
        sec.notes.append("smoke: graph rounds on simulated streams and graphs (the CPU has no "
                         "CUDA graphs; plain PyTorch's graph needs one); rates are not targets")


def _decisive_targets(args, sec: Section, cell: dict) -> None:
    card, gpu = card_facts(args.work), not args.smoke
    target, scale = graph_rate_target(card)
    sec.target("per_replica graph rounds, m = 4, LeNet-5 b = 16", cell.get("per_replica graphs m=4"),
               target, unit="samples/s", scale=scale, gpu=gpu, explain="per_replica, graph rounds, m=4")
    big = "fused graphs m=16" if gpu else "fused graphs m=4"
    eager = cell.get("plain eager")
    ratio = cell[big] / eager if cell.get(big) and eager and cell[big] == cell[big] else None
    sec.target("fused graph rounds at m = 16 over plain eager, LeNet-5 b = 16", ratio,
               FUSED_OVER_EAGER, unit="×", scale="a ratio on one card", gpu=gpu,
               explain="fused, graph rounds, m=16")


def section_throughput(args, sec: Section) -> None:
    """ResNet-32 and LeNet-5 at b = 16 and 32: plain at b and 4b, crossbow_graph m = 4 at b, eager
    and in graph rounds; then the data paths."""
    start, device = time.perf_counter(), device_of(args)
    grid = [("lenet5", 16)] if args.smoke else [("resnet32", 16), ("lenet5", 32)]
    seconds, warmup = (0.1, 5) if args.smoke else (0.25, 8)
    datasets = {n: synthetic(n, 512 if args.smoke else 8192, device) for n, _ in grid}

    def systems(n, b):
        data = datasets[n]
        out = [("plain b", lambda: cells.plain_rate(model_of(n), b, data, seconds, warmup))]
        if not args.smoke:
            out.append(("plain 4b", lambda: cells.plain_rate(model_of(n), 4 * b, data, seconds,
                                                             warmup)))
        for mode in ("per_replica", "fused"):
            for graphs in (False, True):
                out.append((f"{mode}{' graphs' if graphs else ''}", partial(
                    cells.crossbow_rate, model_of(n), b, mode, data, seconds, warmup, graphs=graphs)))
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
            run_cell(sec, cell, label, run)
    sec.data.update(seconds_per_cell=seconds, warmup=warmup, learners=4)
    _throughput_table(sec, cell_list)
    _data_path_rates(args, sec, device, seconds, warmup)


DATA_PATH_S = 4.0  # seconds of the throughput section's budget kept for the data paths


def _data_path_rates(args, sec: Section, device: torch.device, seconds: float, warmup: int) -> None:
    """samples/s of LeNet-5 (b = 16, m = 4, fused) on MNIST-shaped synthetic data in host memory:
    moved to the device once and gathered there, against gathered on the host and copied to the
    device a round ahead on a copy stream (docs/runtime.md, Data on the device)."""
    b = 8 if args.smoke else 16
    host = synthetic("lenet5", 512 if args.smoke else 8192, torch.device("cpu"))
    rates = {}
    for label, where in (("on the device", True), ("host, copied ahead", False)):
        try:
            rates[label] = cells.crossbow_rate(model_of("lenet5"), b, "fused", host, seconds, warmup,
                                               device=device, data_on_device=where)["rate"]
        except Exception as exc:
            sec.check(False, f"data path {label}: {type(exc).__name__}: {str(exc)[:300]}")
    sec.data["data_path"] = {"model": "lenet5", "b": b, "learners": 4, "mode": "fused", **rates}
    on, ahead = rates.get("on the device"), rates.get("host, copied ahead")
    ratio = f"{on / ahead:.2f}×" if on and ahead and on == on and ahead == ahead else "—"
    sec.tables[f"data paths, LeNet-5 at b = {b}, m = 4 fused: samples/s"] = md_table(
        ["data gathered on the device", "host data copied a round ahead", "device ÷ host"],
        [[fmt(on), fmt(ahead), ratio]])
    sec.flush()


def _throughput_table(sec: Section, cell_list: list[dict]) -> None:
    def ratio(a, b):
        return f"{a / b:.2f}×" if a and b and a == a and b == b else "—"

    rows = []
    for c in cell_list:
        pb, p4, pr, fu, gp, gf = (c.get(k) for k in ("plain b", "plain 4b", "per_replica", "fused",
                                                       "per_replica graphs", "fused graphs"))
        best = max((x for x in (pr, fu, gp, gf) if x is not None and x == x), default=None)
        rows.append([c["model"], c["b"], fmt(pb), fmt(p4), fmt(pr), fmt(fu), fmt(gp), fmt(gf),
                     ratio(best, pb), ratio(best, p4)])
    sec.tables["training samples/s, synthetic data on the device (crossbow_graph: m = 4 learners "
               "at b, one device; graphs: CUDA-graph rounds)"] = md_table(
        ["model", "b", "plain b", "plain 4b", "per_replica", "fused", "per_replica graphs",
         "fused graphs", "best ÷ plain b", "best ÷ plain 4b"], rows)
    if rows:
        sec.key = f"{rows[0][0]} b={rows[0][1]}: best crossbow {rows[0][8]} plain b"


def section_bandwidth(args, sec: Section) -> None:
    """The Triton and torch SMA kernels (bench/sma_kernel.py ``bench_cuda``), each launch after a
    256 MiB read that evicts the L2, ResNet-50's size at m = 8 first (the target: ≥ 80 % of the
    measured copy bandwidth), then LeNet-5 / ResNet-32 / ResNet-50 at m ∈ {1, 2, 4, 8}."""
    start = time.perf_counter()
    shapes = sma_kernel.model_shapes()
    if args.smoke:
        device, names, ms, reps, iters = torch.device("cpu"), ["lenet5"], [1, 2], 1, 2
        flush, peak, nominal = sma_kernel.L2Flush("cpu", 2**20), None, None
        sec.notes.append("smoke: Triton's interpreter against torch on the CPU, host-clock times: "
                         "not bandwidths (CUDA events and the L2 need a GPU)")
    else:
        device, names, ms, reps, iters = torch.device("cuda"), ["resnet50", "lenet5", "resnet32"], \
            [8, 1, 2, 4], 3, 20
        flush, nominal = sma_kernel.L2Flush("cuda"), sma_kernel.nominal_bandwidth()
        peak = (card_facts(args.work).get("copy_GBps") or 0) * 1e9 or sma_kernel.copy_bandwidth(3)
    sec.data.update(copy_bytes_per_s=peak, nominal_bytes_per_s=nominal, rows=[])
    rows = []
    for name, m in [(n, m) for n in names for m in ms]:
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
    sec.tables["SMA local update, data out of L2 (floor (5m+2)·4P bytes)"] = md_table(
        ["model", "m", "P", "Triton µs", "GB/s", "of copy", "of nominal", "torch µs", "GB/s",
         "torch ÷ Triton", "central µs (Triton)"], rows)
    _bandwidth_target(args, sec, peak, nominal, len(rows))


def _bandwidth_target(args, sec: Section, peak, nominal, n_rows: int) -> None:
    big = next((r for r in sec.data["rows"] if (r["model"], r["m"]) == ("resnet50", 8)), None)
    share = big["triton_bytes_per_s"] / peak if big and peak else None
    card = card_facts(args.work).get("name", "this card")
    sec.target("SMA local kernel, ResNet-50's P at m = 8, of the measured copy bandwidth", share,
               KERNEL_SHARE, unit="%", scale=f"a share of {card}'s measured copy GB/s",
               gpu=not args.smoke, explain="the kernel's own row above")
    if args.smoke:
        sec.key = f"Triton (interpreted) matches torch in {n_rows} configurations"
    elif peak:
        sec.notes.append(f"device copy {peak / 1e9:,.0f} GB/s" +
                         (f"; nominal {nominal / 1e9:,.0f} GB/s" if nominal else ""))
        sec.key = (f"resnet50 m=8: {share:.0%} of copy (target ≥ {KERNEL_SHARE:.0%})" if share
                   is not None else "resnet50 m=8 not measured")


PROFILED = [("per_replica", 4, True), ("fused", 16, True), ("fused", 4, False)]  # the targets' first


def section_profile(args, sec: Section) -> None:
    """torch.profiler over 20 rounds of LeNet-5 at b = 16 of the targets' systems (per_replica
    graph rounds at m = 4, fused graph rounds at m = 16) and of fused eager rounds at m = 4:
    kernels and host µs per round, the GPU's busy share (what explains a missed target)."""
    device, b = device_of(args), 8 if args.smoke else 16
    data = synthetic("lenet5", 2048 if args.smoke else 8192, device)
    rows = []
    for mode, m, graphs in PROFILED:
        if args.smoke and graphs:
            continue  # the profiler and simulated graphs both dispatch: one at a time
        label = f"{mode}, {'graph' if graphs else 'eager'} rounds, m={m}"
        try:
            r = cells.profile_rounds(model_of("lenet5"), b, mode, data, m=m, graphs=graphs,
                                     **({"rounds": 4, "warmup": 2} if args.smoke else {}))
        except Exception as exc:
            sec.check(False, f"{label}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        sec.data[label] = r
        if graphs:
            sec.check((r["replays"] or 0) > 0, f"{label}: no replay in the profiled rounds")
        busy = f"{r['gpu_busy_share']:.0%}" if r["gpu_busy_share"] is not None else "—"
        rows.append([label, f"{r['kernels_per_round']:.0f}", f"{r['host_us_per_round']:.0f}", busy])
        sec.flush()
    sec.tables[f"torch.profiler, {4 if args.smoke else 20} rounds of LeNet-5 at b = {b}"] = md_table(
        ["rounds", "kernels per round" if not args.smoke else "aten ops per round",
         "host µs per round", "GPU busy"], rows)
    if rows:
        sec.key = "; ".join(f"{r[0]}: {r[1]} kernels, {r[2]} µs" for r in rows)
    if args.smoke:
        sec.notes.append("smoke: eager rounds on the CPU (aten ops, no GPU share)")
