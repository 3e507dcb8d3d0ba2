"""The coordinator of the process backend: learner groups in forked worker processes on the
CPU, flat buffers and messages in shared memory, the next round's learning overlapping the
global sync (docs/runtime.md, "Worker processes"; docs/design-overview.md §2 overlap, §5)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ...data.batches import rows
from ...rounds.context import RunContext
from ...rounds.env import RoundEnv
from ...rounds.interpreter import task_error
from .conv_choice import choose_onednn
from .groups import Crew, LearnerGroup, group_programs
from .mailbox import Answer, Spans, available_cores, worker_groups
from .workers import Workers

__all__ = ["ProcessExecutor", "account_round", "trace_round"]


class ProcessExecutor:
    """The coordinator of the learner groups: group 0 in this process, groups 1 … n−1 in forked
    worker processes (``Workers``), each running its GroupProgram (docs/runtime.md, "Worker
    processes").

    Args:
        ctx: the plan's RunContext (its fit's ``fetch`` and ``load``: ``FitRun``; with ``load``
            the workers receive their rows, ``Mailbox.batches``, else they fetch).
        env: the first round's RoundEnv: its b, learner mode, k, sync algorithm and
            max_divergence hold while the workers live.
        global_update: the backend's (``Backend.global_update``).
        seed: seeds each worker's RNG (dropout) differently.

    Attributes: ``crew`` (what the groups share), ``workers`` (the forked processes), ``closed``."""

    def __init__(self, ctx: RunContext, env: RoundEnv, global_update: Callable, *,
                 seed: int) -> None:
        self.ctx = ctx
        self.b = env.b
        self.own_batch: Any = None  # with a load: group 0's rows of the round it starts
        # fused learners: a device's replicas in one program, whose dropout masks depend on the
        # group (vmap draws them for the whole group at once), hence one group per device
        cores = 1 if env.learner_mode == "fused" else available_cores()
        groups = worker_groups([s.m for s in ctx.states], cores)
        programs = group_programs(ctx.program, groups, coordinator_syncs=ctx.comm is not None)
        onednn = choose_onednn(ctx, ctx.fit.fetch, env.b)
        for s in ctx.states:
            s.share_memory()
        template = RoundEnv(0, None, False, env.k, env.b, env.learner_mode, env.sync, env.hyper,
                            env.max_divergence)
        self.crew = crew = Crew(ctx, groups, programs, template, global_update, onednn=onednn)
        self.stepped = [(ctx.states[g[0]], *p.local_rows) for g, p in zip(groups, programs)
                        if p.local is not None]  # rows whose next local update is not the first
        self.tasks = {t.id: t for t in ctx.program.tasks}
        self.lanes = [f"{'coordinator' if w == 0 else f'worker {w}'} (d{d} r{r0}-{r1 - 1})"
                      for w, (d, r0, r1) in enumerate(groups)]
        self.learn_names = [f"learn:d{d}:r{r0}-{r1 - 1}" for d, r0, r1 in groups]
        self.ahead: tuple[int, torch.Tensor] | None = None  # the speculative round, if any
        self.own = LearnerGroup(crew, 0)
        self.own_learn_span = (0, 0)  # start and end (ns) of group 0's last learning
        self.z_ready_ns = 0  # when the z of the next local update became final (perf_counter_ns)
        self.main_threads = torch.get_num_threads()
        self.closed = False
        self.workers = Workers(crew, b=env.b, seed=seed, shipped=ctx.fit.load is not None)
        if len(groups) > 1:  # one intra-op thread here too: the workers have the other cores
            torch.set_num_threads(1)

    def _group_rows(self, wid: int) -> tuple[int, int]:
        """Group ``wid``'s sample rows ``[start, stop)`` of a round's ``k·b``."""
        d, r0, r1 = self.crew.groups[wid]
        b, first = self.b, self.ctx.program.first[d]
        return (first + r0) * b, (first + r1) * b

    def _group_indices(self, indices: torch.Tensor, wid: int) -> torch.Tensor:
        """Group ``wid``'s part of a round's sample indices ``[k·b]``: ``[(r1 − r0)·b]``, int64."""
        return indices[slice(*self._group_rows(wid))].to(torch.int64)

    def _send_go(self, round_index: int, indices: torch.Tensor) -> None:
        """Post the round's indices to every worker; with a load, ship each its rows of the round."""
        load, mail = self.ctx.fit.load, self.workers.mail
        batch = load(round_index, indices) if load is not None else None
        for wid in self.workers.ids:
            mail[wid].post(round_index, self._group_indices(indices, wid).numpy())
        if batch is not None:
            for wid in self.workers.ids:
                if self.crew.programs[wid].learn:
                    mail[wid].batches.send(rows(batch, *self._group_rows(wid)))
            self.own_batch = rows(batch, *self._group_rows(0))

    def _release(self, env: RoundEnv | None) -> None:
        """Release round ``env`` to the workers (its synchronise and hyper-parameters), or with
        None the cancel of the round learned ahead."""
        self.crew.write_release(env)
        self.workers.release()

    def _own_learn(self, round_index: int, indices: torch.Tensor) -> None:
        """Group 0's LEARN tasks of round ``round_index``, with the workers' convolutions."""
        start = time.perf_counter_ns()
        saved = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = self.crew.onednn  # as the workers (choose_onednn)
        try:
            self.own.learn_round(round_index, self._group_indices(indices, 0), self.own_batch)
        finally:
            self.own_batch = None
            torch.backends.mkldnn.enabled = saved
            self.own_learn_span = (start, time.perf_counter_ns())  # its end: waiting for z begins

    # -- rounds ---------------------------------------------------------------------------------

    def cancel_ahead(self) -> None:
        """Cancel the speculative round being learned (restoring the replicas' buffers)."""
        if self.ahead is None:
            return
        round_index, _ = self.ahead
        self.ahead = None
        self._release(None)
        self.own.cancel()
        for wid in self.workers.ids:
            self.workers.recv(wid, round_index)  # "cancelled" (or an error of a round never run)

    def run_round(self, env: RoundEnv, indices: torch.Tensor,
                  next_indices: torch.Tensor | None = None) -> None:
        """Run round ``env`` on the samples ``indices [k·b]``; with ``next_indices`` start
        learning the next round (docs/runtime.md, "Overlap"). On return w, v, z, zbuf are final
        and the round's losses are in ``env.learned``.

        Raises:
            TaskError: a group's task failed (names the task, its device and the round; the
                workers are stopped), or DivergenceError: every learner was faulty."""
        t, synchronise = env.round_index, env.synchronise
        learned = self._learn(t, indices)
        ta, tb = self.own_learn_span  # group 0 has waited for z_t since it finished learning
        tc = time.perf_counter_ns()
        self._release(env)
        self.own.local_round(env)
        if synchronise and self.crew.sync_worker is not None:
            self.own.announce()
        spans = Spans(ta, tb, tc, time.perf_counter_ns())
        own, error, faulty = self.own.losses, self.own.error, self.own.faulty  # before round t+1
        if next_indices is not None:
            self._learn_ahead(t + 1, next_indices)
        losses = torch.stack(own) if own else torch.zeros(0)
        answers = self._collect(t, Answer(0, losses, spans, faulty), error)
        self._record(env, answers)
        g0 = g1 = time.perf_counter_ns()
        if synchronise:
            if self.crew.sync_worker is None:
                self.own.run_global()
                g1 = time.perf_counter_ns()
            else:
                ran = answers[self.crew.sync_worker].spans
                g0, g1 = ran.global_start, ran.global_end
        z_at = account_round(self, answers, synchronise, g0, g1)
        if self.ctx.fit.timeline is not None:
            trace_round(self, t, answers, z_at, (g0, g1) if synchronise else None, learned)

    def _learn(self, round_index: int, indices: torch.Tensor) -> bool:
        """Start round ``round_index``'s learning unless it runs ahead already (cancelled if its
        indices differ); returns whether it did."""
        if self.ahead is not None and (self.ahead[0] != round_index
                                       or not torch.equal(self.ahead[1], indices)):
            self.cancel_ahead()
        learned = self.ahead is not None  # group 0 learned this round in the previous call
        if learned:
            self.ctx.clock.learned_ahead += 1
        else:
            self._send_go(round_index, indices)
            self._own_learn(round_index, indices)
        self.ahead = None
        return learned

    def _learn_ahead(self, round_index: int, indices: torch.Tensor) -> None:
        """Start the next round's learning now (the overlap with this round's global sync)."""
        self._send_go(round_index, indices)
        self._own_learn(round_index, indices)
        self.ahead = (round_index, indices)
        timeline = self.ctx.fit.timeline
        if timeline is not None and self.crew.programs[0].learn:
            timeline.span(self.learn_names[0], *self.own_learn_span, lane=self.lanes[0],
                          round_index=round_index)

    def _collect(self, round_index: int, own: Answer, own_error: tuple[str, str] | None
                 ) -> list[Answer]:
        """Every group's answer of round ``round_index`` (group 0's: ``own``), in group order.

        Raises:
            TaskError: some group's task failed (the first one's; the workers are stopped)."""
        answers, failure = [own], own_error
        for wid in self.workers.ids:
            reply = self.workers.recv(wid, round_index)
            if reply[0] == "error" and failure is None:
                failure = reply[1:]
            elif reply[0] == "ok":
                answers.append(Answer(wid, *reply[1:]))
        if failure is not None:
            self.close()
            raise task_error(self.tasks[failure[0]], round_index, failure[1])
        return answers

    def _record(self, env: RoundEnv, answers: list[Answer]) -> None:
        """The groups' losses into ``env.learned``, their faults into the plan's; raises
        DivergenceError when every learner was faulty."""
        ctx = self.ctx
        for answer in answers:
            env.learned.extend(answer.losses.unbind())
        for state, a, b in self.stepped:
            state.first_step[a:b] = [False] * (b - a)
        for answer in answers:
            ctx.faults.record(ctx.states[self.crew.groups[answer.wid][0]], answer.faulty,
                              round_index=env.round_index, num_learners=env.k, rank=ctx.rank)

    def close(self) -> None:
        """Cancel the speculative round, stop every worker (join, then kill), also mid-round."""
        self.closed = True
        try:
            if self.ahead is not None and self.workers.alive():
                self.cancel_ahead()
        except Exception:  # noqa: BLE001 - a dead worker: it is killed below
            pass
        finally:
            self.ahead = None
            self.workers.close()
            torch.set_num_threads(self.main_threads)


