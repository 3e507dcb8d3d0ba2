"""Tracing robustness: errors that point at the user's line with the fix;
several inputs, keyword inputs, tuple/dict outputs, residual connections, ModuleList/ModuleDict."""

from __future__ import annotations

import inspect
import re
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset
from torch.utils.flop_counter import FlopCounterMode

import crossbow_graph as cg
from crossbow_graph.compiler.trace import trace_model


class _Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # control flow on a tensor's value
            return x
        return -x


class _Repeat(nn.Module):
    def forward(self, x):
        for _ in range(x.shape[1]):  # a Python builtin on a traced shape
            x = x + 1
        return x


class _Len(nn.Module):
    def forward(self, x):
        return x * len(x)  # len() of a traced tensor


class _Outer(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.inner = inner

    def forward(self, x):
        return self.inner(self.lin(x))


def _line_of(cls: type, text: str) -> int:
    lines, start = inspect.getsourcelines(cls)
    return start + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize("inner, code, fix", [
    (_Gate, "if x.sum() > 0:", "torch.where"),
    (_Repeat, "for _ in range(x.shape[1]):", "x.size(0)"),
    (_Len, "return x * len(x)", "torch.fx.wrap"),
])
def test_untraceable_python_raises_trace_error_naming_module_line_and_fix(inner, code, fix):
    with pytest.raises(cg.TraceError) as info:
        cg.compile(_Outer(inner()), (torch.randn(2, 4),), F.mse_loss, batch_size=2,
                   strict_trace=True)
    msg = str(info.value)
    assert f"in module 'inner' ({inner.__name__})" in msg
    assert f"{__file__}:{_line_of(inner, code)}" in msg
    assert code in msg
    assert fix in msg and f"leaf_modules=[{inner.__name__}]" in msg


def test_the_suggested_leaf_module_fix_works():
    mg = trace_model(_Outer(_Gate()), (torch.randn(2, 4),), leaf_modules=[_Gate])
    assert any(n.op == "call_module" and n.target == "inner" for n in mg.module.graph.nodes)


def test_example_inputs_of_the_wrong_type_raise_type_error():
    with pytest.raises(TypeError, match=r"a tuple of the model's positional inputs, e\.g\. \(x,\)"):
        trace_model(nn.Linear(4, 2), torch.randn(2, 4))


class _TwoInputs(nn.Module):
    """Two inputs, an optional one left at its default, a residual join and a dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(2, 3)

    def forward(self, x, extra, scale=None):
        h = self.a(x) + self.b(extra)
        if scale is not None:
            h = h * scale
        return {"logits": h, "aux": (h.mean(1), h.amax(1))}


class _Samples(Dataset):
    def __init__(self, keyword: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.keyword = keyword
        self.x, self.e = torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g)
        self.y = torch.randint(0, 3, (32,), generator=g)

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i):
        inputs = {"x": self.x[i], "extra": self.e[i]} if self.keyword else (self.x[i], self.e[i])
        return inputs, self.y[i]


def _assert_matches_eager_sgd(plan, ref: nn.Module, loss_of, *, n: int, b: int) -> None:
    """The oracle for a one-learner plan fitted with SGD(lr 0.1, momentum 0.9), shuffle=False:
    eager torch.optim.SGD on ``ref`` (a copy of the initial model) over the batches ``[t·b,
    (t+1)·b)`` of the first ``n`` samples, ``loss_of(ref, batch slice)`` its loss; z's weights
    equal ``ref``'s within 1e-5 relative."""
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for start in range(0, n, b):
        opt.zero_grad()
        loss_of(ref, slice(start, start + b)).backward()
        opt.step()
    got = plan.central_model().state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)


def _dict_loss(out, y):
    return F.cross_entropy(out["logits"], y) + 0.01 * out["aux"][0].pow(2).mean()


