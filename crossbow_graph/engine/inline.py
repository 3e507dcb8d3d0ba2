"""The inline backend: every task of a round in this process, in topological order, on the host
(docs/runtime.md, "Backends")."""

from __future__ import annotations

import time
from typing import Any

from ..compiler.tasks import Task, TaskKind
from .backend import Backend, RoundEnv
from .batches import DeviceParts
from .interpreter import RoundInterpreter
from .learners import learn_group, learner_seed, rows

__all__ = ["InlineBackend"]


class InlineBackend(Backend, RoundInterpreter):
    """Runs a Scheduler's rounds task by task, one method per task kind, each task timed on the
    host (its span to the timeline, a sync task's seconds to ``sync_seconds``, all exposed)."""

    def run_round(self, round_index: int, batch: Any, synchronise: bool, indices: Any,
                  next_indices: Any) -> None:
        """Run round ``round_index`` on ``batch`` (None: the batch copied ahead for ``indices``,
        else the one ``Scheduler.load_batch`` gives); ``next_indices`` is not used."""
        sched, copied = self.sched, None
        if batch is None:
            ahead = sched.batch_ahead.take(round_index, indices)
            if ahead is not None:
                batch, copied = ahead
            else:
                batch = sched.load_batch(round_index, indices)
        env = RoundEnv.of(round_index, batch, synchronise, sched.alpha, sched.states, sched.losses)
        env.copied = copied
        self.run_env(env)

    def run_env(self, env: RoundEnv) -> None:
        """Run the program's tasks in order on ``env``."""
        self.run(self.sched.order, env)

    def run_task(self, task: Task, env: RoundEnv) -> None:
        t0 = time.perf_counter_ns()
        super().run_task(task, env)
        t1 = time.perf_counter_ns()
        sched = self.sched
        if task.kind is not TaskKind.LEARN:
            sched.sync_seconds += (t1 - t0) / 1e9
            sched.sync_exposed_seconds += (t1 - t0) / 1e9  # sequential: nothing is hidden
        if sched.timeline is not None:
            sched.timeline.span(task.id, t0, t1, lane="inline", round_index=env.round_index)

    # -- one method per task kind -------------------------------------------------------------

    def learn(self, task: Task, env: RoundEnv) -> None:
        """Forward and backward of the task's replica (fused: of its run of rows, at the run's
        first task); gradients into ``g``, losses into ``env``."""
        sched = self.sched
        program = sched.program
        d = program.device[task.id]
        if sched.learner_mode == "fused":
            run = sched.fused_runs.get(task.id)
            if run is None:
                return
            r0, r1 = run
        else:
            r0, r1 = program.rows[task.id]
        state, b, first = sched.states[d], sched.batch_size, program.first[d]
        batch, at = env.batch, first
        if isinstance(batch, DeviceParts):  # copied ahead: device d's rows, on device d
            batch, at = batch.parts[d], 0
        mine = rows(batch, (at + r0) * b, (at + r1) * b)
        seed = self.learn_seed(env, first + r0)
        with self.on_stream("learn", task.id, d, r0):
            losses = learn_group(state, r0, r1, mine, sched.loss_fn, b, sched.learner_mode,
                                 sched.fused_programs[d], rng_seed=seed,
                                 max_grad_norm=sched.max_grad_norm)
        env.learned.extend(losses)
        env.losses[d][r0:r1] = losses

    def learn_seed(self, env: RoundEnv, row: int) -> int | None:
        """The dropout seed of the learner at ``row`` of this process (None: not seeded)."""
        sched = self.sched
        return learner_seed(sched.seed, env.round_index, sched.learner_offset + row)

    def local_sync(self, task: Task, env: RoundEnv) -> None:
        """The sync algorithm's local update of the task's rows; their sum acc_d into ``env``."""
        sched = self.sched
        d = sched.program.device[task.id]
        a, b = sched.program.rows[task.id]
        state = sched.states[d]
        with self.on_stream("local", task.id, d):
            env.accs[d], faulty = sched.sync.local_update(
                sched, state, a, b, alpha=env.alpha, synchronise=env.synchronise,
                losses=env.losses[d][a:b], on_device=self.cuda_streams is not None)
            self.after_local(env, d, a, b, faulty)
        if isinstance(faulty, list):
            sched.fault_masks[d] = None
            sched.faults.record(state, faulty, round_index=env.round_index,
                                num_learners=sched.num_learners, rank=sched.rank)

    def after_local(self, env: RoundEnv, d: int, a: int, b: int, faulty: Any) -> None:
        """On the local sync's stream, after its update (nothing here)."""

    def global_sync(self, task: Task, env: RoundEnv) -> None:
        """In a round that synchronises: ``Scheduler.sync_central`` of the sums acc_d of the
        devices that have a LOCAL_SYNC."""
        if env.synchronise:
            sched = self.sched
            sched.sync_central([env.accs[d] for d in sched.program.synced],
                               self.global_buffers())

    def global_buffers(self) -> list[Any] | None:
        """The buffers the global sync averages (None: the live ones)."""
        return None
