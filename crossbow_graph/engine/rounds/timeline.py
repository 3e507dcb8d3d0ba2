"""Chrome-trace timelines of a fit, one lane per learner group (``Plan.fit(..., trace=path)``;
docs/runtime.md, "Overlap")."""

from __future__ import annotations

import json

__all__ = ["Timeline"]


class Timeline:
    """Spans of tasks collected while a fit runs, at most ``max_spans`` (later ones counted in
    ``dropped``), written as Chrome trace events."""

    def __init__(self, max_spans: int = 200_000) -> None:
        self.max_spans = max_spans
        self.spans: list[tuple[str, int, int, str, int]] = []  # (name, t0_ns, t1_ns, lane, round)
        self.dropped = 0

    def span(self, name: str, t0_ns: int, t1_ns: int, *, lane: str, round_index: int) -> None:
        """Record task ``name`` from ``t0_ns`` to ``t1_ns`` (``perf_counter_ns``) in ``lane``."""
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
