"""HuggingFace models from tiny configs compile as given (no wrapper), train on 2 devices × 2
replicas, evaluate through their ModelOutput, and come back as their own class.

Random initialisation, nothing downloaded (HF_HUB_OFFLINE=1). Oracles: eager PyTorch on the
central model (loss, accuracy), FlopCounterMode (the analysis's FLOPs), the model's own state_dict
keys and tied weights. Skipped without transformers (the `test` extra installs it).
"""

from __future__ import annotations

import math
import os
import re
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never download

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import Dataset, TensorDataset  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import crossbow_graph as cg  # noqa: E402

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::crossbow_graph.errors.TraceWarning")

VOCAB, SEQ, N = 100, 16, 256


class Dicts(Dataset):
    """Samples as HuggingFace data sets give them: one dict of keyword inputs (labels among them)."""

    def __init__(self, **columns: torch.Tensor) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.columns.items()}


class Pairs(Dataset):
    """``(keyword inputs, target)`` pairs: the inputs a dict, the target given to loss_fn."""

    def __init__(self, inputs: dict[str, torch.Tensor], target: torch.Tensor) -> None:
        self.inputs, self.target = inputs, target

    def __len__(self) -> int:
        return len(self.target)

    def __getitem__(self, i: int):
        return {k: v[i] for k, v in self.inputs.items()}, self.target[i]


def _tokens(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (N, SEQ), generator=g)


def _logits_loss(out, y):
    return F.cross_entropy(out.logits, y)


def _bert() -> "transformers.BertForSequenceClassification":
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=32, num_labels=3)
    return transformers.BertForSequenceClassification(cfg)


def _gpt2() -> "transformers.GPT2LMHeadModel":
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, use_cache=False)
    return transformers.GPT2LMHeadModel(cfg)


def _fit(plan, train, *, epochs: int = 2, **kw):
    """Eval loss of z before and after ``epochs`` of training, and the history."""
    before = plan.evaluate(train)[1]
    history = plan.fit(train, epochs, eval_dataset=train, progress=False, **kw)
    return before, history


def test_bert_sequence_classification_compiles_as_given_and_trains_on_2x2():
    torch.manual_seed(0)
    model = _bert()
    ids = _tokens(0)
    mask = torch.ones_like(ids)
    labels = ids[:, 0] % 3  # the class is in the first token
    train = Pairs({"input_ids": ids, "attention_mask": mask}, labels)
    plan = cg.compile(model, {"input_ids": ids[:2], "attention_mask": mask[:2]}, _logits_loss,
                      batch_size=8, devices=2, replicas=2, optimizer=cg.SGD(lr=0.1, momentum=0.9),
                      sync=cg.SMA(scale_lr=False))  # 0.1: each learner's lr, tuned at 2 × 2
    assert plan.model_graph.analysis.forward_flops_per_sample > 0
    before, history = _fit(plan, train, epochs=3)
    assert history.evals[-1].test_loss < 0.9 * before
    z = plan.central_model()
    assert isinstance(z, transformers.BertForSequenceClassification)
    assert list(z.state_dict()) == list(model.state_dict())
    with torch.no_grad():  # oracle: the central model in eager PyTorch
        logits = z(input_ids=ids, attention_mask=mask).logits
    acc, loss = plan.evaluate(train)
    torch.testing.assert_close(loss, float(F.cross_entropy(logits, labels)), rtol=1e-5, atol=1e-6)
    assert acc == pytest.approx(float((logits.argmax(1) == labels).float().mean()), abs=1e-9)
    assert history.evals[-1].test_accuracy is not None


