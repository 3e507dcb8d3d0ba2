"""One torchft replica group of the fault-tolerance tests (tests/test_ft.py):
``python _ft_group.py OUT_DIR GROUP SYNC ROUNDS DIE_AT [PHASE]`` with ``TORCHFT_LIGHTHOUSE`` set.

TinyNet, 1 device (``FT_DEVICE``, else the CPU) × 2 replicas (``FT_REPLICAS``: another number),
b = 4, its own data (seeded by the group's number), ``SYNC`` ``sma`` (SMA with its default α for the
live learners' k, μ_z = 0: z after a sync is ``test_ft.sma_z`` of their weights at the round's
start) or ``diloco``
(DiLoCo, H = 2, inner AdamW), ROUNDS rounds. ``DIE_AT`` ≥ 0:
the group SIGKILLs itself in the first sync from round DIE_AT on that follows a sync of both
groups' 4 learners and has both in its quorum (the groups may start out of step: a group that
arrives late syncs alone, or recovers, first), after the quorum and before the all-reduce (the
others' all-reduce fails and is discarded). ``PHASE`` ``first``: stop after 4
rounds with a checkpoint in ``OUT_DIR/GROUP-ckpt``; ``resume``: resume from it; ``pace``: while
alone, wait 0.2 s after each round (a late or restarted group then has time to join), write
``OUT_DIR/GROUP.alone`` once alone after a sync of both, and stop 6 rounds after another group
rejoined; ``cases``: one fit per case of ``OUT_DIR/cases.json`` (``run_cases``). Writes
``GROUP.pt``: per round the replicas' weights at its start and z after it, the membership
changes, or ``error`` (``cases``: that per case). Logs at INFO
(``logging.basicConfig``), as an application that logs its own progress.

With torchrun's variables (RANK, WORLD_SIZE = W, MASTER_ADDR, MASTER_PORT) this process is rank
RANK of a group of W processes: its data is W times as long (the ranks share it, so the group
still runs ROUNDS rounds), the sync it dies in follows one of both groups' 2·W·2 learners (with
``FT_DIE_RANK`` set only that rank dies), and it writes ``GROUP-RANK.pt``."""

import dataclasses
import json
import logging
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

import crossbow_graph as cg  # noqa: E402
from crossbow_graph.errors import TaskError  # noqa: E402
from _plans import TinyNet, make_plan, tiny_data  # noqa: E402

B, M = 4, int(os.environ.get("FT_REPLICAS", "2"))  # replicas per device
W, RANK = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


class _Record(cg.Hook):
    """The replicas at each round's start, z after it."""

    def __init__(self) -> None:
        self.w_before: list[torch.Tensor] = []
        self.z_after: list[torch.Tensor] = []

    def before_round(self, ctx) -> None:
        self.w_before.append(ctx.plan.replica_weights().clone())

    def after_round(self, ctx) -> None:
        self.z_after.append(ctx.plan.central_weights().clone())


def plan_of(group: str, sync: str) -> cg.Plan:
    """The group's plan; ``FT_SEED_<GROUP>``, ``FT_MOMENTUM_<GROUP>``: its seed, its SMA's μ_z;
    with SMA ``FT_LR_<GROUP>``, ``FT_OPTIMIZER_<GROUP>`` (``adamw``), ``FT_BATCH_<GROUP>``: its
    learning rate (0.05), optimizer (SGD with momentum 0.9) and b (4; the data stays B's)."""
    dist = cg.Distributed(fault_tolerant=True, replica_group=group, timeout_s=10.0)
    devices = [os.environ["FT_DEVICE"]] if os.environ.get("FT_DEVICE") else 1
    seed = int(os.environ.get(f"FT_SEED_{group}", "0"))
    if sync == "sma":
        momentum = float(os.environ.get(f"FT_MOMENTUM_{group}", "0"))
        lr = float(os.environ.get(f"FT_LR_{group}", "0.05"))
        optimizer = (lambda m: torch.optim.AdamW(m.parameters(), lr=lr)) \
            if os.environ.get(f"FT_OPTIMIZER_{group}") == "adamw" else cg.SGD(lr=lr, momentum=0.9)
        return make_plan(TinyNet, seed=seed, batch_size=int(os.environ.get(f"FT_BATCH_{group}", B)),
                         devices=devices, replicas=M, sync=cg.SMA(central_momentum=momentum),
                         optimizer=optimizer, distributed=dist)
    return make_plan(TinyNet, seed=seed, batch_size=B, devices=devices, replicas=M,
                        sync=cg.DiLoCo(sync_every=2),
                        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
                        distributed=dist)


