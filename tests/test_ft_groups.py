"""Replica groups of several processes under torchft (docs/distributed.md, "Fault tolerance"):
two groups g0, g1 of W = 2 ranks each (torchrun's variables and a store per group, as torchrun
sets them; each rank 1 device × 2 replicas of tests/_ft_group.py, SMA with its default α, μ_z = 0)
against a real Lighthouse on gloo. Oracle: z after a sync is SMA's over the live learners' weights
at the round's start, over every rank of every live group (``test_ft.sma_z``). Skipped without
torchft."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from test_ft import HERE, ROUNDS, _free_port, run_groups, sma_z, start_lighthouse, stop_all, z_before

W = 2  # ranks per group
GROUPS = ("g0", "g1")


def run_rank_groups(tmp_path, die: dict[str, int], min_replicas: int = 1, restart: bool = False,
                    rounds: dict[str, int] | None = None, phase: str = "",
                    die_rank: int | None = None, sync: str = "sma", timeout_s: float = 150
                    ) -> dict[tuple[str, int], dict]:
    """Groups g0, g1 of W ranks each; {(group, rank): result} of the groups that do not die.
    Every rank of a group in ``die`` SIGKILLs itself in the same sync (tests/_ft_group.py), or
    only rank ``die_rank`` (its other ranks then end on their own errors, as nothing ends them);
    ``restart``: g0 paces itself (phase ``pace``) and a group of ``die`` starts again (a new
    store, as a new torchrun job) once all its ranks died; else ``phase`` is every group's."""
    pytest.importorskip("torchft", reason="torchft is the 'ft' extra")
    lighthouse, address = start_lighthouse(min_replicas=min_replicas)
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    base.update(TORCHFT_LIGHTHOUSE=address, PYTHONPATH=os.path.dirname(HERE), OMP_NUM_THREADS="1",
                FT_DIE_SIGNAL="KILL")
    os.makedirs(tmp_path, exist_ok=True)
    rounds = rounds or {}

    def start(g: str, dies: int, phase: str) -> dict[tuple[str, int], subprocess.Popen]:
        port = str(_free_port())  # the group's store: rank 0's process group hosts it
        return {(g, r): subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_ft_group.py"), str(tmp_path), g, sync,
             str(rounds.get(g, ROUNDS)), str(dies), phase],
            env=dict(base, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(W),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                     **({} if die_rank is None else {"FT_DIE_RANK": str(die_rank)})),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(W)}

    procs: dict[tuple[str, int], subprocess.Popen] = {}
    try:
        for g in GROUPS:
            procs.update(start(g, die.get(g, -1), ("pace" if g == "g0" else "") if restart
                               else phase))
        if restart:
            for g in die:
                for r in range(W):
                    procs[g, r].communicate(timeout=timeout_s)
                procs.update(start(g, -1, ""))
            die = {}
        logs = {key: p.communicate(timeout=timeout_s)[0] for key, p in procs.items()}
    finally:
        stop_all(procs.values(), lighthouse)
    results = {}
    for (g, r), p in procs.items():
        if g in die:
            if die_rank in (None, r):  # killed itself, or stopped first: the rank that died
                # first took the group's Manager server (rank 0's) or its commit vote along
                assert p.returncode == -9 or (p.returncode == 0 and "error" in torch.load(
                    tmp_path / f"{g}-{r}.pt", weights_only=False)), (g, r, p.returncode, logs[g, r][-3000:])
            continue
        assert p.returncode == 0, (g, r, p.returncode, logs[g, r][-3000:])
        results[g, r] = torch.load(tmp_path / f"{g}-{r}.pt", weights_only=False)
        assert "error" not in results[g, r], results[g, r]["error"]
        results[g, r]["log"] = logs[g, r]
    return results


def _group_sma(results: dict, g: str, t: int) -> torch.Tensor:
    """z after round t of SMA over group g's W·2 learners alone (``sma_z`` of their weights at
    the round's start and z then, as its rank 0 saw it), ``[P]``."""
    w = torch.cat([results[g, r]["w_before"][t] for r in range(W)])  # [W·2, P]
    return sma_z(z_before(results[g, 0], t), w)


