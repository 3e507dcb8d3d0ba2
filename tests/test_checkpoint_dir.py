"""A checkpoint directory: one fit at a time (its lock), another run's checkpoints refused, a
full disk or a file-size limit, a directory named like a checkpoint, and SIGTERM (finish the
round, checkpoint, exit 143) (docs/reliability.md)."""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import crossbow_graph as cg
from crossbow_graph import cli
from crossbow_graph.errors import CheckpointError, TrainingInterrupted
from crossbow_graph.training.checkpoint import list_checkpoints, load_latest
from crossbow_graph.training.hooks import Hook

from test_checkpoint import ROOT, Counter, StopAfter, assert_same_state, data, net_plan


# -- one fit per directory ------------------------------------------------------------------------


class _Hold(Hook):
    """Holds its fit after round 1 until ``release`` is set (a fit that keeps running)."""

    def __init__(self) -> None:
        self.holding, self.release = threading.Event(), threading.Event()

    def after_round(self, ctx) -> None:
        if ctx.plan.rounds_done == 1:
            self.holding.set()
            self.release.wait(timeout=120)


def test_a_second_fit_in_a_directory_in_use_is_refused_naming_the_holder(tmp_path):
    """A fit runs in a thread of this process and holds the directory: a second fit there stops
    before any round, naming the directory, the holder's pid and the fix; once the first ends, the
    directory is free (and its lock file gone)."""
    ckpt, hold = str(tmp_path), _Hold()
    first = net_plan(executor="inline")
    runner = threading.Thread(target=lambda: first.fit(data(), 1, progress=False, hooks=[hold],
                                                       checkpoint_dir=ckpt, checkpoint_every=1))
    runner.start()
    try:
        assert hold.holding.wait(timeout=120)
        second, rounds = net_plan(executor="inline"), Counter()
        with pytest.raises(CheckpointError, match=rf"checkpoint_dir='{re.escape(ckpt)}' is in use by "
                                                  rf"another fit \(pid {os.getpid()} on .*\); .*Pass "
                                                  r"another checkpoint_dir, or wait until that fit ends"):
            second.fit(data(), 1, progress=False, hooks=[rounds], checkpoint_dir=ckpt, resume=True)
        assert rounds.seen == 0 and second.rounds_done == 0
    finally:
        hold.release.set()
        runner.join(timeout=120)
    assert first.rounds_done == 6
    assert sorted(os.listdir(ckpt)) == ["ckpt-0000000005.pt", "ckpt-0000000006.pt"]
    net_plan().fit(data(), 2, progress=False, checkpoint_dir=ckpt, resume=True)  # free again


def test_a_fresh_fit_into_another_runs_checkpoints_is_refused(tmp_path):
    """resume=False where the newest checkpoint is another run's: refused before any round (its
    files would mix with this fit's, and keeping the newest two by round would delete this
    fit's); the plan that wrote them goes on writing there, and resume=True continues them."""
    ckpt = str(tmp_path)
    writer = net_plan()
    writer.fit(data(), 1, progress=False, checkpoint_dir=ckpt, checkpoint_every=2)
    other, rounds = net_plan(), Counter()
    with pytest.raises(CheckpointError, match=r"holds 2 checkpoint\(s\) of another run \(the newest "
                                              r"ckpt-0000000006\.pt\) and resume=False.*Pass "
                                              r"resume=True to continue that run, another "
                                              r"checkpoint_dir for a new one, or delete"):
        other.fit(data(), 1, progress=False, hooks=[rounds], checkpoint_dir=ckpt)
    assert rounds.seen == 0 and other.rounds_done == 0
    writer.fit(data(), 1, progress=False, checkpoint_dir=ckpt)  # its own: continues
    assert [os.path.basename(p) for p in list_checkpoints(ckpt)] == ["ckpt-0000000006.pt",
                                                                     "ckpt-0000000012.pt"]
    resumed = net_plan()
    resumed.fit(data(), 3, progress=False, checkpoint_dir=ckpt, resume=True)
    resumed.fit(data(), 1, progress=False, checkpoint_dir=ckpt)  # resumed from there: its own now
    assert resumed.rounds_done == 24


# -- a full disk, a directory named like a checkpoint --------------------------------------------


