"""Runtime, in process: learner modes, resizing mid-fit, task errors (oracle: hand-written SMA)."""

from __future__ import annotations

import pytest
import torch

import crossbow_graph as cg
from crossbow_graph.compiler.tasks import TaskKind
from crossbow_graph.engine.learning.learners import learn_group, seed_rng
from crossbow_graph.training.hooks import Hook

from _plans import TinyBN, TinyDrop, TinyNet, make_plan, tiny_data
from _reference import batches_of, default_alpha, flat, reference_sma

TOL = dict(rtol=1e-5, atol=1e-6)


def _fit(plan, data, hooks=(), **kw):
    return plan.fit(data, 1, shuffle=False, progress=False, hooks=hooks, **kw)


@pytest.mark.parametrize("mode", ["per_replica", "fused"])
def test_inline_modes_match_hand_written_sma(mode):
    data = tiny_data(40)  # 40 samples = 5 rounds of 2 learners × 4
    plan = make_plan(replicas=2, learner_mode=mode, executor="inline")
    torch.manual_seed(0)
    want = flat(reference_sma(TinyNet(), batches_of(data, 4), ks=[2] * 5, lr=0.05, momentum=0.9)[0])
    _fit(plan, data)
    assert plan.rounds_done == 5
    torch.testing.assert_close(plan.central_weights(), want, **TOL)


def test_fused_and_per_replica_agree_with_batchnorm():
    data = tiny_data(64)
    plans = {mode: make_plan(TinyBN, replicas=3, learner_mode=mode, executor="inline")
             for mode in ("per_replica", "fused")}
    for plan in plans.values():
        _fit(plan, data)
    a, b = plans["per_replica"], plans["fused"]
    torch.testing.assert_close(a.central_weights(), b.central_weights(), **TOL)
    torch.testing.assert_close(a.states[0].zbuf, b.states[0].zbuf, **TOL)  # BN means per replica
    torch.testing.assert_close(a.states[0].buf, b.states[0].buf, **TOL)
    assert not torch.equal(a.states[0].buf[0], a.states[0].buf[1])  # statistics are per replica
    assert a.central_model().bn.num_batches_tracked.item() == b.central_model().bn.num_batches_tracked.item() == 5


def test_seed_rng_seeds_the_cpu_generator_like_manual_seed():
    # the learners seed only their device's generator (torch.manual_seed also seeds every
    # accelerator through slow lazy calls); on the CPU the draws must be torch.manual_seed's
    torch.manual_seed(1234)
    want = torch.rand(5)
    torch.manual_seed(0)
    seed_rng(torch.device("cpu"), 1234)
    torch.testing.assert_close(torch.rand(5), want, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["per_replica", "fused"])
def test_dropout_masks_differ_per_replica(mode):
    plan = make_plan(TinyDrop, replicas=2, learner_mode=mode, executor="inline")
    state = plan.states[0]
    torch.testing.assert_close(state.w[0], state.w[1], rtol=0, atol=0)  # identical replicas
    x = torch.randn(4, 1, 8, 8)
    y = torch.randint(0, 4, (4,))
    batch = [torch.cat([x, x]), torch.cat([y, y])]  # the same samples for both replicas
    torch.manual_seed(1)
    learn_group(state, 0, 2, batch, torch.nn.functional.cross_entropy, 4, mode,
                plan.rounds.ctx.fused[0])
    assert state.g[0].abs().sum() > 0
    assert not torch.allclose(state.g[0], state.g[1])  # only dropout can tell them apart
    # and without dropout the same program gives identical gradients
    plain = make_plan(TinyNet, replicas=2, learner_mode=mode, executor="inline")
    learn_group(plain.states[0], 0, 2, batch, torch.nn.functional.cross_entropy, 4, mode,
                plain.rounds.ctx.fused[0])
    torch.testing.assert_close(plain.states[0].g[0], plain.states[0].g[1], **TOL)


