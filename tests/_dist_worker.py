"""One rank of the multi-process tests (tests/test_distributed.py): ``python _dist_worker.py
SCENARIO OUT_DIR`` with torchrun's variables (RANK, WORLD_SIZE, ...) set by the test.

Scenarios (TinyBN, 1 device × 2 replicas per rank, b = 4, z checked every round):
``train`` (shuffle=False; saves z, zbuf, the digest), ``process`` (the same with 2 devices × 1
replica per rank on the process executor, the data through a DataLoader with a worker process:
each rank loads its own learners' batches), ``bf16_sync`` (train with the corrections
all-reduced in bfloat16), ``decide`` (a hook on rank 0 only changes m, the learner mode, lr, α
and τ after round 3), ``resume`` (2 epochs with a checkpoint every 3 rounds,
stopped after round 10; a new plan resumes from round 9; then the same 2 epochs not stopped),
``mismatch_batch`` / ``mismatch_model`` / ``mismatch_layout`` (rank 1 compiles another plan:
another batch size, model, or its convolution weights contiguous instead of channels-last),
``mismatch_act`` / ``mismatch_dropout`` / ``mismatch_loss`` (``run_computation``: rank 1 compiles
GELU instead of ReLU, dropout p = 0.3 instead of 0.5, or a label-smoothed loss), ``own_data``
(``run_computation``: each rank trains on data of its own seed), ``diverge`` (rank 1
changes its z after round 3), ``nan_z`` (rank 1 writes NaN into its z after round 3), ``kill``
(rank 1 exits with os._exit after round 3 and its checkpoint; rank 0 writes a checkpoint every
round), ``hang`` (rank 1 sleeps after round 3), ``startup_never`` / ``startup_left`` / ``stopped``
(``run_leaving``: rank 1 exits before it joins the process group, exits once it joined, or stops
on an error of its own after round 3 and stays alive), ``fault_one``
(NaN in rank 1's replica 1 before round 2 and in rank 0's replica 0 before round 4; checkpoints
every round and a log_dir), ``fault_streams`` (the same faults on the CUDA streams' path,
simulated on the CPU by a RaceRecorder: found on the device, read a round late),
``int_buffers`` (``Counting``: an integer counter that advances differently on each rank; saves
``central_model().state_dict()``), ``nan_all`` (NaN in every replica of every rank before every
round from round 3 on, process executor, checkpoints every round), ``resume_1to2`` /
``write_2to1`` / ``refused`` (``run_reshape``: a checkpoint resumed on another number of
processes; one of another seed refused). Groups run in one launch, one after the other in the
same process group: ``ok`` = train, process, decide, resume, adamw, bf16_sync, own_data;
``mismatch`` = the six mismatches; ``faults`` = fault_one, fault_streams, int_buffers, nan_all, diverge, nan_z (the errors of the
last three close the process group: each scenario joins a new one on its own port of
``CB_MASTER_PORTS``, a comma-separated list, one per scenario of the group, when it is set);
``reshape`` = resume_1to2, write_2to1, refused; ``leaving`` = startup_left, kill, stopped,
hang on rank 0 alone (its ports and ``CB_TIMEOUT_S`` from ``CB_TIMEOUTS``, one per
scenario), each scenario's rank 1 a process of its own (``_handshake``). Writes ``rank<r>.pt`` into
OUT_DIR: per scenario a dict, ``error`` with the TaskError's message (and ``kind``,
``round_index``), or the results.
"""

import copy
import dataclasses
import functools
import logging
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

import crossbow_graph as cg  # noqa: E402
from crossbow_graph.engine.transport.comm import Comm, z_digest  # noqa: E402
from crossbow_graph.errors import CheckpointError, TaskError  # noqa: E402
from crossbow_graph.testing.race_check import RaceRecorder  # noqa: E402
from crossbow_graph.training.hooks import Hook  # noqa: E402
from _plans import TinyBN, TinyDrop, TinyNet, make_plan, tiny_data  # noqa: E402

ROUNDS = 8
HARD_S = 120  # longer than any test waits for a rank
B, M = 4, 2


class _AtRound(Hook):
    def __init__(self, round_: int, action) -> None:
        self.round, self.action = round_, action

    def after_round(self, ctx) -> None:
        if ctx.plan.rounds_done == self.round:
            self.action(ctx.plan)


