"""Kill and restart a torchft replica group in the middle of a run, many times
(docs/distributed.md, "Fault tolerance").

Starts ``torchft_lighthouse`` and two replica groups, each ``torchrun --standalone
--nproc-per-node 1 -m crossbow_graph train --fault-tolerant`` with its own data shard; the
survivor g0 trains the whole run, g1 is SIGKILLed (torchrun and its worker: torchrun starts the
worker in a process group of its own, so one killpg of torchrun's would leave the worker training) at a
random moment ``--kills`` times and restarted at once; with ``--sigstop`` g1 is
stopped (SIGSTOP) once instead and g0 must evict it within the timeout. With
``--nproc-per-node 2`` every group is two ranks, and ``--kill-one-rank`` SIGKILLs only g1's
last rank (torchrun then ends the other and exits; g1 restarts once it has). Prints, from g0's log,
every membership change and the seconds its sync stalled at each failure, g0's final test
accuracy, and whether processes or shared memory were left behind. Exit status 1 when g0 failed,
hung or something was left.

    python bench/ft_soak.py --kills 10 --sync sma
    python bench/ft_soak.py --kills 0            # the undisturbed run, for its accuracy
    python bench/ft_soak.py --kills 0 --sigstop --sync diloco
    python bench/ft_soak.py --kills 10 --sync diloco --lr 0.002 --resume   # restarts resume
    python bench/ft_soak.py --kills 5 --nproc-per-node 2 --kill-one-rank
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lighthouse(port: int, heartbeat_ms: int) -> subprocess.Popen:
    """``torchft_lighthouse`` on ``port``: quorums of ≥ 1 group, a dead group evicted after
    ``heartbeat_ms`` without a heartbeat, stragglers waited for 1 s."""
    exe = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    return subprocess.Popen([exe, "--bind", f"[::]:{port}", "--min_replicas", "1",
                             "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", str(heartbeat_ms),
                             "--quorum_tick_ms", "50"], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def group(i: int, args: argparse.Namespace, address: str, log: str) -> subprocess.Popen:
    """Replica group g<i> under torchrun (its worker in a process group of its own: ``kill_tree``)."""
    cmd = ["torchrun", "--standalone", "--nproc-per-node", str(args.nproc_per_node),
           "--local-ranks-filter", "0",  # rank 0's output only
           "-m", "crossbow_graph", "train",
           "--fault-tolerant", "--lighthouse", address, "--replica-group", f"g{i}",
           "--data-shard", f"{i}/2", "--devices", "1", "--replicas", "2",
           "--sync", args.sync, "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
           "--train-samples", str(args.train_samples), "--test-samples", "2000",
           "--evals-per-epoch", "1", "--target", "0", "--dist-timeout", str(args.timeout),
           "--seed", str(args.seed), "--quiet"] + (["--lr", str(args.lr)] if args.lr else [])
    cmd += ["--lr-schedule", args.lr_schedule] if args.lr_schedule else []
    if args.resume:  # a checkpoint every epoch; a restart resumes from its group's newest one
        cmd += ["--checkpoint-dir", os.path.join(args.out, f"g{i}-ckpt"), "--resume"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    with open(log, "a") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=ROOT)


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun's workers live in process groups of their own)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid] + [q for child in out for q in tree(int(child))]


def kill_tree(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to ``proc`` and every descendant, the workers first."""
    for pid in reversed(tree(proc.pid)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_last_rank(proc: subprocess.Popen) -> None:
    """SIGKILL the worker of ``proc``'s torchrun with the highest LOCAL_RANK and wait until
    torchrun ended the others and exited."""
    ranks = {}
    for pid in tree(proc.pid)[1:]:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        except OSError:
            continue
        if b"LOCAL_RANK" in env:
            ranks[int(env[b"LOCAL_RANK"])] = pid
    os.kill(ranks[max(ranks)], signal.SIGKILL)
    proc.wait()


def joined(log: str, offset: int, survivor: subprocess.Popen) -> bool:
    """Wait until ``log`` shows, after byte ``offset``, a sync of its group with another live
    group; False when ``survivor`` ended first."""
    while survivor.poll() is None:
        with open(log) as f:
            f.seek(offset)
            if re.search(r"round \d+: [2-9] live group", f.read()):
                return True
        time.sleep(0.2)
    return False


def shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--sigstop", action="store_true", help="stop g1 once instead of killing it")
    p.add_argument("--sync", default="sma", choices=("sma", "diloco"))
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--train-samples", type=int, default=16384)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--timeout", type=float, default=10.0, help="--dist-timeout of the groups")
    p.add_argument("--gap", type=float, nargs=2, default=(2.0, 10.0),
                   help="seconds from g1's joining the run (its first sync) to its kill, drawn "
                        "uniformly: a random round")
    p.add_argument("--lr", type=float, default=None,
                   help="the groups' --lr (OneCycle's peak; default: the CLI's)")
    p.add_argument("--lr-schedule", default=None,
                   choices=("onecycle", "multistep", "cosine", "constant"),
                   help="the groups' --lr-schedule (default: the CLI's, onecycle); a restarted "
                        "group's schedule starts over (--resume: from its checkpoint)")
    p.add_argument("--resume", action="store_true",
                   help="the groups checkpoint every epoch and g1 restarts with --resume (its "
                        "epochs and schedule go on); default: a restart starts its fit afresh")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks per group")
    p.add_argument("--kill-one-rank", action="store_true",
                   help="kill only g1's last rank (torchrun ends the group)")
    p.add_argument("--out", default="/tmp/ft_soak")
    p.add_argument("--json", default=None, help="also write the summary there, as JSON")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    logs = [os.path.join(args.out, f"g{i}.log") for i in range(2)]
    for i, log in enumerate(logs):
        open(log, "w").close()
        shutil.rmtree(os.path.join(args.out, f"g{i}-ckpt"), ignore_errors=True)
    shm_before = shm()
    port = free_port()
    lh = lighthouse(port, heartbeat_ms=1000)
    address = f"http://127.0.0.1:{port}"
    time.sleep(1.0)
    rng = random.Random(args.seed)
    g0 = group(0, args, address, logs[0])
    g1 = group(1, args, address, logs[1])
    seen = 0
    events: list[str] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below still cleans up
    try:
        if args.sigstop:
            joined(logs[1], 0, g0)
            time.sleep(rng.uniform(*args.gap))
            kill_tree(g1, signal.SIGSTOP)
            events.append(f"{time.strftime('%X')} SIGSTOP g1")
            time.sleep(args.timeout + 10)
            kill_tree(g1, signal.SIGKILL)
            g1.wait()
        for n in range(args.kills):
            if not joined(logs[1], seen, g0):
                events.append(f"g1 did not join before g0 ended (kill {n + 1})")
                break
            time.sleep(rng.uniform(*args.gap))
            if g0.poll() is not None:
                events.append(f"g0 ended before kill {n + 1}")
                break
            if args.kill_one_rank:
                kill_last_rank(g1)
            else:
                kill_tree(g1, signal.SIGKILL)
                g1.wait()
            events.append(f"{time.strftime('%X')} SIGKILL g1 (kill {n + 1})")
            seen = os.path.getsize(logs[1])
            g1 = group(1, args, address, logs[1])
        g0.wait(timeout=1800)
    except subprocess.TimeoutExpired:
        events.append("g0 did not finish within 1800 s: hang")
    finally:
        for proc in (g0, g1):  # g1's last start would train its own epochs alone: ended here
            if proc.poll() is None:
                kill_tree(proc, signal.SIGKILL)
                proc.wait()
        os.killpg(lh.pid, signal.SIGKILL)
        lh.wait()
    time.sleep(1.0)
    summary = report(address, logs, events, g0.returncode, shm_before, {g0.pid, g1.pid, lh.pid})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python bench/ft_soak.py " + " ".join(sys.argv[1:]), **summary},
                      f, indent=1)
    return 0 if summary["ok"] else 1


