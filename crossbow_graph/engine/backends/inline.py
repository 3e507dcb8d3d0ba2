"""The inline backend: every task of a round in this process, in topological order, on the host
(docs/runtime.md, "Backends")."""

from __future__ import annotations

import time
from typing import Any

import torch

from ...compiler.tasks import Task, TaskKind
from ..data.batches import DeviceParts, rows
from ..learning.learners import learn_group, learner_seed
from ..rounds.backend import Backend
from ..rounds.env import RoundEnv
from ..rounds.interpreter import RoundInterpreter

__all__ = ["InlineBackend"]


class InlineBackend(Backend, RoundInterpreter):
    """Runs rounds task by task, one method per task kind, each task timed on the host (its span
    to the timeline, a sync task's seconds to the ``SyncClock``, all exposed)."""

    def run_round(self, env: RoundEnv, indices: torch.Tensor | None,
                  next_indices: torch.Tensor | None) -> None:
        """Run the round on ``env.batch`` (None: the batch copied ahead for ``indices``, else the
        one the fit loads); ``next_indices`` is not used."""
        ctx = self.ctx
        if env.batch is None:
            ahead = ctx.batch_ahead.take(env.round_index, indices)
            if ahead is not None:
                env.batch, env.copied = ahead
            else:
                env.batch = ctx.fit.load_batch(env.round_index, indices)
        self.run_env(env.unlearned([s.m for s in ctx.states]))

    def run_env(self, env: RoundEnv) -> None:
        """Run the program's tasks in order on ``env``."""
        self.run(self.ctx.order, env)

    def run_task(self, task: Task, env: RoundEnv) -> None:
        t0 = time.perf_counter_ns()
        super().run_task(task, env)
        t1 = time.perf_counter_ns()
        ctx = self.ctx
        if task.kind is not TaskKind.LEARN:
            ctx.clock.sync_s += (t1 - t0) / 1e9
            ctx.clock.exposed_s += (t1 - t0) / 1e9  # sequential: nothing is hidden
        if ctx.fit.timeline is not None:
            ctx.fit.timeline.span(task.id, t0, t1, lane="inline", round_index=env.round_index)

    # -- one method per task kind -------------------------------------------------------------

    def learn(self, task: Task, env: RoundEnv) -> None:
        """Forward and backward of the task's replica (fused: of its run of rows, at the run's
        first task); gradients into ``g``, losses into ``env``."""
        ctx = self.ctx
        program = ctx.program
        d = program.device[task.id]
        if env.learner_mode == "fused":
            run = ctx.fused_runs.get(task.id)
            if run is None:
                return
            r0, r1 = run
        else:
            r0, r1 = program.rows[task.id]
        b, first = env.b, program.first[d]
        batch, at = env.batch, first
        if isinstance(batch, DeviceParts):  # copied ahead: device d's rows, on device d
            batch, at = batch.parts[d], 0
        mine = rows(batch, (at + r0) * b, (at + r1) * b)
        seed = self.learn_seed(env, first + r0)
        with self.on_stream("learn", task.id, env, d, r0):
            losses = learn_group(ctx.states[d], r0, r1, mine, ctx.loss_fn, b, env.learner_mode,
                                 ctx.fused[d], rng_seed=seed, max_grad_norm=ctx.fit.max_grad_norm)
        env.learned.extend(losses)
        env.losses[d][r0:r1] = losses

    def learn_seed(self, env: RoundEnv, row: int) -> int | None:
        """The dropout seed of the learner at ``row`` of this process (None: not seeded)."""
        return learner_seed(self.ctx.fit.seed, env.round_index, self.ctx.learner_offset + row)

    def local_sync(self, task: Task, env: RoundEnv) -> None:
        """The sync algorithm's local update of the task's rows; their sum acc_d into ``env``."""
        ctx = self.ctx
        d = ctx.program.device[task.id]
        a, b = ctx.program.rows[task.id]
        state = ctx.states[d]
        with self.on_stream("local", task.id, env, d):
            env.accs[d], faulty = env.sync.local_update(ctx.sync, env, state, a, b,
                                                        losses=env.losses[d][a:b])
            self.after_local(env, d, a, b, faulty)
        if isinstance(faulty, list):
            ctx.fault_masks[d] = None
            ctx.faults.record(state, faulty, round_index=env.round_index, num_learners=env.k,
                              rank=ctx.rank)

    def after_local(self, env: RoundEnv, d: int, a: int, b: int, faulty: Any) -> None:
        """On the local sync's stream, after its update (nothing here)."""

    def global_sync(self, task: Task, env: RoundEnv) -> None:
        """In a round that synchronises: the sync algorithm's global update of the sums acc_d of
        the devices that have a LOCAL_SYNC (``Backend.global_update``)."""
        if env.synchronise:
            ctx = self.ctx
            self.global_update(env, [env.accs[d] for d in ctx.program.synced],
                               self.global_buffers())

    def global_buffers(self) -> list[Any]:
        """The buffers the global sync averages: the live ones."""
        return [s.buf for s in self.ctx.states]