@pytest.mark.parametrize("keyword", [False, True])
def test_several_or_keyword_inputs_and_dict_outputs_compile_and_fit_like_eager_sgd(keyword):
    """k = 1 is exactly torch.optim.SGD (docs/design-overview.md §2): the oracle is an eager loop."""
    torch.manual_seed(0)
    model = _TwoInputs()
    data = _Samples(keyword)
    example = {"x": data.x[:2], "extra": data.e[:2]} if keyword else (data.x[:2], data.e[:2])
    plan = cg.compile(model, example, _dict_loss, batch_size=8, devices=["cpu:0"], replicas=1,
                      optimizer=cg.SGD(lr=0.1, momentum=0.9))
    out_node = [n for n in plan.model_graph.module.graph.nodes if n.op == "output"][0]
    assert set(out_node.args[0]) == {"logits", "aux"}
    plan.fit(data, 1, shuffle=False, progress=False)

    ref = _TwoInputs()
    ref.load_state_dict(plan.template.state_dict())  # the model as compiled (the fit leaves z in it)
    _assert_matches_eager_sgd(plan, ref, lambda m, s: _dict_loss(m(data.x[s], data.e[s]), data.y[s]),
                              n=32, b=8)


def test_arguments_left_at_their_default_are_traced_with_it():
    mg = trace_model(_TwoInputs(), (torch.randn(2, 4), torch.randn(2, 2)))
    assert not any(getattr(n.target, "__name__", "") == "mul" for n in mg.module.graph.nodes)
    scaled = trace_model(_TwoInputs(), (torch.randn(2, 4), torch.randn(2, 2), torch.tensor(2.0)))
    assert any(getattr(n.target, "__name__", "") == "mul" for n in scaled.module.graph.nodes)


def test_tuple_outputs_compile_with_a_loss_that_takes_them():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 6)

        def forward(self, x):
            return self.lin(x).chunk(2, dim=1)

    plan = cg.compile(Pair(), (torch.randn(2, 4),),
                      lambda out, y: F.mse_loss(out[0], y) + F.mse_loss(out[1], y), batch_size=4,
                      devices=["cpu:0"])
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 3))
    history = plan.fit(data, 1, progress=False)
    assert len(history.epochs) == 1


class _ResidualStack(nn.Module):
    """Residual blocks in an nn.ModuleList and heads in an nn.ModuleDict."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))
        self.heads = nn.ModuleDict({"cls": nn.Linear(8, 3), "reg": nn.Linear(8, 1)})

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.heads["cls"](x) + self.heads["reg"](x)


def test_residual_connections_and_module_containers_trace_like_eager():
    torch.manual_seed(0)
    model = _ResidualStack()
    x = torch.randn(5, 8)
    mg = trace_model(model, (x,))
    torch.testing.assert_close(mg.module(x), model(x), rtol=0, atol=0)
    assert mg.analysis.residual_joins == 4  # three skip connections and the sum of the heads
    assert {p.name for p in mg.parameters} == set(dict(model.named_parameters()))
    plan = cg.compile(model, (x,), F.cross_entropy, batch_size=4, devices=["cpu:0", "cpu:1"], replicas=2)
    assert plan.num_learners == 4
    plan.fit(torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,))), 1,
             progress=False)


def test_inventory_counts_tied_parameters_once_and_marks_frozen_ones():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(4, 4, bias=False)
            self.out = nn.Linear(4, 4, bias=False)
            self.out.weight = self.emb.weight
            self.frozen = nn.Linear(4, 4)
            self.frozen.requires_grad_(False)
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(self.out(self.emb(x)) + self.frozen(x))

    mg = trace_model(Tied(), (torch.randn(3, 4),))
    by_name = {p.name: p for p in mg.parameters}
    assert by_name["emb.weight"].aliases == ("out.weight",)
    assert "out.weight" not in by_name
    assert not by_name["frozen.weight"].trainable and not by_name["frozen.bias"].trainable
    assert mg.num_trainable == 16 + 8  # tied weight once, batch norm's weight and bias
    assert mg.num_parameters == 16 + 20 + 8
    assert [b.name for b in mg.buffers] == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    assert mg.analysis.frozen_bytes == 20 * 4


def test_keyword_example_inputs_that_do_not_run_name_the_module_and_shapes():
    with pytest.raises(cg.TraceError, match=r"example inputs \(shapes \[\[2, 5\], \[2, 2\]\]\) do not "
                                            r"run through _TwoInputs in module 'a' \(Linear\): "
                                            r"RuntimeError: mat1 and mat2"):
        trace_model(_TwoInputs(), {"x": torch.randn(2, 5), "extra": torch.randn(2, 2)})
    with pytest.raises(cg.TraceError, match=r"do not match the model's forward\(x, extra"):
        trace_model(_TwoInputs(), {"x": torch.randn(2, 4), "other": torch.randn(2, 2)})


class _EMA(nn.Module):
    """Updates a registered float buffer in forward, in every mode."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("ema", torch.zeros(()))

    def forward(self, x):
        self.ema.mul_(0.9).add_(x.mean())
        return self.lin(x)