def report(address: str, logs: list[str], events: list[str], rc: int, shm_before: set[str],
           pids: set[int]) -> dict:
    """Prints g0's membership changes and the summary line; the summary."""
    text = open(logs[0]).read()
    changes = re.findall(r"replica group g0: (round \d+: .*)", text)
    stalls = [float(s) for s in re.findall(r"discarded all-reduce\(s\); this sync took ([\d.]+) s", text)]
    shrinks = [float(s) for s in re.findall(r"1 live group\(s\).*took ([\d.]+) s", text)]
    # a rejoin: g1 recovering (2 groups, k = 2) after g0 went on alone after a sync of both (k = 4)
    met = alone = False
    rejoins = 0
    for c in changes:
        met = met or "k = 4 " in c
        rejoins += alone and "2 live group(s), k = 2 " in c
        alone = (alone or met and ": 1 live group" in c) and "2 live group(s)" not in c
    acc = re.findall(r"final test accuracy ([\d.]+)", text)
    epochs = [float(a) for a in re.findall(r"^epoch \d+: .*test accuracy ([\d.]+)", text, re.M)]
    for e in events:
        print(e)
    for c in changes:
        print("g0", c)
    left = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    orphans = subprocess.run(["pgrep", "-f", f"--lighthouse {address} "],
                             capture_output=True, text=True).stdout.split()
    new_shm = sorted(shm() - shm_before)
    kills = sum("SIGKILL" in e for e in events)
    print(f"g0 exit status {rc}; kills {kills}; "
          f"shrinks seen by g0 {len(shrinks)} (sync seconds {shrinks}); syncs with a discarded "
          f"all-reduce {len(stalls)} (seconds {stalls}); rejoins seen by g0 {rejoins}; g0 final "
          f"test accuracy {acc[-1] if acc else '?'}; processes left {left + orphans}; new "
          f"/dev/shm entries {new_shm}")
    return {"g0_exit_status": rc, "kills": kills, "events": events, "shrink_sync_seconds": shrinks,
            "discarded_all_reduce_sync_seconds": stalls, "rejoins": rejoins,
            "test_accuracy_per_epoch": epochs,
            "first_epoch_at_97": next((i + 1 for i, a in enumerate(epochs) if a >= 0.97), None),
            "final_accuracy": float(acc[-1]) if acc else None, "processes_left": left + orphans,
            "new_shm": new_shm, "ok": rc == 0 and not left and not orphans and not new_shm}


if __name__ == "__main__":
    sys.exit(main())
