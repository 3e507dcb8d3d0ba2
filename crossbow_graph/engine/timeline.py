"""Chrome-trace timelines of a fit (``Plan.fit(..., trace=path)``; docs/design-overview.md §2 overlap).

Open the JSON in ``chrome://tracing`` or https://ui.perfetto.dev: one row (lane) per worker
process (or ``inline`` for the in-process executor); the global sync is drawn in the lane of the
process that ran it (the last worker, or the coordinator under torchrun), and the global sync of
round t drawn under the learning of round t+1 is the overlap.
"""

from __future__ import annotations

import json

__all__ = ["Timeline"]


class Timeline:
    """Spans of tasks, collected while a fit runs, written as Chrome trace events.

    Args:
        max_spans: spans kept (later ones are dropped, counted in ``dropped``), bounding the file.
    """

    def __init__(self, max_spans: int = 200_000) -> None:
        self.max_spans = max_spans
        self.spans: list[tuple[str, int, int, str, int]] = []  # (name, t0_ns, t1_ns, lane, round)
        self.dropped = 0

    def span(self, name: str, t0_ns: int, t1_ns: int, *, lane: str, round_index: int) -> None:
        """Record task ``name`` running from ``t0_ns`` to ``t1_ns`` (``time.perf_counter_ns``,
        which is system-wide monotonic, so worker processes' clocks agree) in ``lane``."""
        if len(self.spans) >= self.max_spans:
            self.dropped += 1
            return
        self.spans.append((name, t0_ns, t1_ns, lane, round_index))

    def to_chrome(self) -> dict:
        """The Chrome trace: ``{"traceEvents": [...]}`` with complete events (``ph: "X"``, µs)."""
        origin = min((s[1] for s in self.spans), default=0)
        lanes = sorted({s[3] for s in self.spans}, key=lambda x: (x != "coordinator", x))
        tid = {lane: i for i, lane in enumerate(lanes)}
        events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid[lane],
                   "args": {"name": lane}} for lane in lanes]
        for name, t0, t1, lane, r in self.spans:
            cat = "sync" if ("sync" in name or name == "wait for z") else "learn"
            events.append({"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": tid[lane],
                           "ts": (t0 - origin) / 1e3, "dur": max(t1 - t0, 0) / 1e3,
                           "args": {"round": r}})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"dropped_spans": self.dropped}}

    def save(self, path: str) -> None:
        """Write the Chrome-trace JSON to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_chrome(), f)
