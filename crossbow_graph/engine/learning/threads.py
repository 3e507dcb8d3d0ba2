"""The intra-op threads of a fit on CPU devices: as many as cores other processes leave free, so
that no parallel region waits at its barrier for a descheduled thread (docs/runtime.md, Threads
on a busy host; bench/busy_host_threads.py)."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Literal

import torch

__all__ = ["available_cores", "CpuThreads", "IntraOpThreads", "ThreadChoice", "choose_threads", "describe_threads",
           "free_cores", "THREADS_WINDOW_S"]

CpuThreads = int | Literal["auto"] | None
THREADS_WINDOW_S = 0.1  # the window over which a core's idle share is measured
_REUSE_S = 30.0  # a measurement serves the fits that start within this many seconds of it
_last: tuple[float, float] | None = None  # (time.monotonic() of the measurement, free cores)


def available_cores() -> int:
    """Logical CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class ThreadChoice:
    """A fit's intra-op threads (``History.cpu_threads``).

    Attributes:
        threads: torch's intra-op threads during the fit.
        cores: the cores this process may run on.
        free: the cores found free at the fit's start (None: not measured, the count was given).
        before: torch's setting before the fit, given back at its end."""

    threads: int
    cores: int
    free: float | None
    before: int


def _idle_ticks(cpus: set[int]) -> tuple[int, int] | None:
    """(idle, total) jiffies summed over ``cpus`` from /proc/stat, or None where it is missing."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    idle = total = 0
    for line in lines:
        name, *fields = line.split() or [""]
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        ticks = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
        idle += ticks[3] + ticks[4]
        total += sum(ticks)
    return idle, total


def free_cores(window_s: float = THREADS_WINDOW_S) -> float:
    """Cores of this process's affinity that other processes leave free: the idle share of each
    over ``window_s`` seconds (/proc/stat), summed; without /proc/stat the cores less the
    1-minute load average. Reused for the fits that start within 30 s of a measurement."""
    global _last
    now = time.monotonic()
    if _last is not None and now - _last[0] < _REUSE_S:
        return _last[1]
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        cpus = set(range(os.cpu_count() or 1))
    first = _idle_ticks(cpus)
    if first is None:
        free = max(0.0, len(cpus) - os.getloadavg()[0])
    else:
        time.sleep(window_s)
        second = _idle_ticks(cpus)
        idle, total = second[0] - first[0], second[1] - first[1]
        free = len(cpus) * idle / total if total > 0 else float(len(cpus))
    _last = (now, free)
    return free


def choose_threads(setting: CpuThreads, *, on_cpu: bool, local_ranks: int = 1
                   ) -> ThreadChoice | None:
    """The intra-op threads of a fit: ``setting`` when it is a count; with ``"auto"`` on CPU
    devices, the free cores (``free_cores``, rounded, at least 1) shared among the ``local_ranks``
    processes of the host, at most torch's setting; None (torch's setting stays) for ``None`` or
    ``"auto"`` on CUDA devices."""
    before = torch.get_num_threads()
    if setting is None or (setting == "auto" and not on_cpu):
        return None
    cores = available_cores()
    if setting != "auto":
        return ThreadChoice(threads=int(setting), cores=cores, free=None, before=before)
    free = free_cores()
    threads = max(1, min(before, int(free + 0.5) // max(1, local_ranks)))
    return ThreadChoice(threads=threads, cores=cores, free=free, before=before)


class IntraOpThreads:
    """torch's intra-op threads for one fit (``with`` around its rounds): ``choose_threads`` of
    ``setting`` (``fit(cpu_threads=)``), ``devices`` (the plan's) and ``local_ranks`` (torchrun's
    on this host); ``count`` and ``free`` are ``History.cpu_threads`` and ``free_cores``."""

    def __init__(self, setting: CpuThreads, devices: list[torch.device], local_ranks: int) -> None:
        self.choice = choose_threads(setting, on_cpu=all(d.type == "cpu" for d in devices),
                                     local_ranks=local_ranks)
        self.count = self.choice.threads if self.choice is not None else torch.get_num_threads()
        self.free = self.choice.free if self.choice is not None else None

    def keep(self, threads: int) -> int:
        """A resumed fit: the ``threads`` its checkpoint's fit ran with replace an ``"auto"``
        choice (so the resumed rounds round as the uninterrupted ones; 0: unknown, the choice
        stays); a count given to the fit wins. Returns the count in force."""
        choice = self.choice
        if choice is not None and choice.free is not None and threads > 0:
            self.choice = dataclasses.replace(choice, threads=threads)
            self.count = threads
        return self.count

    def __enter__(self) -> "IntraOpThreads":
        if self.choice is not None:
            torch.set_num_threads(self.choice.threads)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.choice is not None:
            torch.set_num_threads(self.choice.before)


def describe_threads(threads: int, free: float | None) -> str:
    """A fit's threads in words (the CLI's last line), e.g. ``"1 intra-op thread (0.2 of 2 cores
    free)"``; ``free`` None: not chosen from the load."""
    plural = "s" if threads != 1 else ""
    why = f"{free:.1f} of {available_cores()} cores free" if free is not None else "as set"
    return f"{threads} intra-op thread{plural} ({why})"