def die_in_sync(plan: cg.Plan, round_index: int) -> None:
    """SIGKILL (``FT_DIE_SIGNAL=STOP``: SIGSTOP) this process in the all-reduce (after its
    quorum) of the first sync from round ``round_index`` on after a sync of both groups' 2·W·M
    learners with 2 groups in the quorum."""
    sig = signal.SIGSTOP if os.environ.get("FT_DIE_SIGNAL") == "STOP" else signal.SIGKILL
    if os.environ.get("FT_DIE_RANK", str(RANK)) != str(RANK):
        return  # another rank of this group dies
    ft = plan.rounds.transport.ft
    manager = ft.manager
    allreduce = manager.allreduce
    fired = []  # once: a continued group (SIGCONT) goes on with this all-reduce

    def dying(*args, **kwargs):
        if not fired and plan.progress.rounds_done - 1 >= round_index \
                and ft.members.live_learners == 2 * W * M and manager.num_participants() == 2:
            fired.append(True)
            os.kill(os.getpid(), sig)
        return allreduce(*args, **kwargs)

    manager.allreduce = dying


class _StopAfter(cg.Hook):
    def after_round(self, ctx) -> None:
        ctx.stop = ctx.plan.rounds_done >= 4


class _Pace(cg.Hook):
    def __init__(self, alone_file: str) -> None:
        self.alone_file = alone_file

    def after_round(self, ctx) -> None:
        changes = ctx.plan.rounds.transport.ft.members.changes
        if changes and changes[-1].groups == 1:  # alone: give the other group time to (re)join
            time.sleep(0.2)
        both = [i for i, c in enumerate(changes) if (c.groups, c.learners) == (2, 2 * W * M)]
        # alone after a sync of both groups (a group that started first was alone before it)
        alone = [i for i, c in enumerate(changes) if c.groups == 1 and both and i > both[0]]
        if alone and not os.path.exists(self.alone_file):
            open(self.alone_file, "w").close()
        if alone and len(changes) > alone[0] + 1 and \
                ctx.plan.rounds_done >= changes[alone[0] + 1].round_index + 6:
            ctx.stop = True


def run(out: str, group: str, sync: str, rounds: int, die_at: int, phase: str = "") -> dict:
    """One fit of this group; its result (what ``GROUP.pt`` holds)."""
    result = {}
    rec = _Record()
    try:
        plan = plan_of(group, sync)
        if die_at >= 0:
            die_in_sync(plan, die_at)
        data = tiny_data(rounds * B * M * W, seed=int(group[-1]) + 1)
        ckpt = dict(checkpoint_dir=os.path.join(out, f"{group}-ckpt"), checkpoint_every=4,
                    resume=phase == "resume") if phase else {}
        hooks = [rec] + {"first": [_StopAfter()],
                         "pace": [_Pace(os.path.join(out, f"{group}.alone"))]}.get(phase, [])
        plan.fit(data, 1, shuffle=False, progress=False, metrics_every=None, hooks=hooks, **ckpt)
        result.update(rounds=plan.rounds_done, summary=plan.summary(),
                      backend=plan.rounds.transport.ft.manager._pg.getBackendName(),
                      membership=[dataclasses.asdict(c) for c in plan.rounds.transport.ft.members.changes])
    except TaskError as exc:
        result.update(error=str(exc))
    result.update(w_before=rec.w_before, z_after=rec.z_after)
    return result


def run_cases(out: str, group: str, sync: str, rounds: int) -> dict[str, dict]:
    """Phase ``cases``: one fit (a new plan, a new Manager) per case of ``OUT_DIR/cases.json``,
    ``{name: {variable: value}}`` (its Lighthouse's ``TORCHFT_LIGHTHOUSE``, ``FT_SEED_g1``, …),
    one after the other, each under its variables; ``{name: result}``."""
    with open(os.path.join(out, "cases.json")) as f:
        cases = json.load(f)
    before = dict(os.environ)
    results = {}
    for name, variables in cases.items():
        os.environ.update(variables)
        results[name] = run(out, group, sync, rounds, -1)
        os.environ.clear()
        os.environ.update(before)
    return results


def main(out: str, group: str, sync: str, rounds: int, die_at: int, phase: str = "") -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO)
    result = (run_cases(out, group, sync, rounds) if phase == "cases"
              else run(out, group, sync, rounds, die_at, phase))
    torch.save(result, os.path.join(out, f"{group}.pt" if W == 1 else f"{group}-{RANK}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:4], int(sys.argv[4]), int(sys.argv[5]), *sys.argv[6:])
