"""Mixed precision, ``compile(..., precision=)``: eager ``torch.autocast`` (with
``torch.optim.SGD`` and ``torch.amp.GradScaler``) is the oracle; the float16 loss scales; the
bfloat16-model fused learners; bad input."""

from __future__ import annotations

import copy
import functools
import multiprocessing

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import crossbow_graph as cg
from crossbow_graph.engine.state.precision import LossScales
from crossbow_graph.errors import DivergenceError

from _plans import TinyBN, TinyNet, make_plan
from _reference import flat

MODES = ("per_replica", "fused")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
OPT = dict(lr=0.05, momentum=0.9, weight_decay=1e-4)


def _batches(n: int, b: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 1, 8, 8, generator=g), torch.randint(0, 4, (b,), generator=g))
            for _ in range(n)]


def _learnable(n: int = 256, seed: int = 0) -> TensorDataset:
    """x [n, 1, 8, 8] standard normal, y = argmax of a fixed linear map of x (4 classes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    return TensorDataset(x, (x.flatten(1) @ torch.randn(64, 4, generator=g)).argmax(1))


# the plans of these tests: the model as given at b = 8, 1 replica, inline, SGD(**OPT)
_plan = functools.partial(make_plan, seed=None, batch_size=8, replicas=1, executor="inline",
                          optimizer=cg.SGD(**OPT))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("mode", MODES)
def test_one_learner_equals_eager_autocast_and_sgd(mode, precision, device):
    """One learner (k = 1) is torch.optim.SGD; under autocast it is eager autocast's forward,
    backward and SGD step (with GradScaler for float16), two steps. per_replica runs the same
    ops (float32 accumulation order only); fused runs batched kernels whose bfloat16/float16
    roundings differ, so its update is compared at the low precision's resolution (1e-2)."""
    torch.manual_seed(0)
    model = TinyBN()
    eager = copy.deepcopy(model).to(device)
    sgd = torch.optim.SGD(eager.parameters(), **OPT)
    scaler = torch.amp.GradScaler(device, enabled=precision == "fp16")
    plan = _plan(model, learner_mode=mode, precision=precision,
                 devices=1 if device == "cpu" else ["cuda:0"])
    w0 = flat(eager.parameters())
    for x, y in _batches(2):
        plan.fit(TensorDataset(x, y), 1, shuffle=False, progress=False)
        sgd.zero_grad()
        x, y = x.to(device), y.to(device)
        with torch.autocast(device, dtype=DTYPES[precision]):
            loss = F.cross_entropy(eager(x), y)
        scaler.scale(loss).backward()
        scaler.step(sgd)
        scaler.update()
    assert precision == "bf16" or scaler.get_scale() == LossScales.INIT  # eager made both steps
    step_plan, step_eager = plan.central_weights() - w0, flat(eager.parameters()) - w0
    if mode == "per_replica":
        torch.testing.assert_close(step_plan, step_eager, rtol=1e-5, atol=1e-7)
        bn = plan.central_model().bn
        torch.testing.assert_close(bn.running_mean.to(device), eager.bn.running_mean,
                                   rtol=1e-5, atol=1e-7)
    else:
        assert (step_plan - step_eager).norm() / step_eager.norm() < 1e-2
    assert plan.states[0].g.dtype == torch.float32  # float32 parameters and gradients


class _Recorder:
    """Output dtypes of a module's conv, bn and fc layers, and of the loss."""

    def __init__(self) -> None:
        self.seen: dict[str, torch.dtype] = {}

    def watch(self, module: nn.Module) -> None:
        for name in ("conv", "bn", "fc"):
            getattr(module, name).register_forward_hook(
                lambda mod, args, out, name=name: self.seen.__setitem__(name, out.dtype))

    def loss(self, out, target):
        loss = F.cross_entropy(out, target)
        self.seen["loss"] = loss.dtype
        return loss


