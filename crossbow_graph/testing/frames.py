"""Where an op watched by the CPU simulators (race_check.py, capture_check.py) was issued."""

from __future__ import annotations

import traceback

__all__ = ["issuing_frame"]


def issuing_frame(limit: int = 60) -> str:
    """The innermost frame of crossbow_graph's code (not this package nor the graphs' capture
    probe) issuing the op, as ``path:line (function)``, among the ``limit`` innermost frames."""
    for frame in reversed(traceback.extract_stack(limit=limit)):
        if "crossbow_graph" in frame.filename and not _scaffolding(frame.filename):
            return f"{frame.filename.rsplit('crossbow_graph/', 1)[-1]}:{frame.lineno} ({frame.name})"
    return "outside crossbow_graph"


def _scaffolding(filename: str) -> bool:
    """Whether ``filename`` is this testing package's or the capture probe's (a dispatch mode on
    the stack of every op it watches)."""
    return "crossbow_graph/testing/" in filename or filename.endswith("graphs/probe.py")
