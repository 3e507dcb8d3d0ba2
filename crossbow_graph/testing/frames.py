"""Where an op watched by the CPU simulators (race_check.py, capture_check.py) was issued."""

from __future__ import annotations

import sys

__all__ = ["issuing_frame"]


def issuing_frame(limit: int = 60) -> str:
    """The innermost frame of crossbow_graph's code (not this package nor the graphs' capture
    probe) issuing the op, as ``path:line (function)``, among the ``limit`` innermost frames.
    Walks the live frames (``f_back``): no source line is read, as ``traceback`` would for each."""
    frame = sys._getframe()
    for _ in range(limit):
        if frame is None:
            break
        filename = frame.f_code.co_filename
        if "crossbow_graph" in filename and not _scaffolding(filename):
            return (f"{filename.rsplit('crossbow_graph/', 1)[-1]}:{frame.f_lineno} "
                    f"({frame.f_code.co_name})")
        frame = frame.f_back
    return "outside crossbow_graph"


def _scaffolding(filename: str) -> bool:
    """Whether ``filename`` is this testing package's or the capture probe's (a dispatch mode on
    the stack of every op it watches)."""
    return "crossbow_graph/testing/" in filename or filename.endswith("graphs/probe.py")