def account_round(ex: ProcessExecutor, answers: list[Answer], synchronise: bool, g0: int,
                  g1: int) -> list[int]:
    """Add the round's synchronisation seconds (``answers``' Spans; the global sync ran from g0 to
    g1 ns) to the plan's ``SyncClock``; returns per group when its wait for z ended (ns)."""
    clock, n = ex.ctx.clock, len(answers)
    local_s = sum(a.spans.local_end - a.spans.local_start for a in answers) / n / 1e9
    # a group's wait counts as synchronisation only until z_t was final (the previous
    # global sync's end); after that it waits for this process's release (hooks, bookkeeping)
    z_ready = ex.z_ready_ns
    z_at = [max(a.spans.learn_end, min(a.spans.local_start, z_ready)) for a in answers]
    waited_s = sum(z - a.spans.learn_end for a, z in zip(answers, z_at)) / n / 1e9 + local_s
    clock.sync_s += (g1 - g0) / 1e9 + local_s
    # the sync worker's learners do not learn while it runs the global sync: exposed too
    in_worker = (g1 - g0) / n / 1e9 if synchronise and ex.crew.sync_worker is not None else 0.0
    clock.exposed_s += waited_s + in_worker
    if synchronise:
        ex.z_ready_ns = g1
    return z_at