class _Resize(Hook):
    """Sets m at given rounds; checks z continuity and the new replicas; collects batches."""

    def __init__(self, at: dict[int, int]) -> None:
        self.at, self.seen, self.checked = at, [], 0

    def after_round(self, ctx):
        self.seen.append(ctx.batch_indices.clone())
        plan = ctx.plan
        m = self.at.get(plan.rounds_done)
        if m is None:
            return
        old_m = plan.replicas_per_device
        z = plan.central_weights()
        w_old = plan.states[0].w[:min(m, old_m)].clone()
        plan.set_replicas(m)
        s = plan.states[0]
        torch.testing.assert_close(plan.central_weights(), z, rtol=0, atol=0)  # z continuous
        torch.testing.assert_close(s.w[:min(m, old_m)], w_old, rtol=0, atol=0)
        for r in range(old_m, m):
            torch.testing.assert_close(s.w[r], z, rtol=0, atol=0)  # cloned from z
            assert s.v[r].abs().sum() == 0  # zeroed momentum
        assert plan.rounds.round_env(0, None, True).alpha == pytest.approx(
            default_alpha(plan.num_learners, plan.sync.central_momentum))
        learns = [n for n, t in plan.task_graph.nodes(data="task") if t.kind is TaskKind.LEARN]
        assert len(learns) == m * len(plan.devices)
        self.checked += 1


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_adding_and_removing_replicas_mid_fit_matches_reference(executor):
    ks = [1, 1, 2, 2, 2, 3, 3, 1, 1, 2]
    data = tiny_data(4 * sum(ks) + 3)  # a last partial round is dropped
    plan = make_plan(replicas=1, executor=executor)
    hook = _Resize({2: 2, 5: 3, 7: 1, 9: 2})
    hist = _fit(plan, data, hooks=[hook])
    assert hook.checked == 4 and plan.rounds_done == len(ks)
    torch.manual_seed(0)
    want = flat(reference_sma(TinyNet(), batches_of(data, 4), ks=ks, lr=0.05, momentum=0.9,
                              epoch_samples=len(data))[0])
    torch.testing.assert_close(plan.central_weights(), want, **TOL)
    used = torch.cat(hook.seen)
    assert len(used) == 4 * sum(ks) and len(set(used.tolist())) == len(used)  # disjoint batches
    assert hist.epochs[0].replicas_per_device == 2


def test_set_replicas_beyond_memory_budget_names_the_numbers():
    probe = make_plan(replicas=1)
    mem = probe.task_graph.graph["memory_per_learner_bytes"]
    plan = make_plan(replicas=1, memory_budget=2 * mem)
    assert plan.max_replicas_per_device == 2
    plan.set_replicas(2)
    with pytest.raises(cg.PlanError, match=r"3 replicas × .* budget"):
        plan.set_replicas(3)
    assert plan.replicas_per_device == 2 and plan.states[0].m == 2


class _Guard(torch.nn.Module):
    def forward(self, x):
        if bool((x.abs() > 1e3).any()):
            raise RuntimeError("poisoned sample")
        return x


class _Boom(TinyNet):
    def __init__(self):
        super().__init__()
        self.guard = _Guard()

    def forward(self, x):
        return super().forward(self.guard(x))


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_failing_task_error_names_task_device_round(executor):
    data = tiny_data(64)
    data.tensors[0][4 * 7 + 1] = 1e6  # round 3 (k=2, b=4: 8 per round), learner 1
    plan = make_plan(_Boom, replicas=2, executor=executor, leaf_modules=[_Guard])
    with pytest.raises(cg.TaskError, match=r"task 'learn:d0:r1' \(LEARN on cpu:0\) failed in round 3") as err:
        _fit(plan, data)
    assert (err.value.task_id, err.value.device, err.value.round_index) == ("learn:d0:r1", "cpu:0", 3)
    import multiprocessing

    assert multiprocessing.active_children() == []  # workers cleaned up


def test_trace_inline_and_sync_share(tmp_path):
    import json

    plan = make_plan(replicas=2, executor="inline")
    hist = _fit(plan, tiny_data(64), trace=str(tmp_path / "t.json"))
    events = json.load(open(tmp_path / "t.json"))["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"learn:d0:r0", "learn:d0:r1", "local_sync:d0", "global_sync"} <= names
    assert hist.sync_unhidden_share == 1.0  # sequential: nothing hidden


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["per_replica", "fused"])
def test_cuda_streams_match_hand_written_sma(mode):
    data = tiny_data(40)
    plan = make_plan(replicas=2, learner_mode=mode, devices=["cuda:0"], executor="inline")
    torch.manual_seed(0)
    want = flat(reference_sma(TinyNet(), batches_of(data, 4), ks=[2] * 5, lr=0.05, momentum=0.9)[0])
    _fit(plan, data)
    torch.testing.assert_close(plan.central_weights().cpu(), want, rtol=1e-4, atol=1e-5)


def test_gpu_tests_run_without_tf32_and_restore_it():
    """fp32_exact (every gpu-marked test runs in it, tests/conftest.py): TF32 off inside, the
    flags as they were after, also after an exception."""
    from _plans import fp32_exact

    torch.backends.cudnn.allow_tf32 = True
    with pytest.raises(RuntimeError):
        with fp32_exact():
            assert not torch.backends.cudnn.allow_tf32
            assert not torch.backends.cuda.matmul.allow_tf32
            raise RuntimeError
    assert torch.backends.cudnn.allow_tf32


@pytest.mark.gpu
def test_gpu_tests_see_no_tf32():
    """The conftest fixture is in force in a gpu-marked test (the TF32 convolutions of
    test_cuda_streams_match_hand_written_sma would miss rtol 1e-4)."""
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