class _BeforeRoundAfter(Hook):
    """``action(plan)`` before the round that follows round ``round_`` (1-based), after every
    hook of round ``round_`` ran (its checkpoint too)."""

    def __init__(self, round_: int, action) -> None:
        self.round, self.action = round_, action

    def before_round(self, ctx) -> None:
        if ctx.plan.rounds_done == self.round:
            self.action(ctx.plan)


class _Poison(Hook):
    """Before the rounds ``at`` (0-based), NaN into this rank's replicas ``rows`` of device 0."""

    def __init__(self, at, rows, flush: bool = False) -> None:
        self.at, self.rows, self.flush = at, rows, flush

    def before_round(self, ctx) -> None:
        if ctx.plan.rounds_done in self.at:
            if self.flush:  # the streams' work before writing on the default stream
                ctx.plan.rounds.flush()
            for r in self.rows:
                ctx.plan.states[0].w[r, 3] = float("nan")


class Counting(TinyBN):
    """TinyBN with an integer buffer counting the samples whose first pixel is positive: each
    rank's replicas see other samples, so their counters differ."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.seen.add_((x[:, 0, 0, 0] > 0).sum())
        return super().forward(x)


class TinyAct(TinyNet):
    """TinyNet with its activation as a module, ``act``: ReLU, or GELU with ``gelu``."""

    def __init__(self, gelu: bool = False) -> None:
        super().__init__()
        self.act = nn.GELU() if gelu else nn.ReLU()

    def forward(self, x):
        return self.fc(self.act(self.conv(x)).flatten(1))


def _tiny_drop(p: float) -> TinyDrop:
    model = TinyDrop()
    model.drop.p = p
    return model


class Recording(torch.utils.data.TensorDataset):
    """A TensorDataset whose batches are read with ``get_batch`` (the trainer's fetch), which
    records the indices this process reads in ``seen`` (list of int lists) from the fit's start
    on (``RecordSamples``)."""

    def __init__(self, *tensors) -> None:
        super().__init__(*tensors)
        self.seen: list[list[int]] = []

    def get_batch(self, idx):
        self.seen.append(idx.tolist())
        return [t[idx] for t in self.tensors]


class RecordSamples(Hook):
    """Empty ``data.seen`` at the fit's start (the first-batch checks read too)."""

    def __init__(self, data: Recording) -> None:
        self.data = data

    def before_fit(self, ctx) -> None:
        self.data.seen.clear()


class StopAfter(Hook):
    """Stop the fit after round ``round_`` (1-based, over the plan's life)."""

    def __init__(self, round_: int) -> None:
        self.round = round_

    def after_round(self, ctx) -> None:
        if ctx.plan.rounds_done == self.round:
            ctx.stop = True


class Snapshot(Hook):
    """The plan's state right after a resume (``before_fit`` runs after it): device 0's w, v,
    z, z_prev, zbuf, first_step, integer buffers, k, α and the data position, in ``got``."""

    def __init__(self) -> None:
        self.got: dict = {}

    def before_fit(self, ctx) -> None:
        plan, s = ctx.plan, ctx.plan.states[0]
        self.got = dict(w=s.w.clone(), v=s.v.clone(), z=s.z.clone(), z_prev=s.z_prev.clone(),
                        zbuf=s.zbuf.clone(), first_step=list(s.first_step),
                        ints=[{n: b.clone() for n, b in r.named_buffers() if not b.is_floating_point()}
                              for r in s.replicas],
                        k=plan.num_learners, alpha=plan.settings.alpha_for(plan.num_learners),
                        position=plan.position_in_epoch, rounds=plan.rounds_done)


def recording_data() -> Recording:
    """tiny_data of ROUNDS·B·M·2 = 128 samples, recorded."""
    return Recording(*tiny_data(ROUNDS * B * M * 2).tensors)


def _decide(plan) -> None:
    plan.set_replicas(3)
    plan.set_learner_mode("fused")
    plan.adjust(cg.Adjustment(lr=0.02, alpha=0.3))
    plan.adjust(cg.Adjustment(sync_every=2))  # a policy's change of τ, through the one interface


def run(scenario: str, rank: int, out: str) -> dict:
    """One scenario on this rank; returns its results or ``{"error": message}``."""
    model_cls = TinyNet if scenario == "mismatch_model" and rank == 1 else TinyBN
    model_cls = Counting if scenario == "int_buffers" else model_cls
    batch = 8 if scenario == "mismatch_batch" and rank == 1 else B
    settings = cg.Distributed(timeout_s=float(os.environ.get("CB_TIMEOUT_S", "20")), checksum_every=1,
                              sync_dtype="bf16" if scenario == "bf16_sync" else "fp32")
    result = {}
    try:
        devices, replicas, executor = (2, 1, "process") if scenario == "process" else (1, M, "inline")
        executor = "process" if scenario == "nan_all" else executor
        layout = "contiguous" if scenario == "mismatch_layout" and rank == 1 else "auto"
        torch.manual_seed(rank)  # rank 0's init wins
        model = model_cls()  # kept: after the fit it holds z (int_buffers)
        plan = make_plan(model, seed=rank, batch_size=batch, devices=devices,
                         replicas=replicas, executor=executor, memory_format=layout,
                         distributed=settings)
        data = tiny_data(ROUNDS * B * M * 2)
        hooks, kw = [], {}
        if scenario == "diverge" and rank == 1:
            hooks.append(_AtRound(3, lambda plan: plan.states[0].z.add_(1e-3)))
        if scenario == "decide" and rank == 0:  # a policy on rank 0 only: m 2 → 3, fused, new lr, α, τ
            hooks.append(_AtRound(3, _decide))
        if scenario == "nan_z" and rank == 1:  # after round 3's z check: spreads in round 4's sync
            hooks.append(_AtRound(3, lambda plan: plan.states[0].z[3:4].fill_(float("nan"))))
        if scenario == "hang" and rank == 1:  # alive but silent: only the timeout can tell
            hooks.append(_AtRound(3, lambda plan: time.sleep(600)))
        if scenario == "kill":
            if rank == 1:
                # after round 3's checkpoint (a collective of every rank: rank 1 sends its learners)
                hooks.append(_BeforeRoundAfter(3, lambda plan: os._exit(3)))
            kw = dict(checkpoint_dir=os.path.join(out, "ckpt"), checkpoint_every=1)
        if scenario == "fault_one":
            hooks.append(_Poison([2], [1]) if rank == 1 else _Poison([4], [0]))
            kw = dict(checkpoint_dir=os.path.join(out, "ckpt-fault"), checkpoint_every=1,
                      log_dir=os.path.join(out, "logs-fault"))
        if scenario == "fault_streams":  # fault_one on the CUDA streams' path, recorded on the CPU
            hooks.append(_Poison([2], [1], flush=True) if rank == 1 else _Poison([4], [0], flush=True))
            recorder = RaceRecorder().attach(plan.rounds)
            recorder.__enter__()
        if scenario == "nan_all":
            hooks.append(_Poison(range(3, ROUNDS), range(M)))
            kw = dict(checkpoint_dir=os.path.join(out, "ckpt-nan"), checkpoint_every=1)
        if scenario == "adamw":  # AdamW in two groups on worker processes, OneCycleLR per round
            plan = make_plan(model_cls, seed=rank, batch_size=batch, devices=2, replicas=1,
                             executor="process", distributed=settings,
                             optimizer=lambda m: torch.optim.AdamW(
                                 [{"params": list(m.parameters())[:2], "lr": 1e-3},
                                  {"params": list(m.parameters())[2:]}], lr=2e-3))
            kw = dict(lr_scheduler=torch.optim.lr_scheduler.OneCycleLR(
                plan.optimizer, max_lr=[4e-3, 8e-3], total_steps=ROUNDS * M),
                lr_scheduler_interval="round")
        if scenario == "resume":  # stopped after round 10 of 16, resumed from round 9 by a new plan
            kw = dict(checkpoint_dir=os.path.join(out, "ckpt-resume"), checkpoint_every=3)
            plan.fit(data, 2, shuffle=True, progress=False, hooks=[StopAfter(ROUNDS + 2)], **kw)
            plan = make_plan(model_cls, seed=rank, batch_size=batch, devices=1, replicas=M,
                             executor="inline", distributed=settings)
            history = plan.fit(data, 2, shuffle=True, progress=False, resume=True, **kw)
            straight = make_plan(model_cls, seed=rank, batch_size=batch, devices=1, replicas=M,
                                 executor="inline", distributed=settings)
            whole = straight.fit(data, 2, shuffle=True, progress=False)  # not stopped
            result.update(z_straight=straight.central_weights(),
                          loss_straight=whole.epochs[-1].train_loss)
        else:
            if scenario == "process":  # each rank's DataLoader loads its learners' rows
                data = torch.utils.data.DataLoader(data, batch_size=B, num_workers=1)
            history = plan.fit(data, 1, shuffle=False, progress=False, hooks=hooks, **kw)
        if scenario == "fault_streams":
            recorder.__exit__(None, None, None)
            result.update(races=[str(r) for r in recorder.races])
        result.update(z=plan.central_weights(), zbuf=plan.states[0].zbuf.clone(),
                      m=plan.replicas_per_device, lr=plan.settings.lr, tau=plan.sync.sync_every,
                      alpha=plan.sync.alpha, mode=plan.learner_mode,
                      digest=z_digest(plan.states[0].z), rounds=plan.rounds_done,
                      loss=history.epochs[-1].train_loss,
                      faults=[dataclasses.asdict(f) for f in history.faults],
                      lrs=list(history.lr), group_lrs=[g["lr"] for g in plan.optimizer.param_groups],
                      bytes_reduced=plan.comm.bytes_reduced, summary=plan.summary(),
                      P=plan.num_parameters, Q=plan.states[0].buf.shape[1])
        if scenario == "int_buffers":
            result.update(central=plan.central_model().state_dict(),
                          seen=[int(r.seen) for r in plan.states[0].replicas],
                          user=copy.deepcopy(model.state_dict()))
    except TaskError as exc:  # DistributedError, DivergenceError
        result.update(error=str(exc), kind=type(exc).__name__, round_index=exc.round_index)
    return result


def _settings() -> cg.Distributed:
    return cg.Distributed(timeout_s=float(os.environ.get("CB_TIMEOUT_S", "20")), checksum_every=1)


def run_computation(scenario: str, rank: int, out: str) -> dict:
    """``mismatch_act`` / ``mismatch_dropout`` / ``mismatch_loss``: rank 1 compiles another
    activation, dropout p or loss function (the error); ``own_data``: rank r trains on
    ``tiny_data(seed=r)`` (z and the rounds)."""
    other = rank == 1
    model_cls = {"mismatch_act": lambda: TinyAct(gelu=other),
                 "mismatch_dropout": lambda: _tiny_drop(0.3 if other else 0.5)}.get(scenario, TinyBN)
    loss = nn.functional.cross_entropy
    if scenario == "mismatch_loss" and other:
        loss = functools.partial(nn.functional.cross_entropy, label_smoothing=0.1)
    try:
        plan = make_plan(model_cls, seed=rank, devices=1, replicas=M, executor="inline",
                         distributed=_settings(), loss_fn=loss)
        data = tiny_data(ROUNDS * B * M * 2, seed=rank if scenario == "own_data" else 0)
        plan.fit(data, 1, shuffle=False, progress=False)
    except TaskError as exc:
        return dict(error=str(exc))
    return dict(z=plan.central_weights(), rounds=plan.rounds_done)


def _fail(plan) -> None:
    raise RuntimeError("rank 1 stops on an error of its own")


def run_leaving(scenario: str, rank: int, out: str) -> dict:
    """Rank 1 leaves: ``startup_never`` exits before it joins the process group, ``startup_left``
    once it joined, ``stopped`` stops on an error of its own after round 3 and stays alive (as in
    a notebook) until the test ends it. Returns rank 0's error."""
    if rank == 1 and scenario.startswith("startup"):
        if scenario == "startup_left":
            Comm.from_env(_settings())
        os._exit(3)
    hooks = [_AtRound(3, _fail)] if scenario == "stopped" and rank == 1 else []
    try:
        plan = make_plan(TinyBN, seed=rank, devices=1, replicas=M, executor="inline",
                         distributed=_settings())
        plan.fit(tiny_data(ROUNDS * B * M * 2), 1, shuffle=False, progress=False, hooks=hooks)
    except TaskError as exc:
        return dict(error=str(exc), kind=type(exc).__name__, round_index=exc.round_index)
    except RuntimeError:  # rank 1's own: alive, out of the process group
        time.sleep(HARD_S)
    return {}


def run_reshape(scenario: str, rank: int, out: str) -> dict:
    """``resume_1to2``: every rank resumes from the 1-process checkpoint the test wrote in
    ``OUT_DIR/ckpt-1to2`` (k = 2 → 4) and finishes its epoch; ``write_2to1``: 3 rounds of k = 4
    with a checkpoint every 3 rounds into ``OUT_DIR/ckpt-2to1``, then a stop (the test resumes
    it in one process); ``refused``: a resume of ``ckpt-2to1`` with another seed (the error).
    Returns the Snapshot after the resume, the indices read, z."""
    settings = cg.Distributed(timeout_s=float(os.environ.get("CB_TIMEOUT_S", "20")), checksum_every=1)
    plan = make_plan(TinyBN, seed=rank + 7, devices=1, replicas=M, executor="inline",
                     distributed=settings)  # another init: the checkpoint's state must win
    data, snap = recording_data(), Snapshot()
    if scenario == "refused":  # another seed than the checkpoint's: rank 0 refuses, every rank says why
        try:
            plan.fit(data, 1, shuffle=True, seed=1, progress=False, resume=True,
                     checkpoint_dir=os.path.join(out, "ckpt-2to1"))
        except CheckpointError as exc:
            return dict(error=str(exc))
        return {}
    if scenario == "resume_1to2":
        plan.fit(data, 1, shuffle=True, progress=False, checkpoint_dir=os.path.join(out, "ckpt-1to2"),
                 resume=True, hooks=[RecordSamples(data), snap])
    else:
        plan.fit(data, 1, shuffle=True, progress=False, checkpoint_dir=os.path.join(out, "ckpt-2to1"),
                 checkpoint_every=3, hooks=[RecordSamples(data), StopAfter(3)])
    return dict(snapshot=snap.got, seen=data.seen, z=plan.central_weights(), rounds=plan.rounds_done)


COMPUTATION = ["mismatch_act", "mismatch_dropout", "mismatch_loss", "own_data"]
LEAVING = ["startup_never", "startup_left", "stopped"]
GROUPS = {"ok": ["train", "process", "decide", "resume", "adamw", "bf16_sync", "own_data"],
          "mismatch": ["mismatch_batch", "mismatch_model", "mismatch_layout", "mismatch_act",
                       "mismatch_dropout", "mismatch_loss"],
          "faults": ["fault_one", "fault_streams", "int_buffers", "nan_all", "diverge", "nan_z"],
          "reshape": ["resume_1to2", "write_2to1", "refused"],
          # rank 0 only, each scenario with a rank 1 process of its own; hang last: its group timed
          # out (startup_never has a launch of its own: a rank 0 whose store gave up hangs at its
          # next start-up)
          "leaving": ["startup_left", "kill", "stopped", "hang"]}


def _handshake(name: str, rank: int) -> None:
    """With ``CB_HANDSHAKE`` (a folder): rank 1 says it is ready to run ``name`` and waits for
    rank 0 to come to it, so that both start it together (``leaving``: one rank 0 runs the
    scenarios one after the other, each with a rank 1 started at the launch). torch._dynamo,
    which the first optimizer imports (seconds), is imported before either says so."""
    where = os.environ.get("CB_HANDSHAKE")
    if not where:
        return
    import torch._dynamo  # noqa: F401

    mine, theirs = ("go", "ready") if rank == 0 else ("ready", "go")
    deadline = time.monotonic() + HARD_S
    if rank == 1:
        open(os.path.join(where, f"{mine}-{name}"), "w").close()
    while not os.path.exists(os.path.join(where, f"{theirs}-{name}")) and time.monotonic() < deadline:
        time.sleep(0.02)
    if rank == 0:
        open(os.path.join(where, f"{mine}-{name}"), "w").close()


def main(scenario: str, out: str) -> None:
    """Run ``scenario`` (or each of a group's, in one process group) and save the results."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    ports = os.environ.get("CB_MASTER_PORTS", "").split(",")  # one per scenario, when given
    timeouts = os.environ.get("CB_TIMEOUTS", "").split(",")  # CB_TIMEOUT_S per scenario, when given
    results = {}
    for i, name in enumerate(GROUPS.get(scenario, [scenario])):
        if ports[0]:  # a scenario after an error that closed the group joins a new one on its port
            os.environ["MASTER_PORT"] = ports[i]
            if i and "error" in results[prev] and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()  # an error at start-up leaves it open
        if timeouts[0]:
            os.environ["CB_TIMEOUT_S"] = timeouts[i]
        _handshake(name, rank)
        run_one = (run_reshape if name in GROUPS["reshape"] else run_computation
                   if name in COMPUTATION else run_leaving if name in LEAVING else run)
        results[name] = run_one(name, rank, out)
        prev = name
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    if scenario in ("ok", "mismatch", "reshape") and torch.distributed.is_initialized():
        # every rank is alive here: leave together, so that no rank tears gloo down while its
        # peer still uses the group (that aborted a rank at exit: "terminate called ...")
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # rank<r>.pt is written and every process group closed: skip the interpreter's teardown of
    # torch (a second or more of garbage collection per rank), its output flushed first
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