def test_gpt2_causal_lm_trains_on_its_own_loss_with_the_labels_among_the_inputs():
    torch.manual_seed(0)
    model = _gpt2()
    ids = (_tokens(1)[:, :1] + torch.arange(SEQ)) % VOCAB  # each token the previous one + 1
    train = Dicts(input_ids=ids, labels=ids)
    plan = cg.compile(model, {"input_ids": ids[:2], "labels": ids[:2]}, None, batch_size=8,
                      devices=2, replicas=2, optimizer=cg.SGD(lr=0.2, momentum=0.9),
                      sync=cg.SMA(scale_lr=False))  # 0.2: each learner's lr, tuned at 2 × 2
    with pytest.warns(UserWarning, match=r"no test accuracy: the output \(CausalLMOutput.*logits "
                                         r"\[256, 16, 100\].*metric_fn") as caught:
        before, history = _fit(plan, train)
    assert sum("no test accuracy" in str(w.message) for w in caught) == 1  # once per plan
    assert history.evals[-1].test_loss < 0.7 * before
    assert history.evals[-1].test_accuracy is None
    z = plan.central_model()
    assert isinstance(z, transformers.GPT2LMHeadModel)
    assert list(z.state_dict()) == list(model.state_dict())
    assert z.lm_head.weight is z.transformer.wte.weight  # tied weights kept
    assert model.lm_head.weight is model.transformer.wte.weight  # the user's model holds z, tied
    for key, value in z.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=key)
    with torch.no_grad():
        torch.testing.assert_close(plan.evaluate(train)[1], float(z(input_ids=ids, labels=ids).loss),
                                   rtol=1e-5, atol=1e-6)


def _next_token_accuracy(out, labels):
    return (out.logits[:, :-1].argmax(-1) == labels[:, 1:]).float().mean()


def test_a_metric_fn_gives_the_accuracy_that_target_accuracy_stops_on():
    torch.manual_seed(0)
    ids = (_tokens(2)[:, :1] + torch.arange(SEQ)) % VOCAB
    train = Dicts(input_ids=ids, labels=ids)
    plan = cg.compile(_gpt2(), {"input_ids": ids[:2], "labels": ids[:2]}, None, batch_size=8,
                      devices=1, replicas=2, optimizer=cg.SGD(lr=0.1, momentum=0.9))
    history = plan.fit(train, 20, eval_dataset=train, progress=False, target_accuracy=0.5,
                       metric_fn=_next_token_accuracy)
    assert history.epochs_to_accuracy is not None and len(history.epochs) < 20
    with torch.no_grad():
        oracle = float(_next_token_accuracy(plan.central_model()(input_ids=ids), ids))
    assert history.evals[-1].test_accuracy == pytest.approx(oracle, abs=1e-6) and oracle >= 0.5


def test_vit_image_classification_compiles_as_given_and_trains_on_2x2():
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                 num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                 num_labels=4)
    model = transformers.ViTForImageClassification(cfg)
    g = torch.Generator().manual_seed(3)
    y = torch.randint(0, 4, (N,), generator=g)
    x = torch.randn(N, 3, 16, 16, generator=g) + (y.float() - 1.5)[:, None, None, None]
    train = TensorDataset(x, y)
    plan = cg.compile(model, (x[:2],), _logits_loss, batch_size=8, devices=2, replicas=2,
                      optimizer=cg.SGD(lr=0.05, momentum=0.9),
                      sync=cg.SMA(scale_lr=False))  # 0.05: each learner's lr, tuned at 2 × 2
    before, history = _fit(plan, train)
    assert history.evals[-1].test_loss < 0.7 * before
    assert history.evals[-1].test_accuracy > 0.5  # read from output.logits
    assert isinstance(plan.central_model(), transformers.ViTForImageClassification)


def test_the_analysis_of_an_untraceable_hf_model_counts_flopcountermodes_flops():
    model = _bert()
    ids = _tokens(4)[:4]
    plan = cg.compile(model, {"input_ids": ids}, _logits_loss, batch_size=4, replicas=1)
    graph = plan.model_graph
    if graph.tracer != "eager":
        pytest.skip(f"this transformers traces {graph.name} with {graph.tracer}")
    with FlopCounterMode(display=False) as counter:
        model.train()(input_ids=ids)
    assert graph.analysis.forward_flops_per_sample * 4 == pytest.approx(counter.get_total_flops(), rel=1e-12)
    assert "MFLOP/sample" in plan.summary() and " 0.00 MFLOP/sample" not in plan.summary()
    with pytest.raises(cg.TraceError, match=r"torch\.fx cannot trace BertForSequenceClassification"):
        cg.compile(model, {"input_ids": ids}, _logits_loss, batch_size=4, strict_trace=True)