@pytest.mark.parametrize("mode", MODES)
def test_both_learner_modes_cast_as_eager_autocast_does(mode):
    """The dtypes of eager autocast, layer by layer: bfloat16 convolution, batch norm and linear
    outputs, a float32 loss. Under torch.func.vmap (fused) autocast alone leaves the batched
    convolution and the linear layer's bias in float32 and fails on batch norm; the fused
    learners complete its casts."""
    torch.manual_seed(0)
    model, rec, want = TinyBN(), _Recorder(), _Recorder()
    want.watch(model)
    x, y = _batches(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want.loss(model(x), y)
    plan = _plan(model, learner_mode=mode, precision="bf16", loss_fn=rec.loss)
    rec.watch(plan.rounds.ctx.fused[0].module if mode == "fused" else plan.states[0].replicas[0])
    plan.fit(TensorDataset(x, y), 1, shuffle=False, progress=False)
    assert want.seen == {"conv": torch.bfloat16, "bn": torch.bfloat16, "fc": torch.bfloat16,
                         "loss": torch.float32}
    assert rec.seen == want.seen


@pytest.mark.parametrize("mode", MODES)
def test_bf16_learners_train_like_fp32(mode):
    """k = 2 learners under bfloat16 autocast: the loss falls over 3 epochs, as in float32, and
    ends within 0.05 of the float32 run's."""
    data = _learnable(128)
    losses = {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        plan = _plan(TinyNet(), replicas=2, learner_mode=mode, precision=precision,
                     optimizer=cg.SGD(lr=0.05, momentum=0.9))
        hist = plan.fit(data, 3, progress=False)
        losses[precision] = [e.train_loss for e in hist.epochs]
    assert losses["bf16"][-1] < 0.85 * losses["bf16"][0]
    assert abs(losses["bf16"][-1] - losses["fp32"][-1]) < 0.05


def _huge_loss(out, target):
    """Cross-entropy × 10⁴: at the initial scale 2¹⁶ the float16 backward overflows."""
    return 1e4 * F.cross_entropy(out, target)


@pytest.mark.parametrize("mode", MODES)
def test_fp16_overflow_is_computed_again_at_a_lower_scale_not_a_fault(mode):
    """An overflow of the loss scale halves that replica's scale and computes its step again,
    from the BatchNorm statistics it had: no fault is recorded, every scale ends below 2¹⁶ (and
    ≥ 1), and the steps and statistics equal a float32 plan's at float16's resolution."""
    data = _learnable(64)
    out = {}
    for precision in ("fp32", "fp16"):
        torch.manual_seed(0)
        plan = _plan(TinyBN(), replicas=2, learner_mode=mode, precision=precision,
                     loss_fn=_huge_loss, optimizer=cg.SGD(lr=1e-6, momentum=0.9))
        w0 = plan.central_weights()
        hist = plan.fit(data, 1, shuffle=False, progress=False)
        assert hist.faults == []
        out[precision] = plan.central_weights() - w0, plan.central_model().bn, plan.states[0].loss_scales
    scales = out["fp16"][2].scale
    assert bool((scales < LossScales.INIT).all()) and bool((scales >= 1).all())
    assert out["fp32"][2] is None
    (step16, bn16, _), (step32, bn32, _) = out["fp16"], out["fp32"]
    assert (step16 - step32).norm() / step32.norm() < 1e-2
    torch.testing.assert_close(bn16.running_var, bn32.running_var, rtol=1e-2, atol=1e-3)
    assert bn16.num_batches_tracked.item() == bn32.num_batches_tracked.item() == 4  # rounds


def test_fp16_scale_grows_after_the_interval_of_finite_steps(monkeypatch):
    """GradScaler's growth: S doubles after GROWTH_INTERVAL finite steps in a row (here 2)."""
    monkeypatch.setattr(LossScales, "GROWTH_INTERVAL", 2)
    torch.manual_seed(0)  # a small loss: no overflow at 2¹⁸
    plan = _plan(TinyNet(), precision="fp16", loss_fn=lambda out, y: 1e-3 * F.cross_entropy(out, y))
    plan.fit(_learnable(40), 1, shuffle=False, progress=False)  # 5 rounds
    assert plan.states[0].loss_scales.scale.tolist() == [LossScales.INIT * 4]
    assert plan.states[0].loss_scales.good.tolist() == [1]


def _nan_gradient(out, target):
    """A finite loss whose gradient is NaN at every scale: d/du √u at u = 0 is ∞, times 0."""
    return F.cross_entropy(out, target) + (out.float() - out.float().detach()).pow(2).sum().sqrt()


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_non_finite_gradient_at_scale_one_is_a_fault(precision):
    """A NaN gradient that no scale removes is the model's own: after the halvings down to
    S = 1 the replica is a fault, as it is without scaling (one learner: DivergenceError)."""
    calls = []

    def loss(out, target):
        calls.append(1)
        return _nan_gradient(out, target)

    torch.manual_seed(0)
    plan = _plan(TinyNet(), precision=precision, loss_fn=loss)
    with pytest.raises(DivergenceError, match="NaN/Inf gradients"):
        plan.fit(_learnable(8), 1, shuffle=False, progress=False)
    if precision == "fp16":
        assert plan.states[0].loss_scales.scale.tolist() == [LossScales.FLOOR]
        assert len(calls) == 17  # 2¹⁶, 2¹⁵, …, 2⁰
    else:
        assert len(calls) == 1


def test_fp16_scales_are_shared_with_worker_processes_and_checkpointed():
    """The process executor's workers write their replicas' scales (shared memory): the same
    scales and z as the inline executor; ``state_dict`` carries them to a new plan."""
    data = TensorDataset(torch.randn(48, 64), torch.randint(0, 4, (48,)))
    out = {}
    for ex in ("inline", "process"):
        torch.manual_seed(0)
        # linear layers only: the workers may choose another convolution library (conv_choice)
        model = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 4))
        plan = cg.compile(model, (torch.randn(2, 64),), _huge_loss, batch_size=4, replicas=2,
                          optimizer=cg.SGD(lr=1e-6, momentum=0.9), executor=ex, precision="fp16")
        plan.fit(data, 1, shuffle=False, progress=False)
        out[ex] = plan
    a, b = out["inline"], out["process"]
    assert a.states[0].loss_scales.scale.tolist() == b.states[0].loss_scales.scale.tolist()
    assert max(a.states[0].loss_scales.scale.tolist()) < LossScales.INIT
    torch.testing.assert_close(a.central_weights(), b.central_weights(), rtol=1e-5, atol=1e-7)
    assert multiprocessing.active_children() == []
    torch.manual_seed(0)
    fresh = cg.compile(nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 4)),
                       (torch.randn(2, 64),), _huge_loss, batch_size=4, replicas=2,
                       optimizer=cg.SGD(lr=1e-6, momentum=0.9), precision="fp16")
    fresh.load_state_dict(a.state_dict())
    assert fresh.states[0].loss_scales.scale.tolist() == a.states[0].loss_scales.scale.tolist()