def test_a_full_disk_names_the_file_and_the_bytes_and_keeps_the_previous(tmp_path, monkeypatch):
    """ENOSPC in the third write: CheckpointError naming the file, the bytes it needed and the
    intact previous checkpoint; no temporary file is left, and resuming from the previous one is
    bit-identical to an uninterrupted run."""
    import crossbow_graph.training.checkpoint_files as files

    real, calls = files._write_all, [0]

    def full_disk(f, payload):
        calls[0] += 1
        if calls[0] == 3:
            f.write(payload[:100])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(f, payload)

    monkeypatch.setattr(files, "_write_all", full_disk)
    ckpt = str(tmp_path)
    with pytest.raises(CheckpointError) as err:
        net_plan().fit(data(), 1, progress=False, checkpoint_dir=ckpt, checkpoint_every=1)
    size = os.path.getsize(os.path.join(ckpt, "ckpt-0000000002.pt"))  # about a checkpoint's size
    needed = int(re.search(r"it needs ([\d,]+) bytes", str(err.value)).group(1).replace(",", ""))
    assert abs(needed - size) < size // 10
    assert re.search(rf"cannot write checkpoint {re.escape(ckpt)}/ckpt-0000000003\.pt: No space "
                     rf"left on device \(errno 28\): it needs [\d,]+ bytes and {re.escape(ckpt)} has "
                     rf"[\d,]+ bytes free; the previous checkpoint {re.escape(ckpt)}/"
                     r"ckpt-0000000002\.pt is intact", str(err.value)), str(err.value)
    assert sorted(os.listdir(ckpt)) == ["ckpt-0000000001.pt", "ckpt-0000000002.pt"]
    monkeypatch.setattr(files, "_write_all", real)
    full, resumed = net_plan(), net_plan()
    full.fit(data(), 1, progress=False)
    resumed.fit(data(), 1, progress=False, checkpoint_dir=ckpt, resume=True)
    assert_same_state(full, resumed)


_FILE_SIZE_LIMIT = textwrap.dedent("""
    import os, resource, signal, sys
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {tests!r})
    from crossbow_graph.errors import CheckpointError
    from crossbow_graph.training.hooks import Hook
    from test_checkpoint import net_plan, data
    ckpt = sys.argv[1]
    class Limit(Hook):  # runs before round 2's checkpoint: files may not grow past half of one
        def after_round(self, ctx):
            if ctx.plan.rounds_done == 2:
                half = os.path.getsize(os.path.join(ckpt, "ckpt-0000000001.pt")) // 2
                resource.setrlimit(resource.RLIMIT_FSIZE, (half, resource.RLIM_INFINITY))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
    try:
        net_plan(executor="inline").fit(data(), 1, progress=False, checkpoint_dir=ckpt,
                                         checkpoint_every=1, hooks=[Limit()])
    except CheckpointError as exc:
        print(exc)
""")


def test_a_file_size_limit_is_a_clear_error(tmp_path):
    """A real EFBIG (RLIMIT_FSIZE in a subprocess): the error names the file, the bytes and the
    limit; the previous checkpoint loads."""
    ckpt = str(tmp_path)
    script = _FILE_SIZE_LIMIT.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
    out = subprocess.run([sys.executable, "-c", script, ckpt], capture_output=True, text=True,
                         timeout=300)
    assert re.search(r"cannot write checkpoint .*ckpt-0000000002\.pt: File too large \(errno 27\): "
                     r"it needs [\d,]+ bytes and the process's file-size limit \(ulimit -f\) is "
                     r"[\d,]+ bytes; the previous checkpoint .*ckpt-0000000001\.pt is intact",
                     out.stdout), out.stdout + out.stderr[-3000:]
    assert load_latest(ckpt)[1]["plan"]["rounds_done"] == 1
    assert not [n for n in os.listdir(ckpt) if n.endswith(".tmp")]


def test_a_directory_named_like_a_checkpoint_is_skipped_with_a_warning(tmp_path, caplog):
    ckpt = str(tmp_path)
    net_plan().fit(data(), 1, progress=False, hooks=[StopAfter(4)], checkpoint_dir=ckpt,
                   checkpoint_every=2)
    os.mkdir(os.path.join(ckpt, "ckpt-0000000009.pt"))
    full, resumed = net_plan(), net_plan()
    full.fit(data(), 1, progress=False)
    with caplog.at_level(logging.WARNING, logger="crossbow_graph.checkpoint"):
        resumed.fit(data(), 1, progress=False, checkpoint_dir=ckpt, checkpoint_every=1, resume=True)
    assert "ckpt-0000000009.pt is named like a checkpoint but is not a file" in caplog.text
    assert_same_state(full, resumed)
    assert os.path.isdir(os.path.join(ckpt, "ckpt-0000000009.pt"))  # left alone by the pruning


