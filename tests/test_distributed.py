"""Global synchronisation over torch.distributed (engine/transport/comm.py, docs/distributed.md).

Real process groups: two processes (tests/_dist_worker.py) with gloo on 127.0.0.1, started with
torchrun's variables on a free port, with hard timeouts; every process is killed on the way out.
The 1-process run and the hand-written SMA of tests/_reference.py are the oracles.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import crossbow_graph as cg
from crossbow_graph.engine.transport.comm import Comm, torchrun_env
from crossbow_graph.engine.transport.peers import join_failed, lost_peer
from crossbow_graph.training.checkpoint import load_latest
from _dist_worker import (B, M, ROUNDS, RecordSamples, Snapshot, StopAfter, _AtRound, _decide,
                          recording_data)
from _plans import TinyBN, make_plan, tiny_data
from _reference import batches_of, default_alpha, flat, reference_sma

pytestmark = pytest.mark.distributed

WORKER = os.path.join(os.path.dirname(__file__), "_dist_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARD_TIMEOUT_S = 60  # a safety net against a hang, not a measurement


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(world: int, timeout_s: float, **more) -> dict:
    """The ranks' environment: torchrun's variables on a free port, one thread, CB_TIMEOUT_S."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
               PYTHONPATH=ROOT, OMP_NUM_THREADS="1", CB_TIMEOUT_S=str(timeout_s), **more)
    return env


def _start(rank: int, scenario: str, out, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKER, scenario, str(out)],
                            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _launch(scenario: str, out, *, timeout_s: float = 20.0, world: int = 2, wait_for=None,
            ports: int = 0):
    """Run ``scenario`` on ``world`` ranks; returns (per rank its result dict or None, return codes,
    logs). ``wait_for``: the ranks to wait for (default all); the others are then killed.
    ``ports``: a group's scenarios, each with a free port of its own (CB_MASTER_PORTS); the wait
    is then HARD_TIMEOUT_S per scenario."""
    env = _env(world, timeout_s, CB_MASTER_PORTS=",".join(str(_free_port()) for _ in range(ports)))
    procs = [_start(r, scenario, out, env) for r in range(world)]
    logs = []
    try:
        for r in (range(world) if wait_for is None else wait_for):
            logs.append(procs[r].communicate(timeout=HARD_TIMEOUT_S * max(1, ports))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for r in range(world):
        path = os.path.join(out, f"rank{r}.pt")
        results.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
    return results, [p.returncode for p in procs], logs


@pytest.fixture(scope="module")
def ok_runs(tmp_path_factory):
    """One launch, three scenarios in one process group: train, decide, resume."""
    results, codes, logs = _launch("ok", tmp_path_factory.mktemp("ok"))
    assert codes == [0, 0], logs
    return {name: (results[0][name], results[1][name])
            for name in ("train", "process", "decide", "resume", "adamw", "bf16_sync", "own_data")}


@pytest.fixture(scope="module")
def mismatch_runs(tmp_path_factory):
    """One launch: rank 1 compiles another batch size, then another model, then contiguous rows,
    then another activation, dropout p, loss function."""
    results, codes, logs = _launch("mismatch", tmp_path_factory.mktemp("mismatch"))
    assert codes == [0, 0], logs
    return results


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory):
    """One launch: a fault on each rank, an integer counter, then NaN everywhere, z made to differ,
    NaN in one rank's z (each of the last three stops on an error that closes the process group:
    the next joins a new one on its own port)."""
    out = tmp_path_factory.mktemp("faults")
    results, codes, logs = _launch("faults", out, ports=6)
    assert codes == [0, 0], logs
    runs = {name: (results[0][name], results[1][name])
            for name in ("fault_one", "fault_streams", "int_buffers", "nan_all", "diverge", "nan_z")}
    return out, logs, runs


