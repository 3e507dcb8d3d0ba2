"""What a language modeller reads of a fit: z's validation loss and perplexity per token, tokens/s
beside samples/s, and the time, samples and tokens to a target validation loss
(``fit(target_loss=)``), in the History and the ``log_dir`` files.

A one-layer GPT of 32 channels, context 32, on windows of the fortunes corpus keeps each fit to a
few seconds.
"""

from __future__ import annotations

import csv
import math
import os

import pytest
import torch

import crossbow_graph as cg
from crossbow_graph import datasets
from crossbow_graph.models.gpt import gpt, lm_loss, token_accuracy

from _plans import make_plan

pytestmark = pytest.mark.skipif(
    not all(os.path.isfile(os.path.join(datasets.FORTUNES_DIR, f)) for f in datasets.FORTUNES_FILES),
    reason="Debian packages fortunes and fortunes-min not installed (bash scripts/setup.sh)")

T, B, K = 32, 4, 2  # context, windows per learner, learners


@pytest.fixture(scope="module")
def data() -> tuple[datasets.TextDataset, datasets.TextDataset]:
    """256 training and 16 validation windows of T bytes, spread over their splits."""
    return (datasets.fortunes("train", block_size=T).subset(256),
            datasets.fortunes("val", block_size=T).subset(16))


def _plan(train: datasets.TextDataset, **options) -> cg.Plan:
    """The one-layer GPT (seed 0) under AdamW(lr 3e-3), b = B, on one CPU device."""
    return make_plan(lambda: gpt(n_layer=1, n_head=2, n_embd=32, block_size=T),
                     example=train.tensors[0][:2], loss_fn=lm_loss, batch_size=B, devices=1,
                     optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3), **options)


def _fit(data, **fit) -> cg.History:
    train, val = data
    plan = _plan(train, replicas=K, executor="inline")
    return plan.fit(train, 1, eval_dataset=val, evals_per_epoch=8, eval_batch_size=16,
                    progress=False, metrics_every=None, cpu_threads=1, metric_fn=token_accuracy,
                    **fit)


def test_evaluations_carry_perplexity_and_samples_and_epochs_tokens_per_s(data):
    history = _fit(data)
    assert history.tokens_per_sample == T
    per_eval = 256 // 8  # samples between evaluations: 32 = 4 rounds of K·B
    assert [e.samples for e in history.evals] == [per_eval * (i + 1) for i in range(8)]
    for e in history.evals:
        assert e.test_perplexity == pytest.approx(math.exp(e.test_loss), rel=1e-12)
    epoch = history.epochs[0]
    assert epoch.tokens_per_s == pytest.approx(epoch.samples_per_s * T, rel=1e-12)
    assert history.target_loss is None and history.time_to_loss_s is None
    assert history.tokens_to_loss is None and not history.target_reached


def test_fit_stops_at_the_first_evaluation_at_or_below_target_loss(data):
    full = _fit(data)
    losses = [e.test_loss for e in full.evals]
    assert losses[3] < min(losses[:3])  # the 4th evaluation is the first this low
    history = _fit(data, target_loss=losses[3])
    assert len(history.evals) == 4 and history.target_reached
    hit = history.evals[-1]
    assert hit.test_loss == pytest.approx(losses[3], abs=1e-6)  # the same run up to there
    assert history.time_to_loss_s == hit.train_seconds
    assert history.epochs_to_loss == hit.epoch == pytest.approx(0.5)
    assert history.samples_to_loss == 4 * 256 // 8
    assert history.tokens_to_loss == history.samples_to_loss * T
    assert history.time_to_accuracy_s is None
    assert history.to_dict()["tokens_to_loss"] == history.tokens_to_loss


def test_log_dir_writes_perplexity_and_tokens_per_s(data, tmp_path):
    log = str(tmp_path / "log")
    history = _fit(data, log_dir=log)

    def rows(name):
        with open(os.path.join(log, name), newline="") as f:
            return list(csv.DictReader(f))

    evals = rows("evals.csv")
    assert [float(r["test_perplexity"]) for r in evals] == [e.test_perplexity for e in history.evals]
    assert [int(r["samples"]) for r in evals] == [e.samples for e in history.evals]
    for r in rows("rounds.csv"):
        assert float(r["tokens_per_s"]) == pytest.approx(float(r["samples_per_s"]) * T, rel=1e-9)
    assert float(rows("epochs.csv")[0]["tokens_per_s"]) == history.epochs[0].tokens_per_s


@pytest.mark.parametrize("target, error, match", [
    (float("nan"), ValueError, r"target_loss=nan: must be a finite number"),
    ("2.4", TypeError, r"target_loss='2.4': must be a number"),
    (True, TypeError, r"target_loss=True: must be a number"),
])
def test_a_bad_target_loss_is_refused(target, error, match):
    with pytest.raises(error, match=match):
        cg.FitOptions(target_loss=target)


def test_target_loss_without_an_eval_dataset_is_refused(data):
    train, _ = data
    plan = _plan(train)
    with pytest.raises(ValueError, match="target_loss needs an eval_dataset"):
        plan.fit(train, target_loss=2.4, progress=False)


def test_a_resumed_fit_that_had_reached_target_loss_trains_no_more(data, tmp_path):
    """The checkpoint keeps the time, epochs and samples to the target loss; resuming the run it
    stopped finishes it without another round."""
    losses = [e.test_loss for e in _fit(data).evals]
    ckpt = str(tmp_path / "ckpt")
    first = _fit(data, target_loss=losses[3], checkpoint_dir=ckpt, checkpoint_every=2)
    train, val = data
    plan = _plan(train, replicas=K, executor="inline")
    again = plan.fit(train, 1, eval_dataset=val, evals_per_epoch=8, eval_batch_size=16,
                     progress=False, metrics_every=None, cpu_threads=1, metric_fn=token_accuracy,
                     target_loss=losses[3], checkpoint_dir=ckpt, resume=True)
    assert plan.rounds_done == 16 and len(again.evals) == 4  # the 16 rounds before the stop
    assert (again.time_to_loss_s, again.samples_to_loss) == (first.time_to_loss_s, first.samples_to_loss)