class _Wrapper(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def test_an_hf_model_as_a_leaf_module_counts_its_flops():
    """The root as a leaf, and a wrapper with the model as a leaf: both measured eagerly."""
    model = _gpt2()
    ids = _tokens(7)[:2]
    with FlopCounterMode(display=False) as counter:
        model.train()(input_ids=ids)
    flops = counter.get_total_flops()
    root = cg.compile(model, {"input_ids": ids}, _logits_loss, batch_size=2, replicas=1,
                      leaf_modules=[transformers.GPT2LMHeadModel], strict_trace=True)
    assert root.model_graph.analysis.forward_flops_per_sample * 2 == pytest.approx(flops, rel=1e-12)
    wrapped = cg.compile(_Wrapper(model), (ids,), lambda out, y: out.sum(), batch_size=2,
                         replicas=1, leaf_modules=[transformers.GPT2LMHeadModel], strict_trace=True)
    leaf = next(n for n in wrapped.model_graph.analysis.nodes if n.name == "model")
    assert leaf.op == "measured" and leaf.flops == flops and leaf.saved_bytes > 0
    assert " 0.00 MFLOP/sample" not in wrapped.summary()


def test_loss_fn_none_without_labels_among_the_inputs_fails_at_compile():
    ids = _tokens(5)[:2]
    with pytest.raises(ValueError, match=r"loss_fn=None trains on the loss GPT2LMHeadModel computes.*"
                                         r"put the labels among the example inputs"):
        cg.compile(_gpt2(), {"input_ids": ids}, None, batch_size=2)


def test_transformers_own_tracer_gives_the_graph_where_it_exists():
    pytest.importorskip("transformers.utils.fx")  # transformers < 5
    model = _bert()
    model.config.problem_type = "single_label_classification"
    ids = _tokens(6)[:2]
    graph = cg.compile(model, {"input_ids": ids}, _logits_loss, batch_size=2,
                       replicas=1).model_graph
    assert graph.tracer == "transformers.fx" and graph.module is not None
    assert graph.analysis.forward_flops_per_sample > 0


def _clip() -> "transformers.CLIPModel":
    cfg = transformers.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=SEQ,
                         bos_token_id=0, eos_token_id=1, pad_token_id=1),
        vision_config=dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_channels=3),
        projection_dim=16)
    return transformers.CLIPModel(cfg)


def _pairs(n: int = 64) -> dict[str, torch.Tensor]:
    """Captions and images of 8 classes: the image's mean and the caption's tokens name it."""
    g = torch.Generator().manual_seed(8)
    c = torch.arange(n) % 8
    ids = (c[:, None] * 10 + torch.randint(0, 10, (n, SEQ), generator=g)) % VOCAB
    pixels = torch.randn(n, 3, 16, 16, generator=g) * 0.5 + (c.float() / 4 - 1)[:, None, None, None]
    return {"input_ids": ids, "pixel_values": pixels, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("flag_in", ["example_inputs", "samples"])
def test_clip_trains_on_its_own_contrastive_loss_without_labels(flag_in):
    """CLIP as given: ``return_loss=True`` among the example inputs (a flag every forward gets),
    or in every sample too (a flag, not collated into a tensor); dict samples without labels.
    Evaluated in batches of 8 captions and images of 8 classes, where chance is ln 8."""
    torch.manual_seed(0)
    columns = _pairs(128)
    train = Dicts(**columns) if flag_in == "example_inputs" else _Flagged(**columns)
    example = {k: v[:2] for k, v in columns.items()} | {"return_loss": True}
    model = _clip()
    plan = cg.compile(model, example, None, batch_size=8, devices=1, replicas=2,
                      optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3))
    with pytest.warns(UserWarning, match=r"no test accuracy: the samples have no target"):
        before = plan.evaluate(train, batch_size=8)[1]
        history = plan.fit(train, 4, eval_dataset=train, eval_batch_size=8, progress=False)
    assert history.evals[-1].test_loss < 0.75 * math.log(8) < before
    assert history.evals[-1].test_accuracy is None
    z = plan.central_model()
    assert isinstance(z, transformers.CLIPModel)
    with torch.no_grad():  # oracle: CLIP's own loss of the central model in eager PyTorch
        loss = float(z(**{k: v[:8] for k, v in columns.items()}, return_loss=True).loss)
    torch.testing.assert_close(plan.evaluate(Dicts(**{k: v[:8] for k, v in columns.items()}))[1],
                               loss, rtol=1e-5, atol=1e-6)


