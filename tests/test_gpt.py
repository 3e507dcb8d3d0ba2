"""The zoo's GPT (models/gpt.py) on the fortunes corpus: its shape, causality and parameter count,
its trace (FLOPs against FlopCounterMode), one learner against eager PyTorch step for step
(AdamW and SGD), fused replicas against per-replica ones, and dropout masks per replica.

Small configurations (2 layers, 32 channels, context 32) on the first windows of the real
training split keep each fit under a few seconds; the default model is only built and traced.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch.utils.data import TensorDataset
from torch.utils.flop_counter import FlopCounterMode

import crossbow_graph as cg
from crossbow_graph import datasets
from crossbow_graph.models.gpt import GPT, gpt, lm_loss, token_accuracy

from _reference import batches_of, eager_steps

pytestmark = pytest.mark.skipif(
    not all(os.path.isfile(os.path.join(datasets.FORTUNES_DIR, f)) for f in datasets.FORTUNES_FILES),
    reason="Debian packages fortunes and fortunes-min not installed (bash scripts/setup.sh installs "
           "them: apt-get install fortunes fortunes-min)")

T, B, N = 32, 8, 256  # context, batch per learner, training windows


def _small(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return gpt(n_layer=2, n_head=2, n_embd=32, block_size=T, dropout=dropout)


@pytest.fixture(scope="module")
def data() -> TensorDataset:
    """The first N windows of T bytes of the training split."""
    train = datasets.fortunes("train", block_size=T)
    return TensorDataset(*(t[:N] for t in train.tensors))


def _plan(model, data, **options) -> cg.Plan:
    options = {"devices": 1, "executor": "inline", "optimizer": cg.SGD(lr=0.05, momentum=0.9)} | options
    return cg.compile(model, (data.tensors[0][:2],), lm_loss, batch_size=B, **options)


def test_the_default_gpt_has_nanogpts_shape_and_1_2_million_parameters():
    assert cg.models.gpt is gpt and cg.models.lm_loss is lm_loss
    model = gpt()
    assert sum(p.numel() for p in model.parameters()) == 1_239_040
    assert len(model.blocks) == 6 and model.block_size == 128 and model.vocab_size == 256
    assert model.wte.weight.shape == (256, 128) and model.wpe.shape == (128, 128)
    idx = torch.randint(0, 256, (2, 128))
    with torch.no_grad():
        assert model(idx).shape == (2, 128, 256)
    with torch.no_grad():  # tied: the output layer is the embedding
        x = model.ln_f(model.blocks(model.wte(idx) + model.wpe))
        torch.testing.assert_close(model(idx), x @ model.wte.weight.T, rtol=1e-5, atol=1e-5)


def test_position_t_sees_only_tokens_up_to_t():
    model = _small().eval()
    idx = torch.randint(0, 256, (1, T))
    changed = idx.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=1e-6)
    assert (a[:, 20] - b[:, 20]).abs().max() > 1e-3


def test_loss_and_accuracy_are_per_token_means():
    logits, y = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    manual = -torch.log_softmax(logits, -1).gather(-1, y[..., None]).mean()
    torch.testing.assert_close(lm_loss(logits, y), manual)
    assert float(token_accuracy(logits, y)) == float((logits.argmax(-1) == y).float().mean())


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_embd=30, n_head=4), "n_embd must be a multiple of n_head"),
    (dict(n_layer=0), r"n_layer=0\): sizes must be integers ≥ 1"),
    (dict(dropout=1.0), r"dropout=1.0.*\[0, 1\)"),
])
def test_bad_sizes_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gpt(**kwargs)


def test_generate_continues_a_prompt_reproducibly():
    model = _small().eval()
    prompt = datasets.TextDataset.encode("A fortune")[None]
    out = model.generate(prompt, 40, top_k=10, generator=torch.Generator().manual_seed(3))
    again = model.generate(prompt, 40, top_k=10, generator=torch.Generator().manual_seed(3))
    assert out.shape == (1, 9 + 40) and torch.equal(out, again) and torch.equal(out[:, :9], prompt)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 1, temperature=0.0)


def test_the_plan_traces_the_gpt_and_counts_its_flops(data):
    """FLOPs of the linear layers and attention: FlopCounterMode's on the eager model (dropout in
    attention takes SDPA's composite path, whose two batched products it counts) plus the bias
    additions, which FlopCounterMode leaves out."""
    model = _small(dropout=0.1)
    plan = _plan(model, data, replicas=2, strict_trace=True)
    assert plan.model_graph.tracer == "torch.fx"
    x = data.tensors[0][:2]
    with FlopCounterMode(display=False) as counter:
        copy.deepcopy(model).train()(x)
    biases = sum(2 * T * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    nodes = plan.model_graph.analysis.nodes
    assert sum(n.flops for n in nodes if n.op in ("linear", "attention")) == counter.get_total_flops() + biases
    assert sum(n.op == "attention" for n in nodes) == 2
    assert "MFLOP/sample" in plan.summary() and "measured eager" not in plan.summary()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_one_learner_equals_eager_pytorch_step_for_step(data, optimizer):
    """k = 1 is the optimizer alone (docs/design-overview.md §2): 32 steps of AdamW (torch's fused
    implementation, which one replica's row runs where the user sets none) or SGD with momentum
    and weight decay, against eager PyTorch on the same batches in the same order."""
    def make(m):
        if optimizer == "adamw":
            return torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)

    model = _small()
    expected = eager_steps(copy.deepcopy(model), make, batches_of(data, B), loss_fn=lm_loss).weights[-1]
    user = make(model)
    if optimizer == "adamw":
        user = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    plan = _plan(model, data, replicas=1, optimizer=user)
    plan.fit(data, shuffle=False, progress=False, metrics_every=None)
    z = plan.central_weights()
    assert float((z - expected).norm() / expected.norm()) < 1e-5


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fused_replicas_equal_per_replica_ones(data, optimizer):
    """k = 4 learners, dropout 0, 8 rounds: the vmapped program computes what each replica's own
    forward and backward computes, up to float32 rounding in another order (measured: SGD max
    |Δ| 1.2e-7 on weights of order 1, AdamW ‖Δ‖/‖w‖ 3.8e-7)."""
    make = (lambda m: cg.SGD(lr=0.05, momentum=0.9)) if optimizer == "sgd" else \
        (lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3))
    weights, losses = {}, {}
    for mode in ("per_replica", "fused"):
        model = _small()
        plan = _plan(model, data, replicas=4, learner_mode=mode, optimizer=make(model))
        history = plan.fit(data, shuffle=False, progress=False, metrics_every=None)
        weights[mode], losses[mode] = plan.replica_weights(), history.epochs[-1].train_loss
    if optimizer == "sgd":
        torch.testing.assert_close(weights["fused"], weights["per_replica"], rtol=1e-4, atol=1e-5)
    # Adam's normalised step turns the rounding of a gradient near 0 into a step of up to η
    # either way (docs/optimizers.md): a few elements may differ by more, the whole by little
    error = (weights["fused"] - weights["per_replica"]).norm() / weights["per_replica"].norm()
    assert float(error) < 1e-5
    assert losses["fused"] == pytest.approx(losses["per_replica"], rel=1e-5)


def _one_round_with_dropout(data, dropout: float, mode: str) -> cg.Plan:
    """One round of 4 fused learners that all get the same window (the data set repeats it)."""
    same = TensorDataset(data.tensors[0][:1].repeat(4 * B, 1), data.tensors[1][:1].repeat(4 * B, 1))
    plan = _plan(_small(dropout), same, replicas=4, learner_mode=mode)
    plan.fit(same, epochs=1, seed=7, progress=False, metrics_every=None)
    return plan


@pytest.mark.parametrize("mode", ["fused", "per_replica"])
def test_dropout_masks_differ_across_replicas_and_repeat_across_fits(data, mode):
    """Replicas start equal and see the same samples: after one step they differ only where
    their dropout masks do (with dropout 0 they stay equal); two fits with the same seed are
    bit-identical."""
    rows = _one_round_with_dropout(data, 0.0, mode).replica_weights()
    assert all(torch.equal(rows[0], rows[j]) for j in range(1, 4))
    plan = _one_round_with_dropout(data, 0.2, mode)
    rows = plan.replica_weights()
    assert all(float((rows[i] - rows[j]).abs().max()) > 1e-4 for i in range(4) for j in range(i))
    again = _one_round_with_dropout(data, 0.2, mode)
    assert torch.equal(again.replica_weights(), rows)
    assert torch.equal(again.central_weights(), plan.central_weights())


def test_gpt_trains_on_fortunes_under_sma(data):
    """4 fused learners × b = 8 with AdamW lower z's validation loss from ln 256 (uniform bytes)
    within one pass over N windows; ``token_accuracy`` is the evaluation's metric."""
    val = datasets.fortunes("val", block_size=T).subset(64)
    model = _small()
    plan = _plan(model, data, replicas=4, learner_mode="fused",
                 optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    before = plan.evaluate(val, metric_fn=token_accuracy)
    history = plan.fit(data, epochs=2, eval_dataset=val, metric_fn=token_accuracy, progress=False,
                       metrics_every=None)
    accuracy, loss = plan.evaluate(val, metric_fn=token_accuracy)
    assert before[1] == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.05)
    assert loss < before[1] - 1.5 and accuracy > before[0] + 0.1
    assert history.evals[-1].test_loss == pytest.approx(loss, rel=1e-6)