def test_two_processes_give_the_one_process_z_and_identical_copies(ok_runs):
    r0, r1 = ok_runs["train"]
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    assert r0["rounds"] == r1["rounds"] == ROUNDS
    # every rank keeps its own z: bit-identical (checked every round by the checksum, and here)
    assert torch.equal(r0["z"], r1["z"]) and torch.equal(r0["zbuf"], r1["zbuf"])
    assert r0["digest"] == r1["digest"]
    # the same k = 4 learners in one process (shuffle=False: learner j gets batch t·k + j)
    one = make_plan(TinyBN, seed=0, batch_size=B, devices=1, replicas=2 * M, executor="inline")
    data = tiny_data(ROUNDS * B * M * 2)
    history = one.fit(data, 1, shuffle=False, progress=False)
    # the epoch's loss is the mean over all ranks' learners
    assert r0["loss"] == r1["loss"] == pytest.approx(history.epochs[-1].train_loss, rel=1e-5)
    # only the summation order differs (Σ of 4 rows vs two Σ of 2, then the all-reduce)
    torch.testing.assert_close(r0["z"], one.central_weights(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r0["zbuf"], one.states[0].zbuf, rtol=1e-5, atol=1e-6)
    torch.manual_seed(0)
    ref = flat(reference_sma(TinyBN(), batches_of(data, B), ks=[2 * M] * ROUNDS, lr=0.05, momentum=0.9)[0])
    torch.testing.assert_close(r0["z"], ref, rtol=1e-4, atol=1e-5)


def test_two_processes_with_two_devices_each_on_worker_processes_give_the_same_z(ok_runs):
    r0, r1 = ok_runs["process"]  # hierarchical: 2 devices sum, then one all-reduce per process
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    assert torch.equal(r0["z"], r1["z"])
    one = make_plan(TinyBN, seed=0, batch_size=B, devices=2 * M, replicas=1, executor="inline")
    one.fit(tiny_data(ROUNDS * B * M * 2), 1, shuffle=False, progress=False)
    torch.testing.assert_close(r0["z"], one.central_weights(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r0["zbuf"], one.states[0].zbuf, rtol=1e-5, atol=1e-6)


def test_ranks_agree_on_eta_every_round_with_adamw_and_a_scheduler(ok_runs):
    """AdamW in two param groups on worker processes, OneCycleLR stepped every round: both ranks
    use the same η in every round (History.lr) and end with the same z."""
    r0, r1 = ok_runs["adamw"]
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert len(r0["lrs"]) == r0["rounds"] > 1 and r0["lrs"] == r1["lrs"]
    assert len(set(r0["lrs"])) > 1 and r0["group_lrs"] == r1["group_lrs"]
    assert r0["digest"] == r1["digest"] and torch.equal(r0["z"], r1["z"])


def test_bf16_sync_halves_the_bytes_and_stays_near_the_fp32_z(ok_runs):
    """Corrections all-reduced in bfloat16 with error feedback: 2·P + 4·(Q + 1) bytes per sync
    (counted as handed to the all-reduces, and printed by the summary), z the same on both ranks
    (checked every round) and within 1 % of the float32 sync's after 8 rounds."""
    (f0, _), (r0, r1) = ok_runs["train"], ok_runs["bf16_sync"]
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    P, Q, rounds = r0["P"], r0["Q"], r0["rounds"]
    assert r0["bytes_reduced"] == rounds * (2 * P + 4 * (Q + 1))
    assert f0["bytes_reduced"] == rounds * 4 * (P + Q + 1)
    assert f"{2 * P + 4 * (Q + 1):,} bytes per process per sync (bf16 corrections)" in r0["summary"]
    assert torch.equal(r0["z"], r1["z"])
    assert (r0["z"] - f0["z"]).norm() / f0["z"].norm() < 1e-2
    assert not torch.equal(r0["z"], f0["z"])  # the corrections were rounded


def test_error_feedback_sends_what_the_rounding_lost_next_time(monkeypatch):
    """One rank's view: Σ_t sent_t = Σ_t C_t − e_T exactly (telescoping), with the residual
    e_T within half a bfloat16 step of the last sum; without feedback the rounding errors of
    small corrections add up."""
    from crossbow_graph.engine.transport import comm as comm_mod
    comm = comm_mod.Comm.__new__(comm_mod.Comm)
    comm.settings, comm._residual, comm.bytes_reduced = cg.Distributed(sync_dtype="bf16"), None, 0
    monkeypatch.setattr(comm_mod.dist, "all_reduce", lambda t, op=None, group=None: None)  # one rank
    g = torch.Generator().manual_seed(0)
    P, Q = 1000, 3
    sent, total = torch.zeros(P, dtype=torch.float64), torch.zeros(P, dtype=torch.float64)
    for t in range(200):
        c = 1.0 + 1e-3 * torch.randn(P, generator=g)  # small changes that bfloat16 rounds away
        flat = torch.cat([c, torch.arange(Q + 1, dtype=torch.float32)])
        comm.all_reduce_sum_(flat, t, num_parameters=P)
        assert torch.equal(flat[P:], torch.arange(Q + 1, dtype=torch.float32))  # fp32 tail as given
        sent += flat[:P].double()
        total += c.double()
    e = comm._residual.double()
    torch.testing.assert_close(sent, total - e, rtol=0, atol=1e-3)
    assert e.abs().max() <= 2.0 ** -8  # half an ulp of bfloat16 near 1 (ulp 2⁻⁷)
    plain = sum(c.to(torch.bfloat16).double() for c in [1.0 + 1e-3 * torch.randn(P, generator=g)
                                                         for _ in range(200)])
    assert (plain - total).abs().max() > 10 * (sent - total).abs().max()  # feedback matters
    assert comm.bytes_reduced == 200 * (2 * P + 4 * (Q + 1))


def test_rank_0s_decisions_reach_every_rank_at_the_same_round(ok_runs):
    r0, r1 = ok_runs["decide"]
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    assert (r0["m"], r1["m"], r0["lr"], r1["lr"], r0["tau"], r1["tau"]) == (3, 3, 0.02, 0.02, 2, 2)
    assert (r0["alpha"], r1["alpha"], r0["mode"], r1["mode"]) == (0.3, 0.3, "fused", "fused")
    assert torch.equal(r0["z"], r1["z"])
    # oracle: one process with 2 devices (device-major = rank-major learners), the same change
    one = make_plan(TinyBN, seed=0, batch_size=B, devices=2, replicas=M, executor="inline")
    one.fit(tiny_data(ROUNDS * B * M * 2), 1, shuffle=False, progress=False,
            hooks=[_AtRound(3, _decide)])
    assert one.rounds_done == r0["rounds"] == 6  # 3 rounds of k=4, then 3 of k=6
    torch.testing.assert_close(r0["z"], one.central_weights(), rtol=1e-5, atol=1e-6)


def test_checksum_stops_when_z_differs_between_ranks(fault_runs):
    _, logs, runs = fault_runs
    for r in runs["diverge"]:
        assert "copies of the central model z differ between ranks" in r.get("error", ""), (r, logs)


@pytest.mark.parametrize("scenario, names", [
    ("mismatch_batch", ["'batch_size' differs", "rank 0: 4", "rank 1: 8"]),
    ("mismatch_model", ["'model' differs", "TinyBN", "TinyNet", "bn.weight"]),
    ("mismatch_layout", ["'channels-last weights' differs", "conv.weight"]),
    ("mismatch_act", ["'computation' differs", "rank 1 runs `module act: GELU(approximate='none')` "
                      "where rank 0 runs `module act: ReLU()`"]),
    ("mismatch_dropout", ["'computation' differs", "rank 1 runs `module drop: Dropout(p=0.3, "
                          "inplace=False)` where rank 0 runs `module drop: Dropout(p=0.5, inplace=False)`"]),
    ("mismatch_loss", ["'computation' differs", "rank 1 runs `loss_fn: partial(torch.nn.functional."
                       "cross_entropy, args=(), keywords=(('label_smoothing', 0.1)))` where rank 0 "
                       "runs `loss_fn: torch.nn.functional.cross_entropy`"]),
])
def test_ranks_with_different_plans_fail_at_start_up_naming_the_difference(mismatch_runs, scenario,
                                                                           names):
    for r in mismatch_runs:
        err = r[scenario].get("error", "")
        assert "the ranks disagree about the plan" in err, r
        for name in names:
            assert name in err, err


def test_ranks_with_their_own_data_train_together(ok_runs):
    """Each rank's own data (seed = rank) is allowed: z is the 1-process z of k = 4 learners whose
    batches come from rank(j)'s data at the same rows (learner j reads batch t·k + j)."""
    (r0, r1), (same, _) = ok_runs["own_data"], ok_runs["train"]
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    assert r0["rounds"] == r1["rounds"] == ROUNDS and torch.equal(r0["z"], r1["z"])
    n, k = ROUNDS * B * M * 2, 2 * M
    (x0, y0), (x1, y1) = tiny_data(n, seed=0).tensors, tiny_data(n, seed=1).tensors
    of_rank_1 = (torch.arange(n) // B) % k >= M  # [n] the rows rank 1's learners read
    mixed = torch.utils.data.TensorDataset(torch.where(of_rank_1[:, None, None, None], x1, x0),
                                           torch.where(of_rank_1, y1, y0))
    one = make_plan(TinyBN, seed=0, batch_size=B, devices=1, replicas=k, executor="inline")
    one.fit(mixed, 1, shuffle=False, progress=False)
    torch.testing.assert_close(r0["z"], one.central_weights(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(r0["z"], same["z"], rtol=1e-3, atol=1e-4)  # the data did differ


def test_nan_in_one_ranks_z_stops_every_rank_at_the_next_z_check(fault_runs):
    """NaN written into rank 1's z after round 3 reaches rank 0's z through round 4's all-reduce,
    with the same bits; the z check (every round) stops both ranks there, naming both and the
    last round both were finite."""
    _, logs, runs = fault_runs
    for r in runs["nan_z"]:
        assert r.get("kind") == "DivergenceError" and r["round_index"] == 3, (r, logs)
        assert "the central model z holds NaN/Inf on ranks 0, 1 after round 3" in r["error"], r
        assert "finite on every rank at the check after round 2" in r["error"], r
        assert "intact" not in r["error"], r


# the scenarios in which rank 1 leaves, in rank 0's order, with their CB_TIMEOUT_S (hang last)
LEAVING = {"startup_left": 120, "kill": 120, "stopped": 120, "hang": 3}


@pytest.fixture(scope="module")
def leaving_runs(tmp_path_factory):
    """One launch for the scenarios in which rank 1 leaves: one rank 0 runs them one after the
    other, each on a port and with a timeout of its own; each scenario's rank 1 is a process of
    its own, started with rank 0 and let go when rank 0 comes to it (_dist_worker._handshake).
    Rank 0's wait is HARD_TIMEOUT_S per scenario; the rank 1 processes still alive after it are
    killed. Returns the folder (rank 0's) and per scenario (rank 0's result or None, rank 1's
    result or None, rank 1's return code, [rank 0's log, rank 1's log])."""
    out = tmp_path_factory.mktemp("leaving")
    ports = {name: str(_free_port()) for name in LEAVING}
    env = _env(2, 20.0, CB_HANDSHAKE=str(out), CB_MASTER_PORTS=",".join(ports.values()),
               CB_TIMEOUTS=",".join(str(t) for t in LEAVING.values()))
    ones = {name: _start(1, name, out / name, {**env, "MASTER_PORT": ports[name],
                                               "CB_TIMEOUT_S": str(t), "CB_TIMEOUTS": "",
                                               "CB_MASTER_PORTS": ""})
            for name, t in LEAVING.items() if (out / name).mkdir() is None}
    zero = _start(0, "leaving", out, env)
    try:
        log0 = zero.communicate(timeout=HARD_TIMEOUT_S * len(LEAVING))[0]
    finally:
        for p in (zero, *ones.values()):
            if p.poll() is None:
                p.kill()
    logs1 = {name: p.communicate()[0] for name, p in ones.items()}
    path = out / "rank0.pt"
    results = torch.load(path, weights_only=False) if path.exists() else {}
    runs = {}
    for name, p in ones.items():
        path = out / name / "rank1.pt"
        r1 = torch.load(path, weights_only=False) if path.exists() else None
        runs[name] = (results.get(name), r1, p.returncode, [log0, logs1[name]])
    return out, runs


def test_a_rank_that_exits_stops_the_survivor_at_once_and_leaves_the_checkpoint_intact(leaving_runs):
    """Rank 1 exits (os._exit) before round 4; rank 0 says so in that round, long before the
    120 s timeout (the launch waits at most HARD_TIMEOUT_S)."""
    out, runs = leaving_runs
    r0, r1, code1, logs = runs["kill"]
    assert r1 is None and code1 == 3, logs
    assert r0 is not None, logs
    err = r0.get("error", "")
    assert err.startswith("rank 0 of 2: rank 1 left the process group in round 3, during the "
                          "broadcast of rank 0's decisions: it died, or stopped on an error"), err
    assert "restart every rank with --resume" in err and "within 120 s" not in err, err
    path, state = load_latest(str(out / "ckpt"))  # verifies length and SHA-256
    assert state["plan"]["rounds_done"] == 3 and path.endswith("ckpt-0000000003.pt")


def test_a_rank_stopped_by_its_own_error_is_seen_at_once_though_its_process_lives(leaving_runs):
    """Rank 1's hook raises after round 3 and its process stays (as a notebook's would): it
    leaves the process group, and rank 0 is told at once, not at the 120 s timeout."""
    r0, _, _, logs = leaving_runs[1]["stopped"]
    assert r0 is not None, logs
    err = r0.get("error", "")
    assert r0["kind"] == "DistributedError", r0
    assert "rank 1 left the process group in round 2" in err, err


def test_a_hung_rank_stops_the_others_at_the_timeout(leaving_runs):
    r0, _, _, logs = leaving_runs[1]["hang"]
    assert r0 is not None, logs  # rank 1 sleeps after round 3 (then the test kills it)
    err = r0.get("error", "")
    assert "rank 1 did not answer within 3 s in round 2" in err and "it hangs, is stopped" in err, err


@pytest.mark.parametrize("scenario, timeout_s, says", [
    ("startup_never", 3, "rank 0 of 2: only 1 of 2 ranks joined the process group at 127.0.0.1:"),
    ("startup_left", 120, "rank 0 of 2: rank 1 left"),
])
def test_a_rank_lost_at_start_up_is_named_so(request, tmp_path, scenario, timeout_s, says):
    """Rank 1 exits before it joins (seen when rank 0's store gives up, at the timeout: a launch
    of its own), or once it joined (seen at once): rank 0's error says which, not that the
    addresses differ."""
    if scenario in LEAVING:
        assert LEAVING[scenario] == timeout_s  # the launch's CB_TIMEOUT_S for the scenario
        r0, _, code1, logs = request.getfixturevalue("leaving_runs")[1][scenario]
    else:
        (r0, _), (_, code1), logs = _launch(scenario, tmp_path, timeout_s=timeout_s, wait_for=[0])
        r0 = r0 and r0[scenario]
    assert r0 is not None and code1 == 3, logs
    err = r0.get("error", "")
    assert err.startswith(says) and "start every rank again" in err, err
    assert ("never arrived" in err) == (scenario == "startup_never"), err
    assert "--resume" not in err and "round -1" not in err, err


def test_a_resumed_run_continues_on_every_rank_from_rank_0s_checkpoint(ok_runs):
    r0, r1 = ok_runs["resume"]
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    assert r0["rounds"] == r1["rounds"] == 2 * ROUNDS  # rounds 10 … 16 were run again
    assert torch.equal(r0["z"], r1["z"])
    # every rank's learners, RNG states and losses are in the checkpoint: resumed on as many
    # ranks in the middle of an epoch, the run is the uninterrupted one, bit for bit
    assert torch.equal(r0["z"], r0["z_straight"]) and torch.equal(r1["z"], r1["z_straight"])
    assert r0["loss"] == r1["loss"] == r0["loss_straight"]  # every rank's losses of the epoch


N_RESHAPE = ROUNDS * B * M * 2  # recording_data's samples


@pytest.fixture(scope="module")
def reshape_runs(tmp_path_factory):
    """One process writes a checkpoint after 4 rounds of k = 2 (position 32); then one launch of
    two ranks resumes it (k = 4) and, next, writes its own after 3 rounds of k = 4 (position 48)."""
    out = tmp_path_factory.mktemp("reshape")
    data = recording_data()
    one = make_plan(TinyBN, seed=0, devices=1, replicas=M, executor="inline")
    one.fit(data, 1, shuffle=True, progress=False, checkpoint_dir=str(out / "ckpt-1to2"),
            checkpoint_every=4, hooks=[RecordSamples(data), StopAfter(4)])
    before = list(data.seen)
    _, one_process = load_latest(str(out / "ckpt-1to2"))  # the resumed ranks write there too
    results, codes, logs = _launch("reshape", out)
    assert codes == [0, 0], logs
    return out, (before, one_process), results, logs


def _no_sample_twice_and_none_skipped(*batches_of_processes):
    seen = [i for batches in batches_of_processes for batch in batches for i in batch]
    assert sorted(seen) == list(range(N_RESHAPE)), (len(seen), len(set(seen)))


def test_a_one_process_checkpoint_resumes_on_two_ranks(reshape_runs):
    """1 → 2 processes: z, z_prev, zbuf exact on both ranks; rank 0's learners are the saved
    ones, rank 1's new ones start from z with zero momentum (the auto-tuner's rule); α the default for k = 4;
    the epoch's samples are each read once, by one process."""
    _, (before, state), results, logs = reshape_runs
    saved = state["plan"]["states"][0]
    assert state["world_size"] == 1 and state["plan"]["position_in_epoch"] == 4 * M * B
    r0, r1 = (r["resume_1to2"] for r in results)
    for r in (r0, r1):
        snap = r["snapshot"]
        for key in ("z", "z_prev", "zbuf"):
            assert torch.equal(snap[key], saved[key]), key
        assert snap["k"] == 2 * M and snap["position"] == 32
        assert snap["alpha"] == pytest.approx(default_alpha(2 * M), rel=1e-12)
    assert not torch.equal(saved["z"], saved["z_prev"])  # a central momentum to carry
    assert torch.equal(r0["snapshot"]["w"], saved["w"]) and torch.equal(r0["snapshot"]["v"], saved["v"])
    assert r0["snapshot"]["first_step"] == saved["first_step"] == [False] * M
    new = r1["snapshot"]
    assert torch.equal(new["w"], saved["z"].expand(M, -1)) and not new["v"].any()
    assert new["first_step"] == [True] * M
    assert all(torch.equal(ints["bn.num_batches_tracked"], saved["int_buffers"][0]["bn.num_batches_tracked"])
               for ints in new["ints"])
    _no_sample_twice_and_none_skipped(before, r0["seen"], r1["seen"])
    assert r0["rounds"] == r1["rounds"] == 4 + (N_RESHAPE - 32) // (2 * M * B)
    assert torch.equal(r0["z"], r1["z"])
    assert "written by 1 process(es) with k = 2 learners and resumes on 2 with k = 4" in logs[0], logs[0]


def test_a_refused_checkpoint_stops_every_rank_with_rank_0s_reason(reshape_runs):
    _, _, results, _ = reshape_runs
    r0, r1 = (r["refused"] for r in results)
    assert "written for another data order: seed=0 (now 1)" in r0.get("error", ""), r0
    assert r1.get("error", "").startswith("rank 0 could not resume: checkpoint "), r1
    assert "seed=0 (now 1)" in r1["error"]


def test_a_two_rank_checkpoint_resumes_in_one_process(reshape_runs, caplog):
    """2 → 1 process (no torchrun): z, z_prev, zbuf exact; the learners are rank 0's saved ones
    (rank 1's dropped); α the default for k = 2; the epoch continues from sample 48 of the same order, each
    sample read once; the epoch's end is checkpointed though its rounds had two k's."""
    out, _, results, _ = reshape_runs
    ckpt = out / "ckpt-2to1"
    _, state = load_latest(str(ckpt))
    assert state["world_size"] == 2 and len(state["peers"]) == 1
    assert state["plan"]["rounds_done"] == 3 and state["plan"]["position_in_epoch"] == 3 * 2 * M * B
    saved = state["plan"]["states"][0]
    assert not torch.equal(saved["w"], state["peers"][0]["states"][0]["w"])  # rank 1's own learners
    data, snap = recording_data(), Snapshot()
    plan = make_plan(TinyBN, seed=9, devices=1, replicas=M, executor="inline")
    with caplog.at_level("INFO", logger="crossbow_graph.checkpoint"):
        plan.fit(data, 1, shuffle=True, progress=False, checkpoint_dir=str(ckpt), resume=True,
                 hooks=[RecordSamples(data), snap])
    got = snap.got
    for key in ("z", "z_prev", "zbuf", "w", "v"):
        assert torch.equal(got[key], saved[key]), key
    assert got["k"] == M and got["position"] == 48
    assert got["alpha"] == pytest.approx(default_alpha(M), rel=1e-12)
    _no_sample_twice_and_none_skipped(*(r["write_2to1"]["seen"] for r in results), data.seen)
    assert plan.rounds_done == 3 + (N_RESHAPE - 48) // (M * B)
    _, end = load_latest(str(ckpt))
    assert end["world_size"] == 1 and end["plan"]["rounds_done"] == plan.rounds_done
    assert end["plan"]["epochs_done"] == 1 and end["plan"]["position_in_epoch"] == 0
    assert "written by 2 process(es) with k = 4 learners and resumes on 1 with k = 2" in caplog.text


def test_rank_0_keeps_every_ranks_faults_in_history_checkpoints_and_logs(fault_runs):
    out, logs, runs = fault_runs
    r0, r1 = runs["fault_one"]
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    # rank 1's replica 1 failed in round 2, rank 0's replica 0 in round 4
    want = [dict(round=2, device="cpu:0", replica=1, rank=1), dict(round=4, device="cpu:0", replica=0, rank=0)]
    assert r0["faults"] == want
    _, state = load_latest(str(out / "ckpt-fault"))
    assert state["plan"]["faults"] == want and state["history"]["faults"] == want
    with open(out / "logs-fault" / "faults.csv") as f:
        assert f.read().splitlines() == ["round,device,replica,rank", "2,cpu:0,1,1", "4,cpu:0,0,0"]
    assert "round 2: replica 1 on cpu:0 of rank 1 has NaN/Inf" in logs[0], logs[0]
    assert "round 4: replica 0 on cpu:0 of rank 0 has NaN/Inf" in logs[0], logs[0]
    assert torch.isfinite(torch.tensor(r0["loss"])) and r0["loss"] == r1["loss"]
    assert torch.equal(r0["z"], r1["z"])


def test_faults_found_on_the_device_reach_every_rank_with_the_same_rounds(fault_runs):
    """The streams' path (a round late, through the all-reduced count) keeps the same events as
    the host path, the ranks' z identical, and no race on the recorded streams."""
    _, _, runs = fault_runs
    (h0, h1), (r0, r1) = runs["fault_one"], runs["fault_streams"]
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    def by_round(faults):  # a rank's own events may arrive before another's earlier ones
        return sorted(faults, key=lambda f: (f["round"], f["rank"]))
    assert by_round(r0["faults"]) == by_round(r1["faults"]) == h0["faults"]
    assert torch.equal(r0["z"], r1["z"])
    torch.testing.assert_close(r0["z"], h0["z"], rtol=1e-6, atol=1e-7)
    assert r0["races"] == [] and r1["races"] == []


def test_every_rank_stops_with_divergence_error_at_the_same_round_when_every_learner_fails(fault_runs):
    out, logs, runs = fault_runs
    for r in runs["nan_all"]:  # NaN in every replica of both ranks from round 3 on
        assert r.get("kind") == "DivergenceError", (r.get("error"), logs)
        assert r["round_index"] == 3
        assert "all 4 replicas have NaN/Inf gradients in round 3" in r["error"]
        assert "on ranks 0, 1" in r["error"], r["error"]
    _, state = load_latest(str(out / "ckpt-nan"))  # rank 0's: the round before, intact
    assert state["plan"]["rounds_done"] == 3


def test_the_central_model_is_bitwise_identical_on_every_rank_integer_buffers_included(fault_runs):
    """The central model is bit-identical on every rank, integer buffers included, and every
    rank's module given to compile holds it after the fit."""
    _, _, runs = fault_runs
    r0, r1 = runs["int_buffers"]
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    assert r0["seen"] != r1["seen"]  # the ranks' replicas counted differently
    assert r0["central"].keys() == r1["central"].keys()
    for name, value in r0["central"].items():
        other = r1["central"][name]
        assert value.dtype == other.dtype and torch.equal(value, other), name
    assert int(r0["central"]["seen"]) == r0["seen"][0]  # the rule: rank 0's first replica's
    for r in (r0, r1):  # every rank's own module holds that central model after the fit
        assert r["user"].keys() == r0["central"].keys()
        assert all(torch.equal(r["user"][name], value) for name, value in r0["central"].items())


def test_without_torchrun_nothing_changes(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert torchrun_env() is None and Comm.from_env() is None
    plan = make_plan(devices=1, replicas=2, executor="inline")
    assert plan.comm is None and plan.num_learners == 2


def test_distributed_settings_are_checked():
    with pytest.raises(ValueError, match="timeout_s"):
        cg.Distributed(timeout_s=0)
    with pytest.raises(ValueError, match="checksum_every"):
        cg.Distributed(checksum_every=0)
    with pytest.raises(ValueError, match="backend"):
        cg.Distributed(backend="mpi")


def test_world_size_without_the_rest_of_torchrun_env_is_an_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for key in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="launch with torchrun"):
        torchrun_env()


@pytest.mark.slow
def test_torchrun_cli_prints_the_same_z_checksum_on_both_ranks():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "crossbow_graph", "train", "--epochs", "1", "--train-samples", "2048",
           "--test-samples", "500", "--quiet", "--checksum-every", "1"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=180)
    out = f"exit code {run.returncode}\n{run.stdout}"  # stderr too: the reason if a rank failed
    # the two ranks share one pipe, so one rank's line may land inside the other's
    sums = sorted(re.findall(r"rank (\d)/2: z checksum (\w+) after", out))
    assert [rank for rank, _ in sums] == ["0", "1"], out
    assert sums[0][1] == sums[1][1], out
    assert out.count("final test accuracy") == 1, out  # rank 0 only


def test_torchrun_ranks_of_a_machine_take_disjoint_gpus(monkeypatch):
    """Under torchrun on GPUs (faked: 4 GPUs, local rank 1, no process group), devices='auto'
    gives cuda:1, devices=2 gives cuda:2 and cuda:3, and devices=3 is an error naming the fix;
    without torchrun the names are resolve_devices' own."""
    import types

    from crossbow_graph import build

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(build.Comm, "from_env", staticmethod(lambda *a, **k: types.SimpleNamespace(local_rank=1)))
    assert build.devices_and_comm("auto", None)[0] == ["cuda:1"]
    assert build.devices_and_comm(2, None)[0] == ["cuda:2", "cuda:3"]
    assert build.devices_and_comm(["cuda:0"], None)[0] == ["cuda:0"]
    with pytest.raises(ValueError, match=r"local rank 1 would take cuda:3…cuda:5.*devices='auto'"):
        build.devices_and_comm(3, None)
    monkeypatch.setattr(build.Comm, "from_env", staticmethod(lambda *a, **k: None))
    assert build.devices_and_comm(2, None)[0] == ["cuda:0", "cuda:1"]


@pytest.mark.parametrize("world, text, says", [
    (2, "[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4490. This is "
        "typically caused by a remote worker crashing.",
     "rank 0 of 2: rank 1 left the process group in round 5, during the all-reduce: it died, or "
     "stopped on an error of its own (RuntimeError: Connection closed by peer [127.0.0.1]:4490.)"),
    (3, "Read error [10.0.0.2]:37284: Connection reset by peer.",
     "rank 0 of 3: a peer rank left the process group in round 5"),
    (2, "[unbound_buffer.cc:129] Timed out waiting 60000ms for recv operation to complete",
     "rank 0 of 2: rank 1 did not answer within 60 s in round 5, during the all-reduce: it hangs"),
    (2, "NCCL error: unhandled system error",
     "rank 0 of 2: the all-reduce in round 5 failed: another rank died or did not answer within 60 s"),
])
def test_a_failed_collective_says_whether_the_peer_left_or_timed_out(world, text, says):
    err = lost_peer(0, world, "the all-reduce", 5, 60.0, RuntimeError(text))
    assert str(err).startswith(says), str(err)
    assert err.round_index == 5 and "restart every rank with --resume" in str(err)


@pytest.mark.parametrize("rank, text, says", [
    (0, "Timed out after 61 seconds waiting for clients. 2/4 clients joined.",
     "only 2 of 4 ranks joined the process group at 10.0.0.1:29500 within 60 s: the other 2 never "
     "arrived"),
    (1, "The client socket has timed out after 60000ms while trying to connect to (10.0.0.1, 29500).",
     "rank 0 could not be reached at 10.0.0.1:29500 within 60 s: it did not start or died"),
    (1, "Connection closed by peer [10.0.0.1]:29500", "a peer rank left while the process group"),
    (0, "The server socket has failed to listen on any local network address: address already in "
        "use", "could not join the process group at 10.0.0.1:29500: launch every rank with the same "
        "--master-addr and a free --master-port"),
])
def test_a_failed_start_up_says_whether_ranks_never_arrived_or_the_address_is_wrong(rank, text, says):
    err = join_failed(rank, 4, "10.0.0.1:29500", 60.0, RuntimeError(text))
    assert str(err).startswith(f"rank {rank} of 4: {says}"), str(err)
    assert str(err).endswith("; start every rank again") and err.round_index == -1


def test_rank_0s_settings_travel_every_round_only_when_a_hook_decides(tmp_path, monkeypatch):
    """One gloo rank in this process: 40 rounds with no deciding hook (an LR schedule decides
    the same on every rank) agree rank 0's settings every AGREE_EVERY_ROUNDS rounds (and once
    before the first round), not every round; with a hook that decides, after every round.
    z equals the fit without torch.distributed either way."""
    import torch.distributed as dist

    from crossbow_graph.engine.transport.comm import AGREE_EVERY_ROUNDS

    from crossbow_graph.training import rank_sync, trainer

    calls = []
    real = rank_sync.agree_settings

    def counted(comm, plan, stop, t):
        calls.append(t)
        return real(comm, plan, stop, t)

    for module in (rank_sync, trainer):  # the round's start (trainer) and its end (agreed_stop)
        monkeypatch.setattr(module, "agree_settings", counted)

    class Decides(cg.Hook):
        mutates_replicas = False

    def fit(hooks, distributed):
        plan = make_plan(TinyBN, devices=1, replicas=2, kernel_backend="torch",
                            distributed=cg.Distributed(backend="gloo") if distributed else None)
        assert (plan.comm is not None) == distributed
        steps = torch.optim.lr_scheduler.StepLR(plan.optimizer, step_size=5, gamma=0.5)
        plan.fit(tiny_data(40 * 2 * 4), 1, shuffle=False, progress=False, metrics_every=None,
                 hooks=hooks, lr_scheduler=steps, lr_scheduler_interval="round")
        return plan.central_weights()

    z_alone = fit([], False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        z = fit([], True)
        quiet = list(calls)
        calls.clear()
        fit([Decides()], True)
    finally:
        dist.destroy_process_group()
    assert len(quiet) == 1 + 40 // AGREE_EVERY_ROUNDS, quiet
    assert len(calls) >= 40, len(calls)
    torch.testing.assert_close(z, z_alone, atol=0, rtol=0)


_AWAIT_SIGTERM = """
import os, sys, time
sys.path.insert(0, {tests!r})
import crossbow_graph as cg
from _plans import make_plan, tiny_data
out = sys.argv[1]
class AwaitSignal(cg.Hook):  # after round 4: give the test this rank's pid, wait for its signals
    def after_round(self, ctx):
        if ctx.plan.rounds_done == 4:
            with open(os.path.join(out, "rank" + os.environ["RANK"] + ".pid"), "w") as f:
                f.write(str(os.getpid()))
            while not os.path.exists(os.path.join(out, "sent")):
                time.sleep(0.01)
make_plan(replicas=2, executor="inline").fit(
    tiny_data(4 * 2 * 2 * 64), 1, progress=False, metrics_every=None, hooks=[AwaitSignal()],
    checkpoint_dir=os.path.join(out, "ckpt"))
print("the fit returned")
"""


@pytest.mark.slow
def test_sigterm_to_torchrun_and_every_rank_stops_each_rank_once_with_a_checkpoint(tmp_path):
    """SLURM's way: SIGTERM to every rank and to torchrun's agent, which forwards one more to
    each rank. Each rank counts the two as one stop: every rank finishes the same round, rank 0
    writes its checkpoint and announces it, and the ranks exit by themselves before the agent's
    shutdown timeout (torchrun itself exits 1 with its SignalException)."""
    script = tmp_path / "await_sigterm.py"
    script.write_text(_AWAIT_SIGTERM.format(tests=os.path.dirname(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(script),
           str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    pids = [tmp_path / f"rank{r}.pid" for r in range(2)]
    said = ""
    try:
        for _ in range(1800):  # up to ~180 s for round 4 on both ranks
            if all(p.exists() and p.read_text() for p in pids) or agent.poll() is not None:
                break
            time.sleep(0.1)
        for p in pids:  # SLURM's
            os.kill(int(p.read_text()), signal.SIGTERM)
        while said.count("SIGTERM received") < 2 and agent.poll() is None:
            said += agent.stdout.readline()  # both handled: the agent's would not merge with them
        agent.send_signal(signal.SIGTERM)  # torchrun's agent forwards it to every rank
        while said.count("closing signal SIGTERM") < 2 and agent.poll() is None:
            said += agent.stdout.readline()
        (tmp_path / "sent").touch()
        out = said + agent.communicate(timeout=120)[0]
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert out.count("the fit stopped on SIGTERM after") == 1, out[-4000:]  # rank 0 announces it
    assert "the fit returned" not in out and "forcefully exiting" not in out, out[-4000:]
    path, state = load_latest(str(tmp_path / "ckpt"))
    assert 4 <= state["plan"]["rounds_done"] <= 4 + 16, out[-4000:]  # the agreed stop round
    assert f"checkpoint {path} holds its state" in out, out[-4000:]
    assert agent.returncode == 1 and "SignalException" in out, out[-4000:]
