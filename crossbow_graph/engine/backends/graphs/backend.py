"""The CUDA-graphs backend: the streams backend's rounds captured once per key by a
``RoundGraph`` and replayed, a round the graph cannot take run on the streams
(docs/runtime.md, "CUDA-graph rounds"; docs/design-overview.md §5)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...rounds.context import RunContext
from ...rounds.env import RoundEnv
from ..streams.backend import StreamsBackend
from .capture import RoundGraph
from .inputs import DeviceGather, graph_batch

__all__ = ["GraphBackend"]


class GraphBackend(StreamsBackend):
    """The CUDA-graphs backend: the streams backend's rounds captured by ``graph`` (a
    RoundGraph) and replayed; a round the graph cannot take runs on the streams."""

    def __init__(self, ctx: RunContext, ops: Any, graph: RoundGraph) -> None:
        super().__init__(ctx, ops)
        self.graph = graph
        self.in_graph = False  # the round body runs as a graph captures it

    def run_round(self, env: RoundEnv, indices: Any, next_indices: Any) -> None:
        """As the inline backend's; device-resident data is gathered in the round's graph."""
        fit = self.ctx.fit
        if env.batch is None and fit.load is None and hasattr(fit.fetch, "gather"):
            env.batch = DeviceGather(fit.fetch, fit.fetch.on_device(indices))
        super().run_round(env, indices, next_indices)

    def run_env(self, env: RoundEnv) -> None:
        if not self.graph.run_round(self, env):
            if isinstance(env.batch, DeviceGather):
                env.batch = env.batch.batch()
            super().run_env(env)

    def prefetch(self, round_index: int, indices: torch.Tensor, b: int) -> None:
        """As the streams backend's: round ``round_index``'s batch loaded and copied to the
        device a round ahead, a DataLoader's learner batches stacked first when they stack into
        tensors (``graph_batch``), so that a graph round copies it into its static inputs on the
        device and an eager round (a fallback) takes it as it is."""
        self.copy_ahead(round_index, indices,
                        graph_batch(self.ctx.fit.load_batch(round_index, indices)), b)

    def graph_body(self, batch: Any, env: RoundEnv) -> list[torch.Tensor]:
        """Round ``env``'s tasks as a graph captures them (between two ``seal``s, its
        hyper-parameters read from the device tensors, no seeding, no host copy, no timing) on
        ``batch`` (the static inputs); returns the learners' losses (0-dim tensors, in learning
        order)."""
        ctx = self.ctx
        body = dataclasses.replace(env, batch=batch, copied=None, on_device=True, accs={},
                                   learned=[], hyper=self.graph.hyper_view(ctx.states[0], env.hyper))
        self.in_graph = True
        try:
            self.cuda_streams.begin_round(batch)
            self.run(ctx.order, body.unlearned([s.m for s in ctx.states]))
        finally:
            self.in_graph = False
            self.cuda_streams.seal()  # every stream joins the caller's again
        return body.learned

    def graph_epilogue(self, env: RoundEnv, losses: list[torch.Tensor]) -> None:
        """After a graph round: its ``losses`` into ``env``, each device's fault mask to the host
        behind an event, the faults of the rounds before recorded."""
        ctx = self.ctx
        env.learned.extend(losses)
        for d, mask in enumerate(ctx.fault_masks):
            if mask is not None:
                self.read_late(d, 0, mask, self.cuda_streams.ops.current(ctx.states[d].torch_device),
                               env.round_index)
        # rounds t−1 and t stay queued: the host waits for round t−2's replay, not for t−1's
        self.take_late_faults(block=False, before=env.round_index - 1)

    def learn_seed(self, env: RoundEnv, row: int) -> int | None:
        return None if self.in_graph else super().learn_seed(env, row)

    @property
    def reads_masks_late(self) -> bool:
        return not self.in_graph