class _Counter(nn.Module):
    """Counts its calls in an integer buffer and adds noise drawn from torch's global RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return self.lin(x + 0.01 * torch.randn_like(x))


def _frozen_batch_norm() -> nn.Module:
    """BatchNorm in training mode next to one the user put in evaluation mode (frozen stats)."""
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6),
                          nn.BatchNorm1d(6), nn.Linear(6, 3))
    model[1].running_mean.add_(0.5)
    model[4].eval()
    return model


class _UntraceableCounter(_Counter):
    """_Counter with control flow on a tensor's value: analysed by an eager forward."""

    def forward(self, x):
        self.calls += 1
        if x.sum() > 0:
            x = x + 0.01 * torch.randn_like(x)
        return self.lin(x)


@pytest.mark.filterwarnings("ignore::crossbow_graph.errors.TraceWarning")
@pytest.mark.parametrize("make", [_frozen_batch_norm, _EMA, _Counter, _UntraceableCounter],
                         ids=["batch_norm", "ema_buffer", "counter_and_noise", "eager_analysis"])
def test_compile_leaves_the_model_and_the_global_rng_bitwise_unchanged(make):
    """Tracing and shape propagation run the forward once: on a copy, under a forked RNG. The
    model's state_dict, modes, requires_grad and attributes are as before, and the plan's
    replicas start from that state."""
    torch.manual_seed(0)
    model, example = make(), (torch.randn(5, 4),)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [(name, m.training) for name, m in model.named_modules()]
    grads = [(name, p.requires_grad) for name, p in model.named_parameters()]
    attrs = {name: sorted(vars(m)) for name, m in model.named_modules()}
    rng = torch.get_rng_state()
    plan = cg.compile(model, example, F.cross_entropy, batch_size=4, devices=["cpu:0"], replicas=2)
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    assert [(name, m.training) for name, m in model.named_modules()] == modes
    assert [(name, p.requires_grad) for name, p in model.named_parameters()] == grads
    assert {name: sorted(vars(m)) for name, m in model.named_modules()} == attrs
    assert torch.equal(torch.get_rng_state(), rng), "compile drew from torch's global RNG"
    central = plan.central_model().state_dict()
    assert all(torch.equal(central[key], value) for key, value in before.items())


# -- the trace fallback: a model torch.fx cannot trace trains, analysed eagerly ------------------