# -- SIGTERM: finish the round, checkpoint, stop ---------------------------------------------------

_TERMINATED = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {tests!r})
    from crossbow_graph.training.hooks import Hook
    from test_checkpoint import net_plan, data
    marker, sent, ckpt = sys.argv[1], sys.argv[2], sys.argv[3]
    class AwaitSignal(Hook):  # in round 4 (after its learning): tell the test, wait for SIGTERM
        def after_round(self, ctx):
            if ctx.plan.rounds_done == 4:
                open(marker, "w").close()
                while not os.path.exists(sent):
                    time.sleep(0.01)
    net_plan().fit(data(), 2, progress=False, seed=3, checkpoint_dir=ckpt, hooks=[AwaitSignal()])
    print("the fit returned")
""")


@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_finishes_the_round_writes_a_checkpoint_and_exits_143(tmp_path, signals):
    """SIGTERM in round 4 of a fit that checkpoints only at epoch ends (6 rounds each), on the
    process executor: the round finishes, a checkpoint of round 4 is written, the process exits
    with 143 and says so; resuming it is bit-identical to an uninterrupted fit. Two SIGTERMs at
    once (SLURM's and torchrun's agent's, to a rank) are one stop."""
    marker, sent, ckpt = (str(tmp_path / n) for n in ("in-round-4", "sent", "ckpt"))
    script = _TERMINATED.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
    proc = subprocess.Popen([sys.executable, "-c", script, marker, sent, ckpt],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):  # wait (up to ~120 s) for round 4
            if os.path.exists(marker) or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert os.path.exists(marker), proc.communicate()[1][-3000:]
        os.kill(proc.pid, signal.SIGTERM)
        said = ""
        if signals == 2:  # the second once the first was handled (pending ones would merge)
            while "SIGTERM received" not in said and proc.poll() is None:
                said += proc.stderr.readline()
            os.kill(proc.pid, signal.SIGTERM)
        open(sent, "w").close()
        out, err = proc.communicate(timeout=120)
        err = said + err
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "the fit returned" not in out
    assert re.search(r"SIGTERM received: the fit stops after the round in progress", err)
    assert re.search(rf"the fit stopped on SIGTERM after 4 rounds \(round 4 of epoch 1\): checkpoint "
                     rf"{re.escape(ckpt)}/ckpt-0000000004\.pt holds its state; run the same fit "
                     r"with resume=True", err), err[-3000:]
    assert [os.path.basename(p) for p in list_checkpoints(ckpt)] == ["ckpt-0000000004.pt"]
    assert not os.path.exists(os.path.join(ckpt, ".crossbow_graph.lock"))
    full, resumed = net_plan(), net_plan()
    full.fit(data(), 2, progress=False, seed=3)
    resumed.fit(data(), 2, progress=False, seed=3, checkpoint_dir=ckpt, resume=True,
                hooks=[StopAfter(10**6)])  # as many hooks before the metrics monitor
    assert resumed.rounds_done == full.rounds_done == 12
    assert_same_state(full, resumed)


def test_sigterm_handler_is_the_fits_only(tmp_path):
    """The handler is installed for the fit's rounds only: before and after it SIGTERM's handler
    is the caller's; a fit outside the main thread installs none."""
    seen = []

    class Look(Hook):
        def after_round(self, ctx):
            seen.append(signal.getsignal(signal.SIGTERM))

    def mine(signum, frame):
        raise AssertionError("not expected")

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        net_plan(executor="inline").fit(data(), 1, progress=False, hooks=[Look(), StopAfter(1)])
        assert signal.getsignal(signal.SIGTERM) is mine
        assert seen and seen[0] is not mine  # the fit's
        thread = threading.Thread(target=lambda: net_plan(executor="inline").fit(
            data(), 1, progress=False, hooks=[Look(), StopAfter(1)]))
        thread.start()
        thread.join(timeout=120)
        assert seen[-1] is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_cli_exits_143_when_the_fit_is_interrupted(monkeypatch):
    def interrupted(self, *args, **kwargs):
        raise TrainingInterrupted("the fit stopped on SIGTERM after 4 rounds", signal_number=15,
                                  rounds_done=4, checkpoint=None)

    monkeypatch.setattr(cg.Plan, "fit", interrupted)
    assert cli.main(["train", "--train-samples", "64", "--test-samples", "10", "--quiet",
                     "--batch-size", "16", "--devices", "1"]) == 143
