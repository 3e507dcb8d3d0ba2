"""Metrics to CSV files and TensorBoard, and the History as JSON: the ``log_dir`` of a fit.

Files (docs/reliability.md, Logging, lists their columns): ``rounds.csv``, ``evals.csv``,
``epochs.csv``, ``faults.csv`` (every rank's under torchrun), ``history.json`` and TensorBoard
event files (steps: global round numbers); a resumed fit appends to them."""

from __future__ import annotations

import csv
import json
import os
from dataclasses import asdict
from typing import Any

from ..errors import is_count
from .history import EpochRecord, EvalRecord
from .hooks import FitContext, Hook

__all__ = ["MetricsLogger"]

_ROUND_FIELDS = ["round", "epoch", "round_in_epoch", "loss", "samples_per_s", "train_seconds",
                 "tokens_per_s"]
_EVAL_FIELDS = list(EvalRecord.__dataclass_fields__)
_EPOCH_FIELDS = list(EpochRecord.__dataclass_fields__)
_FAULT_FIELDS = ["round", "device", "replica", "rank"]


class _Csv:
    def __init__(self, path: str, fields: list[str]) -> None:
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        self.file = open(path, "a", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=fields)
        if new:
            self.writer.writeheader()

    def write(self, row: dict[str, Any]) -> None:
        self.writer.writerow(row)


class MetricsLogger(Hook):
    """Writes per-round and per-epoch metrics to CSV and TensorBoard under ``log_dir``.

    Args:
        log_dir: the directory (created if missing).
        every_rounds: log every this many rounds (≥ 1); reading a round's loss waits for the
            device, so on a GPU a larger value keeps the learners busy.
        tensorboard: also write TensorBoard event files (the ``tensorboard`` extra:
            ``pip install 'crossbow_graph[tensorboard]'``).

    Raises:
        ValueError: ``every_rounds`` < 1.
        ImportError: at the fit's start, ``tensorboard=True`` without the tensorboard package."""

    mutates_replicas = False  # it only reads the metrics: the overlap of rounds stays on

    decides = False  # it writes files only

    def __init__(self, log_dir: str, *, every_rounds: int = 1, tensorboard: bool = True) -> None:
        if not is_count(every_rounds):
            raise ValueError(f"every_rounds={every_rounds!r}: must be an integer ≥ 1")
        self.log_dir, self.every_rounds, self.tensorboard = log_dir, every_rounds, tensorboard
        self._files: dict[str, _Csv] = {}
        self._writer = None

    def before_fit(self, ctx: FitContext) -> None:
        if self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # slow import: only when used
            except ImportError as exc:
                raise ImportError(
                    f"logging to {self.log_dir} with TensorBoard events needs the tensorboard "
                    "package: pip install 'crossbow_graph[tensorboard]'; or log CSV files only with "
                    "hooks=[MetricsLogger(log_dir, tensorboard=False)]") from exc
        os.makedirs(self.log_dir, exist_ok=True)
        for name, fields in (("rounds", _ROUND_FIELDS), ("evals", _EVAL_FIELDS),
                             ("epochs", _EPOCH_FIELDS), ("faults", _FAULT_FIELDS)):
            self._files[name] = _Csv(os.path.join(self.log_dir, f"{name}.csv"), fields)
        if self.tensorboard:
            self._writer = SummaryWriter(log_dir=self.log_dir)
        self._last = (ctx.plan.progress.rounds_done, ctx.train_seconds)
        self._faults_seen = len(ctx.history.faults)

    def _scalar(self, tag: str, value: float | None, step: int) -> None:
        if self._writer is not None and value is not None:
            self._writer.add_scalar(tag, value, step)

    def after_round(self, ctx: FitContext) -> None:
        plan = ctx.plan
        step = plan.progress.rounds_done
        faults = ctx.history.faults[self._faults_seen:]
        for f in faults:
            self._files["faults"].write(asdict(f))
        if faults:
            self._faults_seen += len(faults)
            self._scalar("faults/replicas_reset", float(len(faults)), step)
        if step % self.every_rounds:
            return
        last_round, last_seconds = self._last
        samples = (step - last_round) * plan.num_learners * plan.settings.batch_size
        rate = samples / max(ctx.train_seconds - last_seconds, 1e-9)
        loss = float(ctx.round_loss)
        token_rate = ctx.history.per_token(rate)
        self._files["rounds"].write({"round": step, "epoch": ctx.epoch + 1,
                                     "round_in_epoch": ctx.round_in_epoch, "loss": loss,
                                     "samples_per_s": rate, "train_seconds": ctx.train_seconds,
                                     "tokens_per_s": token_rate})
        self._scalar("train/loss", loss, step)
        self._scalar("train/samples_per_s", rate, step)
        self._scalar("train/tokens_per_s", token_rate, step)
        self._last = (step, ctx.train_seconds)

    def after_eval(self, ctx: FitContext, record: EvalRecord) -> None:
        row = asdict(record)
        row["test_extras"] = json.dumps(record.test_extras)  # one column: keys vary by loss_fn
        self._files["evals"].write(row)
        self._scalar("eval/accuracy", record.test_accuracy, record.round)
        self._scalar("eval/loss", record.test_loss, record.round)
        self._scalar("eval/perplexity", record.test_perplexity, record.round)
        for key, value in record.test_extras.items():
            self._scalar(f"eval/{key}", value, record.round)

    def after_epoch(self, ctx: FitContext, record: EpochRecord) -> None:
        self._files["epochs"].write(asdict(record))
        step = ctx.plan.progress.rounds_done
        self._scalar("epoch/train_loss", record.train_loss, step)
        self._scalar("epoch/samples_per_s", record.samples_per_s, step)
        self._scalar("epoch/tokens_per_s", record.tokens_per_s, step)
        self._scalar("epoch/accuracy", record.test_accuracy, step)
        self._scalar("epoch/replicas_per_device", float(record.replicas_per_device), step)
        for f in self._files.values():
            f.file.flush()
        if self._writer is not None:
            self._writer.flush()

    def after_fit(self, ctx: FitContext) -> None:
        for f in self._files.values():
            f.file.close()
        self._files.clear()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        ctx.history.save_json(os.path.join(self.log_dir, "history.json"))
