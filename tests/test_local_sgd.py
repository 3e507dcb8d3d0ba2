"""sync=LocalSGD(sync_every=H): periodic model averaging (engine/sync/local_sgd.py), checked
against a hand-written loop of k eager replicas that average every H rounds (PyTorch's
``PeriodicModelAverager`` semantics), against DiLoCo with an outer SGD of lr 1, and through a
checkpoint resume."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import crossbow_graph as cg
from _plans import TinyBN, TinyNet, make_plan, tiny_data
from _reference import flat

RTOL, ATOL = 1e-5, 1e-6  # float32: the same operations, the mean summed in another order


def periodic_averaging(model: nn.Module, data: TensorDataset, *, k: int, b: int, rounds: int,
                       H: int, inner) -> tuple[torch.Tensor, torch.Tensor]:
    """Local SGD by hand: k copies of ``model``, each with its own ``inner(params)`` optimizer,
    learner j taking batch t·k + j in round t (shuffle=False); after every H-th round's steps
    every copy's parameters become their mean over the k copies (optimizer state kept). Returns
    (the mean at the last averaging ``[P]``, the replicas ``[k, P]``)."""
    batches = list(zip(*(t.split(b) for t in data.tensors)))  # batch t·k + j: learner j's in round t
    copies = [copy.deepcopy(model) for _ in range(k)]
    inners = [inner(c.parameters()) for c in copies]
    z = flat(model)
    for t in range(rounds):
        for c, opt, (xb, yb) in zip(copies, inners, batches[t * k:(t + 1) * k]):
            opt.zero_grad()
            F.cross_entropy(c(xb), yb).backward()
            opt.step()
        if (t + 1) % H == 0:
            with torch.no_grad():
                for ps in zip(*(c.parameters() for c in copies)):
                    mean = torch.stack(ps).mean(0)
                    for p in ps:
                        p.copy_(mean)
            z = flat(copies[0])
    return z, torch.stack([flat(c) for c in copies])


SGD_KERNELS = ("SGD kernels", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
               cg.SGD(lr=0.05, momentum=0.9))
ADAMW_ROWS = ("AdamW rows", lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01),
              lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01))


@pytest.mark.parametrize("learner_mode", ["per_replica", "fused"])
@pytest.mark.parametrize("optimizer", [SGD_KERNELS, ADAMW_ROWS], ids=lambda o: o[0])
@pytest.mark.parametrize("devices,replicas", [(1, 4), (2, 2)])
def test_local_sgd_equals_hand_written_periodic_averaging(learner_mode, optimizer, devices,
                                                          replicas):
    """k = 4, H = 3, 10 rounds (the last round mid-window): z is the replicas' mean at the last
    averaging and every replica the eager copy's, within float32 rounding."""
    _, inner, local = optimizer
    k, b, rounds, H = 4, 4, 10, 3
    data = tiny_data(k * b * rounds)
    plan = make_plan(TinyNet, batch_size=b, devices=devices, replicas=replicas,
                     learner_mode=learner_mode, optimizer=local, sync=cg.LocalSGD(sync_every=H))
    assert plan.rounds.resolved_executor() == "inline"  # auto picks it
    torch.manual_seed(0)  # make_plan's model, built again
    z, ws = periodic_averaging(TinyNet(), data, k=k, b=b, rounds=rounds, H=H, inner=inner)
    plan.fit(data, 1, shuffle=False, progress=False, metrics_every=None)
    assert plan.rounds_done == rounds
    torch.testing.assert_close(plan.central_weights(), z, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(plan.replica_weights(), ws, rtol=RTOL, atol=ATOL)
    assert not torch.allclose(ws[0], ws[1], atol=1e-4)  # a round after the averaging: apart


def test_local_sgd_equals_diloco_with_an_outer_sgd_of_lr_1():
    """DiLoCo(H, outer SGD lr 1, no momentum) steps z by −Δ = mean w − z: the same z and
    replicas up to rounding; float buffers averaged into zbuf as DiLoCo's."""
    k, b, rounds, H = 4, 4, 12, 4
    data = tiny_data(k * b * rounds)
    plans = [make_plan(TinyBN, batch_size=b, devices=2, replicas=2, sync=sync) for sync in
             (cg.LocalSGD(sync_every=H),
              cg.DiLoCo(sync_every=H, outer_optimizer=functools.partial(torch.optim.SGD, lr=1.0)))]
    for plan in plans:
        plan.fit(data, 1, shuffle=False, progress=False, metrics_every=None)
    local, diloco = plans
    torch.testing.assert_close(local.central_weights(), diloco.central_weights(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(local.replica_weights(), diloco.replica_weights(), rtol=RTOL, atol=ATOL)
    for a, c in zip(local.states, diloco.states):
        torch.testing.assert_close(a.zbuf, c.zbuf, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(a.z_prev, c.z_prev, rtol=RTOL, atol=ATOL)
    assert torch.equal(local.replica_weights(), local.central_weights().expand(k, -1))  # at z


class _StopAfter(cg.Hook):
    def __init__(self, n: int) -> None:
        self.n = n

    def after_round(self, ctx) -> None:
        ctx.stop = ctx.plan.rounds_done >= self.n


def test_a_resume_mid_window_gives_the_uninterrupted_run_bit_for_bit(tmp_path):
    """Local SGD keeps no state beside the replicas, z and the row optimizers: a checkpoint's
    ``outer_optimizer`` is None, and a run stopped after 4 rounds (H = 3) and resumed equals
    the uninterrupted one."""
    data, ckpt = tiny_data(4 * 4 * 10), str(tmp_path / "ckpt")
    opt = lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)  # noqa: E731
    runs = [make_plan(TinyBN, devices=2, replicas=2, optimizer=opt,
                      sync=cg.LocalSGD(sync_every=3)) for _ in range(3)]
    runs[0].fit(data, 1, progress=False, seed=3, metrics_every=None)
    runs[1].fit(data, 1, progress=False, seed=3, metrics_every=None, checkpoint_dir=ckpt,
                checkpoint_every=1, hooks=[_StopAfter(4)])
    assert runs[1].state_dict()["outer_optimizer"] is None
    runs[2].fit(data, 1, progress=False, seed=3, metrics_every=None, checkpoint_dir=ckpt,
                checkpoint_every=1, resume=True)
    assert runs[2].rounds_done == runs[0].rounds_done == 10
    for a, c in zip(runs[0].states, runs[2].states):
        for key in ("z", "z_prev", "w", "buf", "zbuf"):
            assert torch.equal(getattr(a, key), getattr(c, key)), key


def test_local_sgd_settings_errors_and_summary():
    """H ≥ 1; the inline executor only; no α; H changes through adjust; the summary's rule; a
    fit shorter than H warns that z stays where it started."""
    with pytest.raises(ValueError, match=r"LocalSGD\(sync_every=0\): H, .* integer ≥ 1"):
        cg.LocalSGD(sync_every=0)
    with pytest.raises(ValueError, match=r"LocalSGD\(...\) runs on the inline executor only.*"
                                         r"executor='inline'"):
        make_plan(devices=2, replicas=1, sync=cg.LocalSGD(sync_every=2), executor="process")
    plan = make_plan(devices=2, replicas=1, sync=cg.LocalSGD(sync_every=16))
    with pytest.raises(ValueError, match="local SGD pulls no replica toward z"):
        plan.adjust(cg.Adjustment(alpha=0.5))
    assert "sync: LocalSGD(z ← mean w, every 16 round(s))" in plan.summary()
    with pytest.warns(UserWarning, match=r"runs 8 rounds, fewer than H.*sync_every ≤ 8"):
        plan.fit(tiny_data(64), 1, progress=False, metrics_every=None)
    plan.adjust(cg.Adjustment(sync_every=4))
    assert plan.sync == cg.LocalSGD(sync_every=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        plan.fit(tiny_data(64), 1, progress=False, metrics_every=None)
    assert torch.equal(plan.replica_weights(), plan.central_weights().expand(2, -1))  # round 16
