"""Model analysis: per-node shapes, dtypes, FLOPs and bytes, checked against
eager PyTorch (forward hooks, torch.utils.flop_counter, autograd's saved-tensor hooks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from crossbow_graph import models
from crossbow_graph.compiler.trace import trace_model

_MATMUL_OPS = ("conv", "linear", "matmul")


def _torch_flops(model: nn.Module, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        model(x)
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ["lenet5", "resnet32"])
def test_conv_and_linear_flops_equal_torch_flop_counter(name):
    """torch's counter counts no bias additions: ours less one per output element with a bias."""
    model = models.get_model(name).eval()
    x = torch.randn(2, *models.input_shape(name))
    mg = trace_model(model, (x,))
    mods = dict(mg.module.named_modules())
    ours = 0
    for cost, node in zip(mg.analysis.nodes, mg.module.graph.nodes):
        if cost.op in _MATMUL_OPS:
            bias = node.op == "call_module" and mods[node.target].bias is not None
            ours += cost.flops - (cost.bytes // 4 if bias else 0)
    assert ours == _torch_flops(model, x)


def test_matmul_flops_equal_torch_flop_counter():
    class Attn(nn.Module):
        def forward(self, q, k):
            return torch.softmax(q @ k.transpose(1, 2), dim=-1) @ k

    q, k = torch.randn(2, 5, 8), torch.randn(2, 7, 8)
    analysis = trace_model(Attn(), (q, k)).analysis
    with FlopCounterMode(display=False) as counter:
        Attn()(q, k)
    assert sum(n.flops for n in analysis.nodes if n.op == "matmul") == counter.get_total_flops()


def test_lenet5_forward_flops_by_hand():
    """conv1 2·4704·25+4704, relu 4704, pool 1176·4, conv2 2·1600·150+1600, relu 1600, pool 400·4,
    fc 2·120·400+120, relu 120, 2·84·120+84, relu 84, 2·10·84+10 = 852,370 FLOPs per sample."""
    analysis = trace_model(models.lenet5(), (torch.randn(3, 1, 28, 28),)).analysis
    assert analysis.forward_flops_per_sample == 852_370
    assert analysis.forward_flops(16) == 16 * 852_370
    assert analysis.train_flops_per_sample == 3 * 852_370
    assert analysis.train_step_flops(16) == 3 * 852_370 * 16 + 4 * 61_706


def test_norm_pool_and_elementwise_flops_and_view_bytes_by_hand():
    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm2d(3)
            self.pool = nn.MaxPool2d(2)

        def forward(self, x):
            h = F.relu(self.bn(x))                      # 4·96, 96
            p = self.pool(h) + F.avg_pool2d(h, 2)       # 24·4, 24·4, add 24
            return F.adaptive_avg_pool2d(h, 1).flatten(1) + p.flatten(1)[:, :3]

    analysis = trace_model(Small(), (torch.randn(2, 3, 4, 4),)).analysis
    by_op = {}
    for n in analysis.nodes:
        by_op.setdefault(n.op, []).append(n)
    assert [n.flops for n in by_op["norm"]] == [4 * 96]
    assert [n.flops for n in by_op["maxpool"]] == [24 * 4]
    assert [n.flops for n in by_op["avgpool"]] == [24 * 4]
    assert [n.flops for n in by_op["adaptive"]] == [96]
    assert [n.flops for n in by_op["add"]] == [24, 6]
    assert all(n.bytes == 0 and n.flops == 0 for n in by_op["view"])
    assert by_op["maxpool"][0].saved_bytes == 24 * 8  # int64 indices; its input is counted at relu


def test_per_node_shapes_dtypes_and_bytes_equal_eager_outputs():
    model = models.lenet5().double()
    x = torch.randn(3, 1, 28, 28, dtype=torch.float64)
    seen = {}
    for name, mod in model.named_modules():
        if name:
            mod.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o))
    model(x)
    mg = trace_model(model, (x,))
    nodes = {n.name: n for n in mg.analysis.nodes}
    for fx_node in mg.module.graph.nodes:
        if fx_node.op == "call_module":
            out, cost = seen[fx_node.target], nodes[fx_node.name]
            assert cost.shape == tuple(out.shape) and cost.dtype == torch.float64
            if cost.op not in ("view", "save_output") or cost.bytes:
                assert cost.bytes == out.numel() * 8
    assert mg.analysis.param_bytes == 61_706 * 8


def _saved_by_autograd(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages autograd saves for backward."""
    owned = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in owned:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(saved.values())


@pytest.mark.parametrize("name, rel", [("lenet5", 0.0), ("resnet32", 0.005), ("vgg16", 0.01)])
def test_activations_kept_for_backward_match_autograds_saved_tensors(name, rel):
    """Tolerance: batch norm's per-channel saved mean and inverse std are not counted."""
    torch.manual_seed(0)
    model = models.get_model(name).train()
    x = torch.randn(4, *models.input_shape(name))
    ours = trace_model(model, (x,)).analysis.saved_bytes_per_sample * 4
    truth = _saved_by_autograd(model, x)
    assert abs(ours - truth) <= rel * truth, (ours, truth)
    assert ours <= truth


class _Attention(nn.Module):
    """``x [N, T, 32]`` → causal self-attention of 4 heads (``dropout_p`` on its weights) → a
    linear layer."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.qkv, self.out, self.dropout = nn.Linear(32, 96), nn.Linear(32, 32), dropout

    def forward(self, x):
        n, t = x.size(0), x.size(1)
        q, k, v = self.qkv(x).chunk(3, dim=2)
        q, k, v = (a.view(n, t, 4, 8).transpose(1, 2) for a in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(n, t, 32))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_attention_flops_and_saved_bytes_match_flopcounter_and_autograd(dropout):
    """scaled_dot_product_attention: 4·N·H·Tq·Tk·D FLOPs (its two batched products, which
    FlopCounterMode counts on the composite path that dropout takes); saved for backward, as
    torch's CPU kernels keep them: q, k, v, the output and the log-sum-exp without dropout, copies
    of q, k, v and three [N, H, Tq, Tk] tensors with it."""
    torch.manual_seed(0)
    model, x = _Attention(dropout).train(), torch.randn(4, 24, 32)
    nodes = trace_model(model, (x,), strict=True).analysis.nodes
    attention = next(n for n in nodes if n.op == "attention")
    assert attention.flops == 4 * 4 * 4 * 24 * 24 * 8
    if dropout:
        with FlopCounterMode(display=False) as counter:
            model(x)
        biases = 4 * 24 * (96 + 32)
        assert sum(n.flops for n in nodes if n.op in ("linear", "attention")) == counter.get_total_flops() + biases
    ours = trace_model(model, (x,)).analysis.saved_bytes_per_sample * 4
    assert ours == _saved_by_autograd(model, x)