def test_bf16_model_trains_in_fused_mode_as_per_replica():
    """A model cast to bfloat16 in fused mode: its parameters are the bfloat16 copy of the
    float32 masters, as in per_replica mode (the fused program used to take the masters
    themselves and fail with 'Input type (BFloat16) and bias type (float)')."""
    data = _learnable(64)
    data = TensorDataset(data.tensors[0].bfloat16(), data.tensors[1])
    steps = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = TinyBN().to(torch.bfloat16)
        plan = cg.compile(model, (torch.randn(2, 1, 8, 8, dtype=torch.bfloat16),), F.cross_entropy,
                          batch_size=8, replicas=2, learner_mode=mode, executor="inline",
                          optimizer=cg.SGD(lr=0.05, momentum=0.9))
        w0 = plan.central_weights()
        plan.fit(data, 1, shuffle=False, progress=False)
        steps[mode] = plan.central_weights() - w0
    a, b = steps["per_replica"], steps["fused"]
    assert (a - b).norm() / a.norm() < 2e-2  # bfloat16 kernels of two kinds


def test_bad_precision_is_a_clear_error_before_training():
    with pytest.raises(ValueError, match=r"precision='bf17': use one of 'fp32', 'bf16', 'fp16'"):
        _plan(TinyNet(), precision="bf17")
    with pytest.raises(ValueError, match=r"precision='fp16' .* parameters are float64.*"
                                         r"model\.float\(\)"):
        _plan(TinyNet().double(), precision="fp16")
    with pytest.raises(ValueError, match=r"precision='bf16' .* parameters are bfloat16"):
        _plan(TinyNet().bfloat16(), precision="bf16")