class _Branchy(nn.Module):
    """Control flow on a tensor's value at the root: torch.fx cannot trace it; eager runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if h.sum() > 0:
            h = h * 2
        return self.b(h)


def _flop_counter(module: nn.Module, *args) -> int:
    with FlopCounterMode(display=False) as counter:
        module(*args)
    return counter.get_total_flops()


def test_an_untraceable_model_warns_trains_and_gets_flopcountermodes_flops():
    torch.manual_seed(0)
    model, x = _Branchy(), torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:  # one line, once per model class
        warnings.simplefilter("always")
        plan = cg.compile(model, (x,), F.cross_entropy, batch_size=4, devices=["cpu:0"], replicas=1,
                          optimizer=cg.SGD(lr=0.1, momentum=0.9))
        cg.compile(_Branchy(), (x,), F.cross_entropy, batch_size=4, devices=["cpu:0"], replicas=1)
    traces = [str(w.message) for w in caught if issubclass(w.category, cg.TraceWarning)]
    assert len(traces) == 1 and "\n" not in traces[0], traces
    assert re.fullmatch(r"_Branchy has no fx graph \(torch\.fx: TraceError: symbolically traced "
                        r"variables cannot be used as inputs to control flow\); it trains as given, "
                        r"with an approximate analysis: plan\.summary\(\) says what inspection "
                        r"lost and why; strict_trace=True raises the TraceError instead", traces[0])
    assert re.search(r"\ntrace: torch\.fx cannot trace _Branchy: .*`if h\.sum\(\) > 0:`.*\. "
                     r"Inspection is approximate: FLOPs count matrix products", plan.summary())
    graph = plan.model_graph
    assert graph.tracer == "eager" and graph.module is None
    assert graph.analysis.forward_flops_per_sample * 4 == _flop_counter(model, x)  # the oracle
    # saved for backward, per sample: the input x [8], relu's output [16], the second linear's
    # input h * 2 [16], float32; the weights are parameters, not activations
    assert graph.analysis.saved_bytes_per_sample == (8 + 16 + 16) * 4
    assert [n.name for n in graph.analysis.nodes] == ["a", "b", "rest"]
    assert [i.shape for i in graph.inputs] == [(4, 8)] and graph.output_shape == (4, 3)
    # it trains as the eager module does (k = 1 is torch.optim.SGD)
    data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randint(0, 3, (16,)))
    plan.fit(data, 1, shuffle=False, progress=False)
    ref = _Branchy()
    ref.load_state_dict(plan.template.state_dict())  # the model as compiled (the fit leaves z in it)
    x, y = data.tensors
    _assert_matches_eager_sgd(plan, ref, lambda m, s: F.cross_entropy(m(x[s]), y[s]), n=16, b=4)


def test_strict_trace_keeps_the_trace_error():
    with pytest.raises(cg.TraceError, match=r"torch\.fx cannot trace _Branchy: in module '<root>'"):
        cg.compile(_Branchy(), (torch.randn(4, 8),), F.cross_entropy, batch_size=4, strict_trace=True)


def test_the_root_as_a_leaf_module_is_measured_eagerly_without_a_warning():
    model, x = _Branchy(), torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph = trace_model(model, (x,), leaf_modules=[_Branchy], strict=True)
    assert graph.tracer == "eager" and graph.analysis.forward_flops_per_sample * 4 == _flop_counter(model, x)


class _GatedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 32)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return self.lin(-x)


class _WithLeaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _GatedLinear()
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(torch.relu(self.inner(x)))


def test_leaf_modules_get_their_measured_flops_and_memory():
    torch.manual_seed(0)
    model, x = _WithLeaf(), torch.randn(2, 4).abs()
    graph = trace_model(model, (x,), leaf_modules=[_GatedLinear])
    assert graph.tracer == "torch.fx"
    inner = next(n for n in graph.analysis.nodes if n.name == "inner")
    assert inner.op == "measured"
    assert inner.flops == _flop_counter(model.inner, x)  # 2·2·4·32, the oracle's count
    assert inner.saved_bytes == 2 * 4 * 4  # the leaf's linear keeps its input [2, 4]
    head_flops = 2 * 2 * 32 * 3 + 2 * 3  # the fx analysis's linear with its bias
    relu_flops = 2 * 32
    assert graph.analysis.forward_flops_per_sample * 2 == inner.flops + relu_flops + head_flops
