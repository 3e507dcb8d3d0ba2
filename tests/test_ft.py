"""The fault-tolerant global sync over torchft (docs/distributed.md, "Fault tolerance"): a
Lighthouse process and two replica groups (processes, 2 learners each) on gloo; one group dies
in a sync, the other discards that all-reduce, goes on over the live learners only and finishes.
The options' errors need no torchft; the rest is skipped without it (the ``ft`` extra)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import types

import pytest
import torch

import crossbow_graph as cg
from crossbow_graph.engine.transport.ft import (FaultTolerantSync, check_fault_tolerant,
                                                process_group_for)
from crossbow_graph.errors import DistributedError

from _plans import TinyNet, make_plan
from _reference import default_alpha, default_centre_rate

HERE = os.path.dirname(os.path.abspath(__file__))
ROUNDS = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The tests' Lighthouse, in this process or as a process: one replica suffices, quick ticks
LIGHTHOUSE_FLAGS = {"min_replicas": 1, "join_timeout_ms": 2000, "heartbeat_timeout_ms": 1000,
                    "quorum_tick_ms": 50}


def start_lighthouse(**flags: int):
    """A Lighthouse in this process (torchft's server, the one ``torchft_lighthouse`` runs, as
    torchft's own tests start it: no process to start, no second import of torch) on a free
    port; (the server, its address)."""
    pytest.importorskip("torchft", reason="torchft is the 'ft' extra")
    from torchft.coordination import LighthouseServer  # torchft is optional: the "ft" extra

    server = LighthouseServer(bind="[::]:0", **{**LIGHTHOUSE_FLAGS, **flags})
    return server, f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"


def start_lighthouse_process(**flags: int) -> tuple[subprocess.Popen, str]:
    """``torchft_lighthouse`` on a free port, for a test that kills it (a server in this process
    stops listening when shut down but goes on answering the connections it has); (the process,
    its address)."""
    port = _free_port()
    args = {**LIGHTHOUSE_FLAGS, **flags}
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse"),
           "--bind", f"[::]:{port}"] + [x for k, v in args.items() for x in (f"--{k}", str(v))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90  # it imports torch: slow on a loaded machine
    while time.monotonic() < deadline:  # wait until it listens
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("torchft_lighthouse did not listen within 90 s")


def stop_all(procs, lighthouse) -> None:
    """Kill and reap the group processes still running, then shut the Lighthouse down."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    lighthouse.shutdown()


def sma_z(z: torch.Tensor, w_before: torch.Tensor) -> torch.Tensor:
    """z after a sync of SMA with μ_z = 0 and the default α, β over the k live learners' weights
    at the round's start ``w_before`` ``[k, P]``: z + (β/k)·Σ_j (ŵ_j − z), β =
    ``default_centre_rate(k, default_alpha(k, 0), 0)`` (k·α up to k = 2); in float64, returned as
    float32."""
    k = w_before.shape[0]
    beta = default_centre_rate(k, default_alpha(k, 0.0), 0.0)
    return (z.double() + beta / k * (w_before.double() - z.double()).sum(0)).float()


def z_before(result: dict, t: int) -> torch.Tensor:
    """z at round t's start: z after round t − 1 (the replicas' common start at t = 0)."""
    return result["z_after"][t - 1] if t else result["w_before"][0][0]


def run_groups(tmp_path, sync: str, die: dict[str, int], timeout_s: float = 150, phase: str = "",
               min_replicas: int = 1, rounds: dict[str, int] | None = None, stop: bool = False,
               devices: dict[str, str] | None = None, errors: bool = False):
    """Groups g0, g1 (those of ``devices``, each on its device, when given; else on the CPU) of
    tests/_ft_group.py against a fresh Lighthouse; {group: result}. With
    ``phase="pace"`` g0 paces itself once alone, and a group of ``die`` is restarted (without
    dying) once it died; with ``stop`` too, the groups of ``die`` stop (SIGSTOP) instead of
    dying and are continued (SIGCONT) once g0 synced alone."""
    pytest.importorskip("torchft", reason="torchft is the 'ft' extra")
    lighthouse, address = start_lighthouse(min_replicas=min_replicas)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RUST_LOG")}
    env.update(TORCHFT_LIGHTHOUSE=address, PYTHONPATH=os.path.dirname(HERE), OMP_NUM_THREADS="1",
               FT_DIE_SIGNAL="STOP" if stop else "KILL")
    os.makedirs(tmp_path, exist_ok=True)
    rounds = rounds or {}

    devices = devices or {"g0": "", "g1": ""}

    def start(g: str, dies: int, phase: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, os.path.join(HERE, "_ft_group.py"), str(tmp_path),
                                 g, sync, str(rounds.get(g, ROUNDS)), str(dies), phase],
                                env={**env, "FT_DEVICE": devices[g]},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    procs = {g: start(g, die.get(g, -1), phase if g == "g0" or phase != "pace" else "")
             for g in devices}
    try:
        if phase == "pace" and stop:  # the stopped group goes on once g0 went on without it
            deadline = time.monotonic() + timeout_s
            while not (tmp_path / "g0.alone").exists() and procs["g0"].poll() is None \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
            for g in die:  # (also when it never stopped: g0 ended or never synced alone)
                os.kill(procs[g].pid, signal.SIGCONT)
        elif phase == "pace":  # the dead group starts again and rejoins
            for g in die:
                procs[g].communicate(timeout=timeout_s)
                procs[g] = start(g, -1, "")
        die = {} if phase == "pace" else die
        logs = {g: p.communicate(timeout=timeout_s)[0] for g, p in procs.items()}
    finally:
        stop_all(procs.values(), lighthouse)
    results = {}
    for g, p in procs.items():
        if g in die:
            assert p.returncode == -9, (g, p.returncode, logs[g][-3000:])
        else:
            assert p.returncode == 0, (g, p.returncode, logs[g][-3000:])
            results[g] = torch.load(tmp_path / f"{g}.pt", weights_only=False)
            assert errors or "error" not in results[g], results[g]["error"]
            results[g]["log"] = logs[g]
    return results


def _after_four(changes: list[dict]) -> dict:
    """The first membership change after the first sync of both groups' 4 learners (whichever
    group reached the Lighthouse first may have synced alone, or recovered, before it)."""
    ks = [(c["groups"], c["learners"]) for c in changes]
    assert (2, 4) in ks, changes
    return changes[ks.index((2, 4)) + 1]


@pytest.mark.distributed
def test_sma_survivor_discards_the_failed_all_reduce_and_averages_the_live_learners(tmp_path):
    """g1 dies in a sync from round 3 on (tests/_ft_group.py): g0's all-reduce of that round is
    discarded, the quorum shrinks to g0 and z after that round is SMA's over g0's 2 learners'
    weights at the round's start (``sma_z``, α for k = 2; float32 summation order: rtol 1e-6);
    in the round before, z is SMA's over 4 learners; g0 finishes all rounds."""
    r = run_groups(tmp_path, "sma", {"g1": 3})["g0"]
    assert r["rounds"] == ROUNDS
    failure = _after_four(r["membership"])
    t0 = failure["round_index"]
    assert t0 >= 3 and failure["failed_attempts"] >= 1, r["membership"]
    assert (failure["groups"], failure["learners"]) == (1, 2)
    for t in range(t0, ROUNDS):  # g0 alone: z ← SMA over its learners at the round's start
        torch.testing.assert_close(r["z_after"][t], sma_z(z_before(r, t), r["w_before"][t]),
                                   rtol=1e-6, atol=1e-7)
    # with four learners z is not g0's alone: g1's learners were in it
    assert not torch.allclose(r["z_after"][t0 - 1], sma_z(z_before(r, t0 - 1), r["w_before"][t0 - 1]),
                              rtol=1e-4, atol=1e-5)
    assert "1 live group(s), k = 2 learners" in r["summary"]


@pytest.mark.distributed
def test_a_hung_group_is_evicted_and_rejoins_when_continued(tmp_path):
    """g1 stops (SIGSTOP) in a sync's all-reduce from round 3 on: g0's all-reduce fails at the
    gloo timeout (``timeout_s`` 10), is discarded, the Lighthouse has evicted g1 (no heartbeat
    for 1 s), and g0 goes on with z SMA's over its own learners. Continued (SIGCONT) once g0
    synced alone, g1's stale all-reduce fails (g0 left that process group), is discarded, and g1
    rejoins at the next quorum, recovering z from g0: then as a restarted group (below)."""
    for attempt in range(3):  # see the restarted-group test: both groups must meet first
        r = run_groups(tmp_path / str(attempt), "sma", {"g1": 3}, phase="pace", stop=True,
                       rounds={"g0": 400, "g1": 60})
        if _stopped_and_back(r["g0"]["membership"]):
            break
    g0, g1 = r["g0"], r["g1"]
    failure = _after_four(g0["membership"])
    assert failure["round_index"] >= 3 and failure["failed_attempts"] >= 1, g0["membership"]
    back = _assert_rejoined(g0, g1)
    for t in range(failure["round_index"], back):  # g0 alone: SMA over its own learners
        torch.testing.assert_close(g0["z_after"][t], sma_z(z_before(g0, t), g0["w_before"][t]),
                                   rtol=1e-6, atol=1e-7)
    recovered = [c for c in g1["membership"] if c["recovered"]][-1]
    assert recovered["failed_attempts"] >= 1, g1["membership"]  # its stale all-reduce
    print(f"stall of the hung group's sync: {failure['seconds']:.2f} s")


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    """Both groups, SMA, no failure, ROUNDS rounds (the Lighthouse waits for both): {group:
    result}; only read by the tests that share it."""
    return run_groups(tmp_path_factory.mktemp("undisturbed"), "sma", {}, min_replicas=2)


@pytest.mark.distributed
def test_two_groups_undisturbed_keep_the_same_z(undisturbed):
    """No failure: both groups hold the same z bit for bit after every round (the same
    all-reduced sum, the same update), k = 4 throughout; no line of torchft's per-sync log."""
    r = undisturbed
    for t in range(ROUNDS):
        assert torch.equal(r["g0"]["z_after"][t], r["g1"]["z_after"][t]), t
    assert [(c["groups"], c["learners"]) for c in r["g0"]["membership"]] == [(2, 4)]
    # torchft's per-sync INFO lines (its Rust log, its Python loggers under the groups' INFO
    # logging config) stay out of the output; the membership change is in it
    log = r["g0"]["log"]
    assert "replica group g0: round 0: 2 live group(s), k = 4 learners" in log, log[-3000:]
    for line in log.splitlines():
        assert "[INFO]" not in line and ":torchft" not in line, line
        assert "flight recorder" not in line, line


@pytest.mark.distributed
@pytest.mark.parametrize("sync", ["sma", "diloco"])
def test_a_restarted_group_rejoins_and_recovers_z_and_the_outer_state(tmp_path, sync):
    """g1 dies in a sync from round 3 on and starts again; it joins at the next quorum, receives z, z_prev
    and (DiLoCo) the outer optimizer's state from g0 and contributes from the sync after: from its
    recovery on both groups hold the same z bit for bit after every sync (a wrong momentum
    would part them), and g0's k goes 4 → 2 → 4."""
    # g1 outlives g0's six rounds after its rejoin (its recovery may take several of its rounds).
    # The scenario needs the Lighthouse to put the groups in one quorum before g1 dies and again
    # after its restart; two independent processes' timing can miss that (a group that runs
    # alone throughout), so the scenario runs again, at most three times, until it happened.
    for attempt in range(3):
        r = run_groups(tmp_path / str(attempt), sync, {"g1": 3}, phase="pace",
                       rounds={"g0": 400, "g1": 60})
        if _stopped_and_back(r["g0"]["membership"]):
            break
    _assert_rejoined(r["g0"], r["g1"])


def _stopped_and_back(changes: list[dict]) -> bool:
    """g0's k went 4 → 2 after a sync of both groups and ends at 4."""
    ks = [(c["groups"], c["learners"]) for c in changes]
    return (2, 4) in ks and ks[-1] == (2, 4) and (1, 2) in ks[ks.index((2, 4)):]


def _assert_rejoined(g0: dict, g1: dict) -> int:
    """g1 recovered from g0 in a quorum of both after g0 went on alone, g0's k went 4 → 2 → 4,
    and from g1's recovery on both hold the same z bit for bit after every sync (at least 5);
    g0's round of that recovery."""
    # the last recovery (g1's first quorum may come before g0 asks: alone, then it recovers; a
    # continued g1 may also have recovered when it first arrived)
    first = ([c for c in g1["membership"] if c["recovered"] and c["groups"] == 2] or [None])[-1]
    assert first is not None, (g1["membership"], g0["membership"], g0["rounds"], len(g1["z_after"]))
    failure = _after_four(g0["membership"])
    assert failure["round_index"] >= 3 and (failure["groups"], failure["learners"]) == (1, 2)
    assert (g0["membership"][-1]["groups"], g0["membership"][-1]["learners"]) == (2, 4)
    back = next(c["round_index"] for c in g0["membership"]
                if c["round_index"] > failure["round_index"] and (c["groups"], c["learners"]) == (2, 2))
    shared = min(g0["rounds"] - back, len(g1["z_after"]) - first["round_index"])
    assert shared >= 5
    for i in range(shared):
        assert torch.equal(g0["z_after"][back + i], g1["z_after"][first["round_index"] + i]), i
    return back


_DIFFERENCES = {"seed": {"FT_SEED_g1": "1"}, "sma": {"FT_MOMENTUM_g1": "0.5"},
                "lr": {"FT_LR_g1": "0.1"}, "optimizer": {"FT_OPTIMIZER_g1": "adamw"},
                "batch_size": {"FT_BATCH_g1": "8"}}


@pytest.fixture(scope="module")
def differing_runs(tmp_path_factory):
    """Each difference of ``_DIFFERENCES`` (g1's variables), one after the other in the same
    two group processes (phase ``cases``: a new plan and Manager per case), each case against a
    Lighthouse of its own that waits for both groups (so that no group meets another case's);
    {case: {group: result}}."""
    tmp_path = tmp_path_factory.mktemp("differ")
    lighthouses = [start_lighthouse(min_replicas=2) for _ in _DIFFERENCES]
    try:
        with open(tmp_path / "cases.json", "w") as f:
            json.dump({case: {**env, "TORCHFT_LIGHTHOUSE": address}
                       for (case, env), (_, address) in zip(_DIFFERENCES.items(), lighthouses)}, f)
        r = run_groups(tmp_path, "sma", {}, phase="cases", min_replicas=2, errors=True)
    finally:
        for lighthouse, _ in lighthouses:
            lighthouse.shutdown()
    return {case: {g: {**r[g][case], "log": r[g]["log"]} for g in r} for case in _DIFFERENCES}


@pytest.mark.distributed
@pytest.mark.parametrize("case, says", [
    ("seed", "hold another z"),
    ("sma", "run another computation"),
    ("lr", r"other hyper-parameters: .* \(this group's: SGD\(lr=0\.(1|05), momentum"),
    ("optimizer", r"other hyper-parameters: .* \(this group's: (AdamW|SGD)\(lr"),
    ("batch_size", r"other hyper-parameters: .*, b = (4|8)\)")],
    ids=list(_DIFFERENCES))
def test_groups_that_differ_stop_at_their_first_sync_naming_the_difference(differing_runs, case,
                                                                          says):
    """g1 compiled with another seed (z differs), another SMA (μ_z 0.5), another learning rate,
    optimizer or batch size (what plain torchrun refuses at start-up): at the first quorum of
    both, every group stops with a DistributedError naming what differs, before any sum of the
    two is applied."""
    r = differing_runs[case]
    for g in ("g0", "g1"):
        assert re.search(says, r[g].get("error", "")), (g, r[g].get("error"), r[g]["log"][-2000:])
        assert r[g]["z_after"] == []  # the first round did not end: no sum of the two applied


@pytest.mark.distributed
def test_a_checkpointed_run_resumes_bit_identically_when_nothing_fails(tmp_path, undisturbed):
    """SMA: both groups stop after 4 rounds with a checkpoint and resume from it (new processes,
    new Managers): z after the last round equals the undisturbed run's bit for bit, on both."""
    whole = undisturbed
    run_groups(tmp_path / "parts", "sma", {}, phase="first", min_replicas=2)
    resumed = run_groups(tmp_path / "parts", "sma", {}, phase="resume", min_replicas=2)
    for g in ("g0", "g1"):
        assert len(resumed[g]["z_after"]) == ROUNDS - 4
        assert torch.equal(resumed[g]["z_after"][-1], whole[g]["z_after"][-1]), g


_LONE_GROUP = """
import os, sys, time
sys.path.insert(0, {tests!r})
import crossbow_graph as cg
from crossbow_graph.errors import DistributedError
from _plans import TinyNet, make_plan, tiny_data
out = sys.argv[1]
class AfterFour(cg.Hook):  # after round 4: tell the test, wait until it killed the Lighthouse
    def after_round(self, ctx):
        if ctx.plan.rounds_done == 4:
            open(os.path.join(out, "round4"), "w").close()
            while not os.path.exists(os.path.join(out, "killed")):
                time.sleep(0.05)
dist = cg.Distributed(fault_tolerant=True, replica_group="g0", timeout_s=2.0, ft_attempts=3)
try:
    make_plan(TinyNet, replicas=2, distributed=dist).fit(tiny_data(), 1, progress=False,
                                                        metrics_every=None, hooks=[AfterFour()])
except DistributedError as exc:
    print("ERROR:", exc)
"""


@pytest.mark.distributed
def test_a_group_whose_lighthouse_is_gone_stops_naming_it_and_the_fix(tmp_path):
    """The Lighthouse killed after round 4: each discarded sync attempt's warning and the
    DistributedError after ft_attempts × timeout_s name its address, say that nothing listens
    there and how to go on; torchft's raw gRPC text is not printed."""
    pytest.importorskip("torchft", reason="torchft is the 'ft' extra")
    lighthouse, address = start_lighthouse_process()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "RUST_LOG")}
    env.update(TORCHFT_LIGHTHOUSE=address, PYTHONPATH=os.path.dirname(HERE), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", _LONE_GROUP.format(tests=HERE), str(tmp_path)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(1200):  # up to ~120 s for round 4
            if (tmp_path / "round4").exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        lighthouse.kill()
        lighthouse.wait()
        (tmp_path / "killed").touch()
        log = proc.communicate(timeout=150)[0]
    finally:
        for p in (proc, lighthouse):
            if p.poll() is None:
                p.kill()
            p.wait()
    port = address.rsplit(":", 1)[1]
    gone = f"the Lighthouse at {address} does not answer: nothing listens there"
    assert log.count(f"discarded ({gone}") == 3, log[-3000:]
    assert (f"ERROR: replica group g0: the global sync of round 4 did not commit in 3 attempts"
            in log), log[-3000:]
    assert (f"the last: {gone} (it stopped, or was never started there). Restart the Lighthouse "
            f"there (torchft_lighthouse --min_replicas 1 --bind [::]:{port}), then this group from "
            "its checkpoint (resume=True, --resume)") in log, log[-3000:]
    assert "MetadataMap" not in log and "status:" not in log


def test_the_global_sync_runs_over_nccl_on_a_cuda_device_and_over_gloo_on_the_host():
    """The plan's first device picks torchft's process group and where its all-reduce runs."""
    pytest.importorskip("torchft", reason="torchft is the 'ft' extra")
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    assert process_group_for("cpu:0") == (ProcessGroupGloo, torch.device("cpu"))
    assert process_group_for("cpu:1") == (ProcessGroupGloo, torch.device("cpu"))
    assert process_group_for("cuda:0") == (ProcessGroupNCCL, torch.device("cuda:0"))
    assert process_group_for("cuda:1") == (ProcessGroupNCCL, torch.device("cuda:1"))


@pytest.mark.gpu
@pytest.mark.distributed
def test_a_group_on_a_gpu_syncs_over_nccl(tmp_path):
    """One group on cuda:0 (one GPU suffices: NCCL refuses two groups on one GPU): its sync
    runs over torchft's NCCL group, and z after every round is SMA's over its 2 learners'
    weights at the round's start (``sma_z``; the GPU's summation order: rtol 1e-5)."""
    r = run_groups(tmp_path, "sma", {}, devices={"g0": "cuda:0"})["g0"]
    assert r["backend"] == "torchft-nccl"
    assert [(c["groups"], c["learners"]) for c in r["membership"]] == [(1, 2)]
    for t in range(ROUNDS):
        torch.testing.assert_close(r["z_after"][t], sma_z(z_before(r, t), r["w_before"][t]),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.distributed
def test_two_groups_on_two_gpus_keep_the_same_z_over_nccl(tmp_path):
    """g0 on cuda:0, g1 on cuda:1, undisturbed: the same z bit for bit after every round, k = 4."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (NCCL refuses two groups on one)")
    r = run_groups(tmp_path, "sma", {}, min_replicas=2, devices={"g0": "cuda:0", "g1": "cuda:1"})
    assert r["g0"]["backend"] == r["g1"]["backend"] == "torchft-nccl"
    for t in range(ROUNDS):
        assert torch.equal(r["g0"]["z_after"][t], r["g1"]["z_after"][t]), t
    assert [(c["groups"], c["learners"]) for c in r["g0"]["membership"]] == [(2, 4)]


def test_fault_tolerant_options_are_checked_before_training():
    """Bad settings: clear errors naming the fix, before torchft is needed."""
    with pytest.raises(ValueError, match="sync_dtype='fp32'"):
        cg.Distributed(fault_tolerant=True, sync_dtype="bf16")
    with pytest.raises(ValueError, match="min_replicas"):
        cg.Distributed(fault_tolerant=True, min_replicas=0)
    with pytest.raises(ValueError, match="use SMA, DiLoCo or LocalSGD"):
        check_fault_tolerant(cg.SSGD(), "auto", 2)
    with pytest.raises(ValueError, match="executor='inline'"):
        check_fault_tolerant(cg.SMA(), "process", 2)
    with pytest.raises(ValueError, match="replicas ≥ 2"):
        check_fault_tolerant(cg.SMA(), "auto", 1)
    check_fault_tolerant(cg.DiLoCo(sync_every=2), "auto", 1)  # one learner per group is DiLoCo's own


def test_a_lighthouse_address_is_checked_before_training():
    """An address without its scheme is refused at once; one where nothing listens after the
    connect timeout, naming the address and torchft_lighthouse (no torchft traceback)."""
    pytest.importorskip("torchft", reason="torchft is the 'ft' extra")
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        FaultTolerantSync(cg.Distributed(fault_tolerant=True, lighthouse="127.0.0.1:29510"))
    address = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(ValueError, match=f"no Lighthouse answered at {address}.*torchft_lighthouse"):
        FaultTolerantSync(cg.Distributed(fault_tolerant=True, lighthouse=address, timeout_s=1.0))


def test_a_joiner_of_another_model_stops_in_its_recovery():
    """A peer's z of another size: ``_load`` raises a DistributedError naming both sizes, and
    the attempt passes it on (not a discarded quorum, retried)."""
    ft = FaultTolerantSync.__new__(FaultTolerantSync)  # no Manager: the recovery alone
    ft.replica_group, ft.device = "g1", torch.device("cpu")
    ft.host = make_plan(TinyNet).rounds.transport.host  # the engine a recovering group serves
    with pytest.raises(DistributedError, match="z has 230 parameters, this group's 466"):
        ft._load({"z": torch.zeros(230)})

    def recover():
        ft._load({"z": torch.zeros(230)})
    ft.manager = types.SimpleNamespace(start_quorum=recover)
    with pytest.raises(DistributedError, match="same model"):
        ft._attempt(torch.zeros(3))


def test_without_torchft_the_error_names_the_extra(monkeypatch):
    """``import torchft`` failing: ImportError naming the ``ft`` extra."""
    from crossbow_graph.engine.transport import ft

    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    with pytest.raises(ImportError, match=r"crossbow_graph\[ft\]"):
        ft.import_torchft()