class _Flagged(Dicts):
    """CLIP's samples with the flag in each: ``{..., 'return_loss': True}``."""

    def __getitem__(self, i: int) -> dict:
        return {**super().__getitem__(i), "return_loss": True}


def test_clip_without_its_flag_is_told_the_flag_not_labels():
    columns = _pairs(4)
    with pytest.raises(ValueError, match=r"loss_fn=None trains on the loss CLIPModel computes "
                                         r"itself .* has none: CLIPModel.forward computes its loss "
                                         r"with return_loss=True: put it among the example inputs"):
        cg.compile(_clip(), {k: v[:2] for k, v in columns.items()}, None, batch_size=2)


def test_an_untraceable_hf_model_warns_in_one_line_once_with_the_detail_in_the_summary():
    columns = _pairs(4)
    example = {k: v[:2] for k, v in columns.items()} | {"return_loss": True}

    class OnceCLIP(transformers.CLIPModel):  # a class no other test compiles
        pass

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = cg.compile(OnceCLIP(_clip().config), example, None, batch_size=2, replicas=1)
        cg.compile(OnceCLIP(_clip().config), example, None, batch_size=2, replicas=1)
    traces = [str(w.message) for w in caught if issubclass(w.category, cg.TraceWarning)]
    assert len(traces) == 1 and "\n" not in traces[0] and len(traces[0]) < 300, traces
    assert re.fullmatch(r"OnceCLIP has no fx graph \(torch\.fx: \w+: .*\); it trains as given, "
                        r"with an approximate analysis: plan\.summary\(\) says what inspection "
                        r"lost and why; strict_trace=True raises the TraceError instead", traces[0])
    assert re.search(r"\ntrace: torch\.fx cannot trace OnceCLIP: .*\. Inspection is "
                     r"approximate: FLOPs count matrix products", plan.summary())


@pytest.mark.skipif(not os.path.isfile(os.path.join(cg.datasets.FORTUNES_DIR, "fortunes")),
                    reason="Debian packages fortunes and fortunes-min not installed (bash "
                           "scripts/setup.sh installs them)")
def test_gpt2_lm_head_model_trains_on_fortunes_bytes_fused_as_per_replica():
    """The language-model workload as a user brings a HuggingFace model: GPT2LMHeadModel from a
    tiny config over the 256 byte values, its logits scored by ``cg.models.lm_loss`` on windows of
    the fortunes corpus. 4 fused replicas compute what 4 per-replica ones do (dropout 0, AdamW,
    up to float32 rounding in another order), and z's validation loss falls from ln 256."""
    windows = cg.datasets.fortunes("train", block_size=32)
    train = TensorDataset(*(t[:256] for t in windows.tensors))
    val = cg.datasets.fortunes("val", block_size=32).subset(64)
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, use_cache=False, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    weights = {}
    for mode in ("per_replica", "fused"):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        plan = cg.compile(model, (train.tensors[0][:2],), lambda out, y: cg.models.lm_loss(out.logits, y),
                          batch_size=8, devices=1, replicas=4, learner_mode=mode, executor="inline",
                          optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                          sync=cg.SMA(scale_lr=False))  # the tolerance below is this lr's
        before = plan.evaluate(val)[1]
        plan.fit(train, epochs=1, shuffle=False, progress=False, metrics_every=None)
        weights[mode] = plan.replica_weights()
        assert before == pytest.approx(float(torch.log(torch.tensor(256.0))), abs=0.05)
        assert plan.evaluate(val)[1] < before - 1.0
    # Adam turns the rounding of a gradient near 0 into a step of up to η either way
    # (docs/optimizers.md): compared as a whole (measured 1.8e-6 after 8 rounds; max |Δ| 1.4e-5)
    error = (weights["fused"] - weights["per_replica"]).norm() / weights["per_replica"].norm()
    assert float(error) < 1e-5
