"""Checkpoints: the whole training state, written atomically, resumed bit-identically
(docs/reliability.md, Checkpoints: what a checkpoint holds; training/checkpoint_files.py: the
files; training/run_setup.py: the settings a resume keeps; training/run_lock.py: the lock)."""

from __future__ import annotations

import logging
import os
import random
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from ..engine.learning.faults import FaultEvent
from ..engine.learning.learners import seed_host_rngs
from ..engine.state.flat import float_buffers_named, trainable_named
from ..config import Adjustment
from ..errors import CheckpointError
from .checkpoint_files import (MAGIC, checkpoint_path, list_checkpoints, load_checkpoint,
                               load_latest, prune_checkpoints, remove_temporaries, save_checkpoint)
from .checkpoint_health import CheckpointHealth
from .history import EpochRecord, EvalRecord, History, MetricRecord, PolicyRecord
from .hooks import FitContext, Hook
from .options import check_writable_dir
from .reshard import saved_learners, saved_world_size, split_for_ranks
from .run_lock import DirectoryLock
from .run_setup import SettingsChoice, restore_outer_settings, restore_settings
from .sma_lr import LRRuleRecord, SMALRRule

if TYPE_CHECKING:
    from .fit_plan import FitPlan
    from .data import BatchSchedule

__all__ = ["CheckpointHook", "plan_state_dict", "load_plan_state_dict", "check_same_model",
           "model_layout", "save_checkpoint", "load_checkpoint", "load_latest", "list_checkpoints",
           "MAGIC"]  # the file functions are training/checkpoint_files.py's, named here too

log = logging.getLogger("crossbow_graph.checkpoint")

_FORMAT = 1


# -- the plan's state ------------------------------------------------------------------------

def plan_state_dict(plan: "FitPlan") -> dict[str, Any]:
    """The plan's training state as CPU tensors and plain values (docs/reliability.md, Checkpoints)."""
    plan.rounds.flush()  # the streams' work so far, on the host
    states = []
    for s in plan.states:
        flat = lambda t: s.params.to_standard(t.detach().cpu())  # noqa: E731 (any memory format)
        states.append({
            "name": s.name,
            "w": flat(s.w), "v": flat(s.v), "z": flat(s.z), "z_prev": flat(s.z_prev),
            "buf": s.buf.detach().cpu().clone(), "zbuf": s.zbuf.detach().cpu().clone(),
            "first_step": list(s.first_step),
            "optimizer_rows": s.optim_rows.state_dict() if s.optim_rows is not None else None,
            "int_buffers": [{n: b.detach().cpu().clone() for n, b in r.named_buffers()
                             if not b.is_floating_point()} for r in s.replicas],
            "loss_scales": None if s.loss_scales is None else  # float16 learners (engine/state/precision.py)
            (s.loss_scales.scale.clone(), s.loss_scales.good.clone()),
        })
    settings, rounds = plan.settings, plan.rounds.state_dict()
    return {
        "format": _FORMAT,
        "model": model_layout(plan),
        "devices": plan.devices, "replicas_per_device": plan.settings.replicas_per_device,
        "num_parameters": plan.num_parameters, "num_float_buffers": plan.states[0].buf.shape[1],
        "states": states,
        "batch_size": settings.batch_size,
        "sync": type(settings.sync).__name__,  # the sync algorithm's class (checked on resume)
        "alpha": settings.alpha, "sync_every": settings.sync_every,
        "lr": settings.lr, "learner_mode": settings.learner_mode,
        "optimizer": {"class": settings.optimizer.describe()["class"],
                      "groups": settings.optimizer.group_settings()},
        "setup": plan.run_record.setup,  # what the run was set up with (training/run_setup.py)
        "faults": [asdict(e) for e in rounds["faults"]],
        **plan.progress.state_dict(),  # epochs_done, rounds_done, ..., the epoch's losses
        "outer_optimizer": _sync_state_entry(plan),
        "fault_tolerance": rounds["fault_tolerance"],  # torchft's membership (transport/ft.py)
        # the worker processes' convolution library per b (backends/process/conv_choice.py):
        # measured per process with cpu_conv="auto", so a resumed process keeps its rounds' one
        "cpu_conv_choices": rounds["cpu_conv_choices"],
        # SMA's η rule: its ramp and factor (training/sma_lr.py)
        "lr_rule": None if settings.lr_rule is None else settings.lr_rule.state_dict(plan),
    }


