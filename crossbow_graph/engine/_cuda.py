"""Private: CUDA streams and events of the inline executor (docs/design-overview.md §2 overlap, §5).

Every learner group of a device has its own stream; each device has a sync stream for its
LOCAL_SYNC and a global stream for the GLOBAL_SYNC. Events carry exactly the task graph's edges
plus the periodic one: a group's round t+1 waits only for its device's local sync of round t (its
own correction), so the global sync of round t runs on the GPU while round t+1 learns; the local
sync of round t+1 waits for the global sync of round t (it needs z_{t+1}).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

__all__ = ["CudaStreams"]


class CudaStreams:
    """Streams and events for the inline executor on CUDA devices.

    Args:
        states: the plan's DeviceStates (CUDA devices).
        learner_mode: ``"per_replica"`` (a stream per replica) or ``"fused"`` (one per device).
    """

    def __init__(self, states, learner_mode: str) -> None:
        self.states = states
        self.groups = {}
        for d, s in enumerate(states):
            starts = [0] if learner_mode == "fused" else list(range(s.m))
            self.groups[d] = {r0: torch.cuda.Stream(device=s.torch_device) for r0 in starts}
        self.sync_stream = {d: torch.cuda.Stream(device=s.torch_device) for d, s in enumerate(states)}
        self.global_stream = torch.cuda.Stream(device=states[0].torch_device)
        self.learned: dict[int, list] = {d: [] for d in range(len(states))}
        self.local_done: dict[int, torch.cuda.Event | None] = {d: None for d in range(len(states))}
        self.global_done: torch.cuda.Event | None = None

    @contextmanager
    def learn(self, d: int, r0: int):
        """Issue a group's learning on its stream, after its own device's last local sync."""
        stream = self.groups[d].get(r0)
        if stream is None:  # a group that a task graph's LEARN tasks start elsewhere
            stream = self.groups[d][r0] = torch.cuda.Stream(device=self.states[d].torch_device)
        if self.local_done[d] is not None:
            stream.wait_event(self.local_done[d])
        with torch.cuda.stream(stream):
            yield
        event = torch.cuda.Event()
        event.record(stream)
        self.learned[d].append(event)

    @contextmanager
    def local(self, d: int, synchronise: bool):
        """Issue a device's local sync after its learners (and after the last global sync)."""
        stream = self.sync_stream[d]
        for event in self.learned[d]:
            stream.wait_event(event)
        self.learned[d] = []
        if synchronise and self.global_done is not None:
            stream.wait_event(self.global_done)
        with torch.cuda.stream(stream):
            yield
        event = torch.cuda.Event()
        event.record(stream)
        self.local_done[d] = event
        acc = self.states[d].acc
        if acc is not None:
            acc.record_stream(self.global_stream)

    @contextmanager
    def global_(self):
        """Issue the global sync after every device's local sync."""
        stream = self.global_stream
        for event in self.local_done.values():
            if event is not None:
                stream.wait_event(event)
        with torch.cuda.stream(stream):
            yield
        event = torch.cuda.Event()
        event.record(stream)
        self.global_done = event