def _unclocked(changes: list[dict]) -> list[dict]:
    """Membership changes without their wall seconds (each rank's own)."""
    return [{k: v for k, v in c.items() if k != "seconds"} for c in changes]


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    """Both groups of W ranks, SMA, no failure, ROUNDS rounds (the Lighthouse waits for both
    groups): {(group, rank): result}; only read by the tests that share it."""
    return run_rank_groups(tmp_path_factory.mktemp("undisturbed"), {}, min_replicas=2)


@pytest.mark.distributed
def test_two_groups_of_two_ranks_average_all_eight_learners(undisturbed):
    """Undisturbed: after every round z is bit for bit the same on all 4 processes and equals
    SMA's over the 8 learners' weights at the round's start (``sma_z``; float32 summation
    order: rtol 1e-6); k = 8 throughout."""
    r = undisturbed
    for t in range(ROUNDS):
        z = r["g0", 0]["z_after"][t]
        for key in r:
            assert torch.equal(r[key]["z_after"][t], z), (key, t)
        w = torch.cat([r[key]["w_before"][t] for key in r])  # [8, P]
        torch.testing.assert_close(z, sma_z(z_before(r["g0", 0], t), w), rtol=1e-6, atol=1e-7)
    for key in r:
        assert [(c["groups"], c["learners"]) for c in r[key]["membership"]] == [(2, 8)], key
        assert _unclocked(r[key]["membership"]) == _unclocked(r["g0", 0]["membership"]), key
    assert "replica group 'g0' of 2 processes (torchft): 2 live group(s), k = 8" \
        in r["g0", 0]["summary"]
    for g in GROUPS:  # the membership line once per group: its rank 0's
        assert f"replica group {g}: round 0: 2 live group(s), k = 8 learners" in r[g, 0]["log"]
        assert "live group(s)" not in r[g, 1]["log"], r[g, 1]["log"][-2000:]


@pytest.mark.distributed
@pytest.mark.parametrize("die_rank", [None, 1])
def test_a_killed_group_of_two_ranks_is_left_out_and_the_survivor_averages_its_own(tmp_path,
                                                                                   die_rank):
    """Both ranks of g1 (or only its rank 1: its rank 0, and the Manager server with it, lives
    on until its own collectives time out, and the quorums without g1 wait for that) die in a
    sync from round 3 on: g0's all-reduce of that round is discarded on both its ranks (one
    commit decision), the quorum shrinks to g0 and z after that round and every later one is
    SMA's over g0's 4 learners at the round's start (rtol 1e-6), the same on both ranks; before
    it z held g1's learners too; g0 finishes all rounds."""
    r = run_rank_groups(tmp_path, {"g1": 3}, die_rank=die_rank)
    changes = r["g0", 0]["membership"]
    assert _unclocked(changes) == _unclocked(r["g0", 1]["membership"])
    ks = [(c["groups"], c["learners"]) for c in changes]
    assert (2, 8) in ks, changes  # a group that arrived late may have synced alone first
    failure = changes[ks.index((2, 8)) + 1]
    t0 = failure["round_index"]
    assert t0 >= 3 and failure["failed_attempts"] >= 1, changes
    assert (failure["groups"], failure["learners"]) == (1, 4)
    for rank in range(W):
        assert r["g0", rank]["rounds"] == ROUNDS
    for t in range(t0, ROUNDS):
        assert torch.equal(r["g0", 0]["z_after"][t], r["g0", 1]["z_after"][t]), t
        torch.testing.assert_close(r["g0", 0]["z_after"][t], _group_sma(r, "g0", t),
                                   rtol=1e-6, atol=1e-7)
    assert not torch.allclose(r["g0", 0]["z_after"][t0 - 1], _group_sma(r, "g0", t0 - 1),
                              rtol=1e-4, atol=1e-5)