def model_layout(plan: "FitPlan") -> dict[str, list[list[Any]]]:
    """``[name, shape, dtype]`` per trainable parameter, float buffer, integer buffer and
    frozen parameter, in that order, with the input model's dtypes."""
    template = plan.template

    def rows(named) -> list[list[Any]]:
        return [[n, list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in named]

    ints = [(n, b) for n, b in template.named_buffers() if not b.is_floating_point()]
    frozen = [(n, p) for n, p in template.named_parameters() if not p.requires_grad]
    return {"parameters": rows(trainable_named(template)),
            "float_buffers": rows(float_buffers_named(template)),
            "int_buffers": rows(ints), "frozen_parameters": rows(frozen)}


def _first_difference(what: str, saved: list[list[Any]], have: list[list[Any]]) -> str | None:
    for i, ((name, shape, dtype), (name2, shape2, dtype2)) in enumerate(zip(saved, have)):
        if name != name2:
            return f"checkpoint's {what} {i} is '{name}', this plan's is '{name2}'"
        if shape != shape2:
            return f"checkpoint's {what} '{name}' has shape {shape}, this plan's has shape {shape2}"
        if dtype != dtype2:
            return f"checkpoint's {what} '{name}' has dtype {dtype}, this plan's has dtype {dtype2}"
    counts = f"({len(saved)} {what}s in the checkpoint, {len(have)} in this plan)"
    if len(saved) > len(have):
        return f"checkpoint's {what} '{saved[len(have)][0]}' is not in this plan's model {counts}"
    if len(have) > len(saved):
        return f"this plan's {what} '{have[len(saved)][0]}' is not in the checkpoint {counts}"
    return None


def check_same_model(plan: "FitPlan", sd: dict[str, Any], source: str = "the checkpoint") -> None:
    """Refuse the ``plan_state_dict`` of another model (``model_layout`` differs); a state
    without ``model`` is accepted (``load_plan_state_dict`` compares the counts).

    Raises:
        CheckpointError: naming ``source``, the first difference and the fix."""
    if "model" not in sd:
        return
    have = model_layout(plan)
    for key, what in (("parameters", "parameter"), ("float_buffers", "float buffer"),
                      ("int_buffers", "integer buffer"), ("frozen_parameters", "frozen parameter")):
        if key not in sd["model"]:  # a layout without frozen parameters: checked without them
            continue
        diff = _first_difference(what, sd["model"][key], have[key])
        if diff is not None:
            raise CheckpointError(
                f"{source} was written for another model: {diff}; resume with the model "
                "that wrote it, or point checkpoint_dir at a new directory to start afresh"
            )


@torch.no_grad()
def load_plan_state_dict(plan: "FitPlan", sd: dict[str, Any], setup: dict[str, Any] | None = None,
                         source: str = "the checkpoint") -> None:
    """Copy a ``plan_state_dict`` into ``plan`` in place, its run settings first through
    ``Plan.adjust``; with ``setup`` (a resume) the rule of training/run_setup.py picks each setting
    (docs/reliability.md, Resuming with other settings).

    Raises:
        CheckpointError: another model (``check_same_model``), another sync algorithm, another
            plan shape (devices, replicas, parameter or buffer count), another outer optimizer.
        PlanError: the saved batch size does not fit this plan's memory budget."""
    check_same_model(plan, sd)
    _check_same_sync(plan, sd)
    _check_same_optimizer(plan, sd)
    if plan.autotuner is not None and sd["replicas_per_device"] != plan.settings.replicas_per_device:
        # the tuner had changed m: continue from there
        plan.adjust(Adjustment(replicas_per_device=sd["replicas_per_device"]))
    plan.rounds.flush()  # the copies below come after the streams' work so far
    have = (len(plan.devices), plan.settings.replicas_per_device, plan.num_parameters, plan.states[0].buf.shape[1])
    want = (len(sd["devices"]), sd["replicas_per_device"], sd["num_parameters"], sd["num_float_buffers"])
    if have != want:
        raise CheckpointError(
            f"the checkpoint is of a plan with {want[0]} device(s) × {want[1]} replica(s), "
            f"{want[2]:,} parameters and {want[3]:,} float buffer scalars, but this plan has "
            f"{have[0]} × {have[1]}, {have[2]:,} and {have[3]:,}; compile the same model with the "
            "same devices and replicas to resume, or use another checkpoint_dir to start afresh"
        )
    choice = SettingsChoice(setup, sd.get("setup"))
    restore_settings(plan, sd, choice)
    _load_outer(plan, sd.get("outer_optimizer"))
    restore_outer_settings(plan, choice)
    for s, saved in zip(plan.states, sd["states"]):
        for key in ("w", "v", "z", "z_prev"):  # saved in the standard order
            getattr(s, key).copy_(s.params.from_standard(saved[key]))
        for key in ("buf", "zbuf"):
            getattr(s, key).copy_(saved[key])
        s.first_step = list(saved["first_step"])
        if s.optim_rows is not None and saved.get("optimizer_rows") is not None:
            try:
                s.optim_rows.load_state_dict(saved["optimizer_rows"])
            except ValueError as exc:
                raise CheckpointError(f"{exc}; resume with the optimizer the checkpoint was "
                                      f"written with") from None
        if s.loss_scales is not None and saved.get("loss_scales") is not None:
            s.loss_scales.scale.copy_(saved["loss_scales"][0])
            s.loss_scales.good.copy_(saved["loss_scales"][1])
        for r, ints in zip(s.replicas, saved["int_buffers"]):
            named = dict(r.named_buffers())
            for n, value in ints.items():
                named[n].copy_(value)
    plan.rounds.load_state_dict({"faults": [FaultEvent(**e) for e in sd["faults"]],
                                 "fault_tolerance": sd.get("fault_tolerance"),
                                 "cpu_conv_choices": sd.get("cpu_conv_choices", {})})
    SMALRRule.load_state_dict(plan, sd.get("lr_rule"))
    plan.progress.load_state_dict(sd, device=plan.states[0].torch_device)
    choice.warn(source)


def _check_same_sync(plan: "FitPlan", sd: dict[str, Any]) -> None:
    """CheckpointError unless saved with the plan's sync algorithm class (a state without
    ``sync`` is accepted: ``_load_outer`` compares the outer optimizers)."""
    mine = type(plan.settings.sync).__name__
    theirs = sd.get("sync", mine)
    if theirs != mine:
        raise CheckpointError(
            f"the checkpoint was written with sync={theirs}(...), but this plan's is sync={mine}(...); "
            f"compile with sync={theirs}(...) to resume, or use another checkpoint_dir to start afresh")


def _check_same_optimizer(plan: "FitPlan", sd: dict[str, Any]) -> None:
    """CheckpointError unless saved with the plan's optimizer class, groups and row state."""
    if "optimizer" not in sd:
        return
    mine = plan.settings.optimizer.describe()["class"]
    theirs, groups = sd["optimizer"]["class"], len(sd["optimizer"]["groups"])
    rows = [saved.get("optimizer_rows") is not None for saved in sd["states"]]
    if theirs != mine or groups != len(plan.settings.optimizer.optimizer.param_groups) or \
            any(r != (s.optim_rows is not None) for r, s in zip(rows, plan.states)):
        raise CheckpointError(
            f"the checkpoint was written with optimizer {theirs} ({groups} param group(s)), but "
            f"this plan's is {mine} ({len(plan.settings.optimizer.optimizer.param_groups)}); compile with the same "
            f"optimizer to resume, or use another checkpoint_dir to start afresh")


def _outer_layout(plan: "FitPlan", sd: dict[str, Any],
                  convert: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """The outer optimizer's ``state_dict`` with its ``[P]`` tensors converted by ``convert``."""
    P = plan.num_parameters
    state = {i: {k: convert(t) if isinstance(t, torch.Tensor) and t.shape == (P,) else t
                 for k, t in per_param.items()} for i, per_param in sd["state"].items()}
    return {**sd, "state": state}


def _sync_state_entry(plan: "FitPlan") -> dict[str, Any] | None:
    """The sync algorithm's runtime state as the ``"outer_optimizer"`` entry, or None."""
    state = plan.rounds.sync_state
    if state.state_class is None:
        return None
    return {"class": state.state_class,
            "state": _outer_layout(plan, state.state_dict(), plan.states[0].params.to_standard)}


def _load_outer(plan: "FitPlan", saved: dict[str, Any] | None) -> None:
    """The sync algorithm's runtime state from the ``"outer_optimizer"`` entry (CheckpointError
    when only one side has such state, or of another class)."""
    state = plan.rounds.sync_state
    mine = state.state_class
    theirs = None if saved is None else saved["class"]
    if mine != theirs:
        def say(c):
            return "no outer optimizer" if c is None else f"outer optimizer {c}"
        raise CheckpointError(f"the checkpoint was written with {say(theirs)} (the state of its "
                              f"sync algorithm), but this plan has {say(mine)} "
                              f"(sync={type(plan.settings.sync).__name__}); compile with the same sync to "
                              "resume, or use another checkpoint_dir to start afresh")
    if mine is not None:
        try:
            state.load_state_dict(_outer_layout(plan, saved["state"],
                                                plan.states[0].params.from_standard))
        except ValueError as exc:
            raise CheckpointError(f"the checkpoint's outer optimizer state does not fit this "
                                  f"plan's: {exc}") from None


# -- random number generators ------------------------------------------------------------------

def _rng_state() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": [version, list(mt), gauss],
        "numpy": [np_kind, torch.from_numpy(np_keys.astype(np.int64)), int(np_pos),
                  int(np_has_gauss), float(np_cached)],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


# -- the hook --------------------------------------------------------------------------------

def _data_key(schedule: "BatchSchedule") -> dict[str, Any]:
    # neither k nor b is part of it: the epoch's order depends on N, shuffle and seed only, the
    # position in it is saved in samples, and both may change during a fit (the auto-tuner, a
    # policy); the plan's b and shape, m included, are restored or checked when it is loaded
    return {"num_samples": schedule.num_samples, "shuffle": schedule.shuffle,
            "seed": schedule.seed}


def _hook_keys(hooks: list[Hook]) -> list[str]:
    """Each hook's key in a checkpoint: its class name and its place among the fit's hooks of
    that class ("LRSchedulerHook#0"), so that a hook added or left out at a resume (a user's own)
    does not move the others' keys."""
    return _numbered([type(hook).__name__ for hook in hooks])


def _numbered(names: list[str]) -> list[str]:
    """``name#i``, i the name's place among the equal names before it."""
    seen: dict[str, int] = {}
    keys = []
    for name in names:
        keys.append(f"{name}#{seen.get(name, 0)}")
        seen[name] = seen.get(name, 0) + 1
    return keys


def _by_class(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's hook states keyed as ``_hook_keys`` does; older checkpoints keyed them by
    position ("1:LRSchedulerHook"), read here in their order."""
    if not any(":" in key and key.split(":", 1)[0].isdigit() for key in saved):
        return saved
    ordered = sorted(saved, key=lambda k: int(k.split(":", 1)[0]))
    return dict(zip(_numbered([key.split(":", 1)[1] for key in ordered]),
                    (saved[key] for key in ordered)))


def _history_from(d: dict[str, Any], into: History) -> None:

    into.epochs = [EpochRecord(**e) for e in d["epochs"]]
    into.evals = [EvalRecord(**e) for e in d["evals"]]
    into.faults = [FaultEvent(**e) for e in d["faults"]]
    into.metrics = [MetricRecord(**m) for m in d.get("metrics", [])]
    into.policy = [PolicyRecord(**p) for p in d.get("policy", [])]
    into.lr = list(d.get("lr", []))
    into.lr_rule = [LRRuleRecord(**rec) for rec in d.get("lr_rule", [])]
    into.time_to_accuracy_s, into.epochs_to_accuracy = d["time_to_accuracy_s"], d["epochs_to_accuracy"]
    into.time_to_loss_s, into.epochs_to_loss = d.get("time_to_loss_s"), d.get("epochs_to_loss")
    into.samples_to_loss = d.get("samples_to_loss")
    into.cpu_threads = int(d.get("cpu_threads", 0))  # the threads the checkpoint's fit ran with


class CheckpointHook(Hook):
    """Saves a checkpoint every ``every_rounds`` rounds and at the end of every complete epoch
    (docs/reliability.md, Checkpoints; under torchrun docs/distributed.md).

    Args:
        directory: where ``ckpt-*.pt`` files go (created if missing).
        schedule: the fit's BatchSchedule (its N, shuffle and seed are saved and checked).
        hooks: the fit's other hooks; their ``state_dict()`` is saved (but an empty one).
        every_rounds: rounds between checkpoints (≥ 1); None: only at epoch ends.
        keep: checkpoints kept (≥ 2).
        writer: this process writes and reads the files (rank 0, or a single process).

    Raises:
        ValueError: ``every_rounds`` < 1, ``keep`` < 2, or ``directory`` cannot be created or
            written (a probe file is written at once)."""

    decides = False  # it saves and restores; it changes no setting

    def __init__(self, directory: str, schedule: "BatchSchedule", hooks: Sequence[Hook] = (), *,
                 every_rounds: int | None = None, keep: int = 2, writer: bool = True) -> None:
        if every_rounds is not None and (isinstance(every_rounds, bool) or
                                         not isinstance(every_rounds, int) or every_rounds < 1):
            raise ValueError(f"checkpoint_every={every_rounds!r}: must be a number of rounds ≥ 1 "
                             "(or None for a checkpoint at the end of every epoch)")
        if keep < 2:
            raise ValueError(f"keep={keep}: keep at least 2 checkpoints so that a corrupt newest "
                             "one has a fallback")
        self.directory, self.schedule, self.hooks = directory, schedule, list(hooks)
        self.every_rounds, self.keep, self.writer = every_rounds, keep, writer
        self.health = CheckpointHealth()  # which checkpoint a resume after divergence takes
        self._last_saved = -1
        if writer:
            check_writable_dir("checkpoint_dir", directory)

    def claim(self, plan: "FitPlan", resume: bool) -> DirectoryLock | None:
        """Take the directory for this fit (docs/reliability.md, One fit per directory);
        returns the writer's lock (the caller releases it), None on the other ranks.

        Raises:
            CheckpointError: another fit holds the directory, or ``resume=False`` where it holds
                another run's checkpoints."""
        if not self.writer:
            return None
        lock = DirectoryLock(self.directory).acquire()
        files = list_checkpoints(self.directory)
        if not resume and files and not plan.run_record.owns(files[-1]):
            lock.release()
            raise CheckpointError(
                f"checkpoint_dir={self.directory!r} holds {len(files)} checkpoint(s) of another "
                f"run (the newest {os.path.basename(files[-1])}) and resume=False: this fit's "
                "checkpoints would mix with them, and keeping the newest two by round would "
                "delete this fit's or resume the other run's. Pass resume=True to continue that "
                "run, another checkpoint_dir for a new one, or delete its ckpt-*.pt files to start "
                "afresh there")
        return lock

    def resume(self, plan: "FitPlan", history: History) -> str | None:
        """Load the newest good checkpoint into the plan, the hooks, the RNGs and ``history``
        (under torchrun on every rank, on any number of ranks: training/reshard.py); returns its path,
        or None when there is none.

        Raises:
            CheckpointError: no checkpoint can be read, or the newest good one is of another model,
                plan shape or data order (refused, never skipped).
            PlanError: the checkpoint's batch size does not fit the memory budget."""
        comm = plan.comm
        world = 1 if comm is None else comm.world_size
        parts, state, problem = [None] * world, None, None
        if self.writer:
            try:
                found = self._read(plan)
            except CheckpointError as exc:
                if comm is None:
                    raise
                found, problem = None, exc
                parts = [("error", str(exc))] * world
            if found is not None:
                path, state = found
                parts = [(path, sd, rng) for sd, rng in split_for_ranks(state, world)]
        mine = parts[0] if comm is None else comm.scatter_object(
            parts if self.writer else None, "the resume from rank 0's checkpoint", -1)
        if problem is not None:
            raise problem
        if mine is None:
            return None
        if mine[0] == "error":
            raise CheckpointError(f"rank 0 could not resume: {mine[1]}")
        path, sd, rng = mine
        load_plan_state_dict(plan, sd, plan.run_record.setup, f"checkpoint {path}")
        if rng is not None:
            _set_rng_state(rng)
        else:  # a rank the checkpoint did not have: its own stream from this round on
            seed_host_rngs(self.schedule.seed, plan.progress.rounds_done, comm.rank, 0)
        self._last_saved = plan.progress.rounds_done
        if self.writer:
            plan.run_record.saw(path)
            self._restore_hooks_and_history(state, history)
            _log_resume(path, plan, state, world)
        return path

    def _read(self, plan: "FitPlan") -> tuple[str, dict[str, Any]] | None:
        """The newest good checkpoint ``(path, state)``, checked, or None."""
        found = load_latest(self.directory)
        if found is None:
            return None
        path, state = found
        if state.get("format") != _FORMAT:
            raise CheckpointError(f"checkpoint {path} has format {state.get('format')}, this "
                                  f"version reads format {_FORMAT}")
        check_same_model(plan, state["plan"], f"checkpoint {path}")
        want, have = state["data"], _data_key(self.schedule)
        if want != have:
            diff = ", ".join(f"{k}={want[k]!r} (now {have[k]!r})" for k in want if want[k] != have[k])
            raise CheckpointError(
                f"checkpoint {path} was written for another data order: {diff}; resume with the "
                "same dataset, shuffle and seed"
            )
        return path, state

    def _restore_hooks_and_history(self, state: dict[str, Any], history: History) -> None:
        saved = _by_class(state["hooks"])
        for key, hook in zip(_hook_keys(self.hooks), self.hooks):
            if key in saved:
                hook.load_state_dict(saved[key])
        _history_from(state["history"], history)
        self.health.load_state_dict(state.get("health"))

    def save(self, ctx: FitContext) -> str | None:
        """Write a checkpoint (a collective under torchrun); returns its path (None off rank 0)."""
        plan, comm = ctx.plan, ctx.plan.comm
        peers: list[Any] = []
        if comm is not None:
            sd = None if self.writer else plan_state_dict(plan)
            mine = None if self.writer else {"states": sd["states"], "losses": sd["losses"],
                                             "cpu_conv_choices": sd["cpu_conv_choices"],
                                             "rng": _rng_state()}
            gathered = comm.gather_object(mine, "the gather of every rank's learners for a "
                                          "checkpoint", plan.progress.rounds_done - 1)
            peers = gathered[1:] if self.writer else []
        self._last_saved = plan.progress.rounds_done
        if not self.writer:
            return None
        plan_state = plan_state_dict(plan)
        plan_state["train_seconds"] = ctx.train_seconds  # includes the unfinished epoch's rounds
        path = checkpoint_path(self.directory, plan.progress.rounds_done)
        self.health.judge(os.path.basename(path))
        state = {
            "format": _FORMAT,
            "plan": plan_state,
            "data": _data_key(self.schedule),
            "rng": _rng_state(),
            "hooks": {key: kept for key, h in zip(_hook_keys(self.hooks), self.hooks)
                      if (kept := h.state_dict())},  # {}: a hook without state
            "history": ctx.history.to_dict(),
            "world_size": 1 if comm is None else comm.world_size,
            "peers": peers,  # ranks 1 … R−1: {"states": [...], "losses": [n], "rng": {...}}
            "health": self.health.state_dict(),  # training/checkpoint_health.py
        }
        save_checkpoint(path, state)
        plan.run_record.saw(path)
        prune_checkpoints(self.directory, self.keep, spare=self.health.healthy)
        self.health.kept([os.path.basename(p) for p in list_checkpoints(self.directory)])
        return path

    def set_aside_unhealthy(self) -> str:
        """At a DivergenceError (the writer): the checkpoints newer than the newest healthy one
        renamed ``….pt.diverged`` (training/checkpoint_health.py); returns what a resume now
        does, for the error's message ("" off rank 0, or without a checkpoint of this run)."""
        return self.health.set_aside(self.directory) if self.writer else ""

    def save_if_new(self, ctx: FitContext) -> str | None:
        """``save`` unless the last checkpoint saved or resumed is of this state; the file."""
        if self._last_saved != ctx.plan.progress.rounds_done:
            return self.save(ctx)
        return checkpoint_path(self.directory, ctx.plan.progress.rounds_done) if self.writer else None

    def before_fit(self, ctx: FitContext) -> None:
        if self.writer:
            remove_temporaries(self.directory)  # the remains of a write that was killed

    def after_round(self, ctx: FitContext) -> None:
        if self.writer and ctx.round_loss is not None:
            self.health.see_round(ctx.round_loss)  # on the device; read at the next checkpoint

    def save_if_due(self, ctx: FitContext) -> None:
        """The round's checkpoint every ``every_rounds`` rounds; the Trainer calls it once the
        round's hooks and its evaluation (with the hooks' after_eval) have run, so that a resume
        continues after both."""
        if self.every_rounds is not None and ctx.plan.progress.rounds_done % self.every_rounds == 0:
            self.save(ctx)

    def after_epoch(self, ctx: FitContext, record: EpochRecord) -> None:
        if ctx.epoch_complete and self._last_saved != ctx.plan.progress.rounds_done:
            self.save(ctx)


def _log_resume(path: str, plan: "FitPlan", state: dict[str, Any], world: int) -> None:
    """The resume's log line; a warning saying how k changes when the number of ranks does."""
    log.info("resumed from %s: epoch %d, round %d of it (%d rounds done)", path,
             plan.progress.epochs_done, plan.progress.round_in_epoch, plan.progress.rounds_done)
    saved = saved_world_size(state)
    if saved == world:
        return
    k_old, k_new, b = saved_learners(state), plan.num_learners, plan.settings.batch_size
    log.warning(
        "checkpoint %s was written by %d process(es) with k = %d learners and resumes on %d "
        "with k = %d: learners 0…%d continue from it, %d new one(s) start from z with zero "
        "momentum, %d are dropped; α = %s; epoch %d continues at sample %d of its order with "
        "%d samples per round", path, saved, k_old, world, k_new, min(k_old, k_new) - 1,
        max(k_new - k_old, 0), max(k_old - k_new, 0),
        f"{plan.settings.alpha_for(k_new):.6g}" if k_new > 1 else "— (one learner: z follows it)",
        plan.progress.epochs_done + 1, plan.progress.position_in_epoch, k_new * b)