def trace_round(ex: ProcessExecutor, round_index: int, answers: list[Answer], z_at: list[int],
                global_span: tuple[int, int] | None, learned: bool) -> None:
    """The round's spans on the timeline: per group its learning, its waits and its local
    sync part; the global sync in the lane of the process that ran it."""
    timeline, crew = ex.ctx.fit.timeline, ex.crew
    if global_span is not None:
        lane = "coordinator" if crew.sync_worker is None else ex.lanes[crew.sync_worker]
        timeline.span(ex.ctx.program.global_sync.id, *global_span, lane=lane,
                      round_index=round_index)
    for answer, z in zip(answers, z_at):
        s, lane, program = answer.spans, ex.lanes[answer.wid], crew.programs[answer.wid]
        if program.learn and (answer.wid or not learned):  # group 0's speculative learning
            timeline.span(ex.learn_names[answer.wid], s.learn_start, s.learn_end, lane=lane,
                          round_index=round_index)  # has its span already
        timeline.span("wait for z", s.learn_end, z, lane=lane, round_index=round_index)
        if s.local_start > z:
            timeline.span("wait for release", z, s.local_start, lane=lane,
                          round_index=round_index)
        if program.local is not None:
            timeline.span(program.local.id, s.local_start, s.local_end, lane=lane,
                          round_index=round_index)