@pytest.mark.distributed
def test_a_restarted_group_of_two_ranks_recovers_z_on_each_rank_from_its_peer(tmp_path):
    """Both ranks of g1 die in a sync from round 3 on and start again as a new job: at their
    next quorum with g0 each rank receives z from g0's rank of the same number, and from then on
    z after every sync is bit for bit the same on all four processes; g0's k goes 8 → 4 → 8."""
    # as test_ft's restart test: the Lighthouse must put both groups in one quorum before the
    # death and after the restart, which two jobs' timing can miss: at most three tries
    for attempt in range(3):
        r = run_rank_groups(tmp_path / str(attempt), {"g1": 3}, restart=True,
                            rounds={"g0": 400, "g1": 60})
        ks = [(c["groups"], c["learners"]) for c in r["g0", 0]["membership"]]
        if (2, 8) in ks and ks[-1] == (2, 8) and (1, 4) in ks[ks.index((2, 8)):]:
            break
    g0 = r["g0", 0]
    for rank in range(W):
        g1 = r["g1", rank]
        first = next((c for c in g1["membership"] if c["recovered"] and c["groups"] == 2), None)
        assert first is not None, (g1["membership"], g0["membership"])
        assert _unclocked(r["g0", rank]["membership"]) == _unclocked(g0["membership"])
        ks = [(c["groups"], c["learners"]) for c in g0["membership"]]
        failure = ks.index((1, 4), ks.index((2, 8)))
        back = next(c["round_index"] for c in g0["membership"][failure:]
                    if (c["groups"], c["learners"]) == (2, 4))  # g1 recovering: its sum is zero
        shared = min(g0["rounds"] - back, len(g1["z_after"]) - first["round_index"])
        assert shared >= 5
        for i in range(shared):
            z = r["g0", rank]["z_after"][back + i]
            assert torch.equal(z, g1["z_after"][first["round_index"] + i]), (rank, i)
            assert torch.equal(z, g0["z_after"][back + i]), (rank, i)


@pytest.mark.distributed
def test_groups_of_two_ranks_resume_from_their_checkpoints_bit_identically(tmp_path, undisturbed):
    """Both groups stop after 4 rounds with a checkpoint (rank 0 of each writes its group's,
    with both ranks' learners) and resume from it as new jobs: z after the last round equals the
    undisturbed run's bit for bit on all four processes."""
    whole = undisturbed
    run_rank_groups(tmp_path, {}, min_replicas=2, phase="first")
    resumed = run_rank_groups(tmp_path, {}, min_replicas=2, phase="resume")
    for key in whole:
        assert len(resumed[key]["z_after"]) == ROUNDS - 4
        assert torch.equal(resumed[key]["z_after"][-1], whole[key]["z_after"][-1]), key


@pytest.mark.distributed
def test_diloco_over_groups_of_two_ranks_follows_one_process_groups_of_the_same_learners(
        tmp_path, monkeypatch):
    """DiLoCo (H = 2, inner AdamW): groups of 2 ranks × 2 replicas train the same learners on
    the same batches as one-process groups of 4 replicas (rank r's learners are the group's
    learners 2r, 2r + 1); z after every round agrees with theirs to float32 summation order
    (the group's sum is the ranks' partial sums: rtol 1e-5), and on all four processes bit for
    bit."""
    ranks = run_rank_groups(tmp_path / "ranks", {}, min_replicas=2, sync="diloco")
    monkeypatch.setenv("FT_REPLICAS", "4")
    single = run_groups(tmp_path / "single", "diloco", {}, min_replicas=2)
    for t in range(ROUNDS):
        z = ranks["g0", 0]["z_after"][t]
        for key in ranks:
            assert torch.equal(ranks[key]["z_after"][t], z), (key, t)
        torch.testing.assert_close(z, single["g0"]["z_after"][t], rtol=1e-5, atol=1e-6)
    assert not torch.equal(z, ranks["g0", 0]["z_after"][0])  # z moved
