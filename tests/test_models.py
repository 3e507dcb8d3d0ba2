"""The model zoo: published parameter counts, eager forward shapes, tracing and inspection."""

from __future__ import annotations

import pytest
import torch

from crossbow_graph import models
from crossbow_graph.compiler.inspect import inspect_model
from crossbow_graph.compiler.trace import trace_model


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# Published counts: LeNet-5 as CROSSBOW trains it (conv 6/16, fc 120/84/10): 61,706.
# ResNet-32: He et al. 2016, Table 6, "0.46M" (option A shortcuts: 464,154).
# ResNet-50: He et al. 2016, Table 1, "25.6M" (25,557,032, as torchvision's resnet50).
@pytest.fixture(scope="module")
def resnet50():
    return models.get_model("resnet50")


@pytest.mark.parametrize("name, exact, published, rel", [
    ("lenet5", 61_706, 61_706, 0.0),
    ("resnet32", 464_154, 0.46e6, 0.01),
    ("resnet50", 25_557_032, 25.6e6, 0.01),
])
def test_parameter_counts_match_the_published_ones(name, exact, published, rel, resnet50):
    n = _count(resnet50 if name == "resnet50" else models.get_model(name))
    assert n == exact
    assert abs(n - published) <= rel * published


def test_vgg16_convolutions_are_the_published_vgg16s():
    """VGG-16 (config D) has 138,357,544 parameters on ImageNet; without its three FC layers
    (25088·4096+4096, 4096·4096+4096, 4096·1000+1000) its 13 convolutions hold 14,714,688."""
    model = models.get_model("vgg16")
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    fc = (25088 * 4096 + 4096) + (4096 * 4096 + 4096) + (4096 * 1000 + 1000)
    assert len(convs) == 13
    assert sum(_count(c) for c in convs) == 138_357_544 - fc
    assert sum(1 for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)) == 13
    assert _count(model) == 15_038_116
    assert model.classifier[-1].out_features == 100


def test_every_model_has_an_input_shape_and_its_eager_output_has_the_class_dimension():
    assert set(models.INPUT_SHAPES) == set(models.MODELS) == {"lenet5", "resnet32", "vgg16", "resnet50"}
    classes = {"lenet5": 10, "resnet32": 10, "vgg16": 100, "resnet50": 1000}
    for name in ("lenet5", "resnet32", "vgg16"):
        with torch.no_grad():
            out = models.get_model(name).eval()(torch.randn(2, *models.input_shape(name)))
        assert out.shape == (2, classes[name])
    with pytest.raises(ValueError, match="the zoo has: lenet5, resnet32, resnet50, vgg16"):
        models.input_shape("alexnet")


@pytest.mark.parametrize("name", ["lenet5", "resnet32", "vgg16"])
def test_traced_model_computes_what_the_eager_model_computes(name):
    torch.manual_seed(0)
    model = models.get_model(name).eval()
    x = torch.randn(2, *models.input_shape(name))
    mg = trace_model(model, (x,))
    torch.testing.assert_close(mg.module(x), model(x), rtol=1e-5, atol=1e-5)
    assert mg.num_parameters == _count(model)


@pytest.mark.parametrize("name", ["lenet5", "resnet32", "vgg16", "resnet50"])
def test_every_zoo_model_is_inspectable(name, resnet50):
    model = resnet50 if name == "resnet50" else models.get_model(name)
    view = inspect_model(model, (torch.randn(1, *models.input_shape(name)),),
                         devices=["cpu:0", "cpu:1"], replicas_per_device=2, batch_size=8)
    text = view.summary()
    assert f"{_count(model):,} trainable parameters" in text
    kinds = [view.task_graph.nodes[n]["task"].kind.value for n in view.task_graph]
    assert sorted(kinds) == ["global_sync"] + ["learn"] * 4 + ["local_sync"] * 2
