"""A fit's intra-op threads on CPU devices: chosen from the cores other processes leave free
(``fit(cpu_threads="auto")``, the default), or as given; torch's setting is given back after the
fit and the choice is in the History and the CLI's last line (engine/threads.py; docs/runtime.md,
Threads on a busy host)."""

from __future__ import annotations

import pytest
import torch

import crossbow_graph as cg
import crossbow_graph.engine.threads as threads
from crossbow_graph.cli import main

from _plans import make_plan, tiny_data

FIT = dict(progress=False, metrics_every=None)


class SeenThreads(cg.Hook):
    """torch's intra-op threads in every round."""

    mutates_replicas = False

    def __init__(self) -> None:
        self.seen: list[int] = []

    def after_round(self, ctx) -> None:
        self.seen.append(torch.get_num_threads())


@pytest.fixture
def two_threads():
    """torch set to 2 intra-op threads for the test, the caller's setting back after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _fit(monkeypatch=None, free=None, **kw):
    if free is not None:  # the host's load, as /proc/stat would show it
        monkeypatch.setattr(threads, "free_cores", lambda: free)
    seen = SeenThreads()
    history = make_plan(replicas=1, executor="inline").fit(tiny_data(32), 1, hooks=[seen], **FIT, **kw)
    return history, seen.seen


def test_on_a_busy_host_a_fit_runs_one_thread_and_gives_torchs_setting_back(monkeypatch,
                                                                           two_threads):
    """Two busy neighbours leave 0.3 of 2 cores free: the fit runs 1 intra-op thread instead of
    torch's 2 (whose barriers would wait on descheduled threads at every operator), says so in
    its History, and torch has 2 again after it."""
    history, seen = _fit(monkeypatch, free=0.3)
    assert seen == [1] * 8
    assert (history.cpu_threads, history.free_cores) == (1, 0.3)
    assert torch.get_num_threads() == 2


def test_on_an_idle_host_auto_keeps_torchs_setting(monkeypatch, two_threads):
    history, seen = _fit(monkeypatch, free=2.0)
    assert seen == [2] * 8 and history.cpu_threads == 2
    torch.set_num_threads(1)  # never more than the caller's setting
    history, seen = _fit(monkeypatch, free=2.0)
    assert seen == [1] * 8 and history.cpu_threads == 1


def test_a_given_count_is_used_and_none_leaves_torchs_setting(two_threads):
    history, seen = _fit(cpu_threads=1)
    assert seen == [1] * 8 and (history.cpu_threads, history.free_cores) == (1, None)
    assert torch.get_num_threads() == 2
    history, seen = _fit(cpu_threads=None)
    assert seen == [2] * 8 and (history.cpu_threads, history.free_cores) == (2, None)


def test_the_free_cores_are_measured_on_this_host(two_threads):
    history, seen = _fit()
    assert 0.0 <= history.free_cores <= threads.available_cores()
    assert 1 <= history.cpu_threads <= 2 and seen == [history.cpu_threads] * 8


@pytest.mark.parametrize("value", [0, -1, "all", 1.5])
def test_a_bad_thread_count_is_refused(value):
    with pytest.raises(ValueError, match=rf"cpu_threads={value!r}: use 'auto'"):
        _fit(cpu_threads=value)


def test_the_cli_says_how_many_threads_it_ran(capsys, tmp_path):
    assert main(["train", "--epochs", "1", "--train-samples", "512", "--target", "0", "--quiet",
                 "--cpu-threads", "1", "--lr-schedule", "constant"]) == 0
    assert "samples/s, 1 intra-op thread (as set)" in capsys.readouterr().out


def test_a_resumed_fit_runs_the_threads_its_checkpoint_ran_with(monkeypatch, two_threads, tmp_path):
    """A fit chose 1 thread on a busy host and was cut short; the host is idle at the resume
    (auto would choose 2), but the resumed rounds run the checkpoint's 1, so they round as the
    uninterrupted fit's would; a count given to the resumed fit wins."""
    monkeypatch.setattr(threads, "free_cores", lambda: 0.3)
    make_plan(replicas=1, executor="inline").fit(tiny_data(32), 1, checkpoint_dir=str(tmp_path),
                                                 checkpoint_every=3, **FIT)
    for name in sorted(p.name for p in tmp_path.glob("ckpt-*.pt"))[1:]:  # keep round 3's only
        (tmp_path / name).unlink()
    monkeypatch.setattr(threads, "free_cores", lambda: 2.0)
    seen = SeenThreads()
    history = make_plan(replicas=1, executor="inline").fit(
        tiny_data(32), 1, checkpoint_dir=str(tmp_path), resume=True, hooks=[seen], **FIT)
    assert seen and set(seen.seen) == {1} and history.cpu_threads == 1
    seen = SeenThreads()
    history = make_plan(replicas=1, executor="inline").fit(
        tiny_data(32), 2, checkpoint_dir=str(tmp_path), resume=True, hooks=[seen], cpu_threads=2,
        **FIT)
    assert seen and set(seen.seen) == {2} and history.cpu_threads == 2
