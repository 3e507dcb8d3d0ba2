"""The run settings (engine/settings.py): one object holds η, b, α, τ, m and the learner mode,
every reader sees it, only the adjustment interface (``Plan.adjust`` → ``apply_adjustment``)
changes it, and checkpoints restore it through the same interface."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import crossbow_graph as cg
from crossbow_graph.compiler.tasks import TaskKind
from crossbow_graph.training.hooks import Hook
from crossbow_graph.tuning.metrics import MetricsMonitor
from crossbow_graph.tuning.policies import Adjustment, Policy
from _plans import TinyBN, make_plan, tiny_data
from _reference import default_alpha

CHANGES = dict(lr=0.02, batch_size=8, alpha=0.3, sync_every=2, replicas_per_device=2,
               learner_mode="fused")
AFTER_ROUND = 2  # rounds 1-2: k = 2 × 1, b = 4 (16 samples); rounds 3-6: k = 2 × 2, b = 8 (128)
N = 2 * 1 * 4 * 2 + 2 * 2 * 8 * 4


class ChangeEverything(Policy):
    """Changes every run setting once, after round ``AFTER_ROUND``."""

    def after_round(self, ctx):
        if ctx.plan.rounds_done == AFTER_ROUND:
            self.adjust(ctx, reason="test", **CHANGES)


class StopAfter(Hook):
    def __init__(self, n: int) -> None:
        self.n = n

    def after_round(self, ctx) -> None:
        ctx.stop = ctx.plan.rounds_done >= self.n


def _plan(**kw) -> cg.Plan:
    return make_plan(TinyBN, devices=2, executor="inline", **{"replicas": 1, **kw})


def _fit(plan, **kw) -> cg.History:
    return plan.fit(tiny_data(N), 1, shuffle=True, seed=5, progress=False,
                    policies=[ChangeEverything()], metrics_every=MetricsMonitor(2, measure_rounds=1),
                    **kw)


def _readers(plan: cg.Plan) -> dict[str, dict]:
    """η, b, α, τ, m and the learner mode as each reader of the plan sees them."""
    s, env, graph = plan.settings, plan.rounds.round_env(0, None, True), plan.task_graph
    learn_tasks = sum(1 for _, t in graph.nodes(data="task") if t.kind is TaskKind.LEARN)
    return {
        "settings": dict(lr=s.lr, batch_size=s.batch_size, alpha=s.alpha, sync_every=s.sync_every,
                         replicas_per_device=s.replicas_per_device, learner_mode=s.learner_mode),
        "plan": dict(lr=plan.optimizer.param_groups[0]["lr"], batch_size=plan.batch_size, alpha=plan.sync.alpha,
                     sync_every=plan.sync.sync_every, replicas_per_device=plan.replicas_per_device,
                     learner_mode=plan.learner_mode),
        "a round": dict(lr=env.hyper.lr, batch_size=env.b, alpha=env.sync.alpha,
                        sync_every=env.sync.sync_every, learner_mode=env.learner_mode),
        "task graph": dict(batch_size=graph.graph["batch_size"],
                           replicas_per_device=graph.graph["replicas_per_device"]),
        "its learn tasks": dict(replicas_per_device=learn_tasks / len(plan.devices)),
        **{f"device {d}": dict(replicas_per_device=st.m) for d, st in enumerate(plan.states)},
    }


def _assert_agree(plan: cg.Plan, want: dict) -> None:
    """Every reader sees ``want``; a round's η is the lr × SMA's η factor in force (1 before a
    fit; docs/design-overview.md §2)."""
    factor = plan.settings.optimizer.lr_factor
    wrong = {reader: {k: v for k, v in seen.items()
                      if v != (want[k] * factor if (reader, k) == ("a round", "lr") else want[k])}
             for reader, seen in _readers(plan).items()}
    assert not any(wrong.values()), wrong
    default = default_alpha(plan.num_learners, plan.sync.central_momentum)
    assert plan.rounds.round_env(0, None, True).alpha == pytest.approx(
        default if want["alpha"] is None else want["alpha"], rel=1e-12)  # in use


def test_every_reader_sees_the_policys_settings_and_a_resume_restores_them(tmp_path):
    """A policy changes η, b, α, τ, m and the learner mode after round 2: the plan's settings,
    its read-only views, the scheduler's, every fused program's b, the re-planned task graph, the
    replicas and the metrics agree; a fit stopped after round 4 and resumed on a plan compiled
    with the original settings (m = 2: a plan's m must match) continues with all of them, bit for
    bit as the uninterrupted fit."""
    full = _plan()
    h = _fit(full)
    _assert_agree(full, CHANGES)
    assert full.rounds_done == 6 and [p.changes for p in h.policy] == [CHANGES]
    last = h.metrics[-1]
    assert (last.lr, last.batch_size, last.alpha, last.sync_every, last.replicas_per_device) == \
        (0.02, 8, 0.3, 2, 2)

    ckpt = str(tmp_path / "ckpt")
    first = _plan()
    _fit(first, hooks=[StopAfter(4)], checkpoint_dir=ckpt, checkpoint_every=1)
    _assert_agree(first, CHANGES)
    loaded = _plan(replicas=2)
    loaded.load_state_dict(first.state_dict())
    _assert_agree(loaded, CHANGES)

    second = _plan(replicas=2)
    _assert_agree(second, dict(lr=0.05, batch_size=4, alpha=None, sync_every=1,
                               replicas_per_device=2, learner_mode="per_replica"))
    _fit(second, hooks=[StopAfter(10**6)], checkpoint_dir=ckpt, checkpoint_every=1, resume=True)
    _assert_agree(second, CHANGES)
    assert second.rounds_done == 6
    for a, b in zip(full.states, second.states):
        for key in ("z", "z_prev", "w", "v", "buf", "zbuf"):
            assert torch.equal(getattr(a, key), getattr(b, key)), key


def test_the_views_of_the_settings_are_read_only_and_name_the_interface():
    plan = _plan()
    for owner, name in ((plan, "batch_size"), (plan, "sync"), (plan, "learner_mode"),
                        (plan, "replicas_per_device")):
        with pytest.raises(AttributeError, match=r"read-only.*plan\.adjust\(crossbow_graph\.Adjustment"):
            setattr(owner, name, getattr(owner, name))
    assert plan.adjust(Adjustment(learner_mode="fused")) == {"learner_mode": "fused"}
    assert plan.adjust(Adjustment(learner_mode="fused")) == {}  # unchanged: no change
    with pytest.raises(ValueError, match="Adjustment\\(learner_mode='vmap'\\): use one of"):
        Adjustment(learner_mode="vmap")


SETTINGS = {"lr", "batch_size", "alpha", "sync_every", "replicas_per_device", "learner_mode",
            "sync", "optimizer"}
HOLDERS = {"plan", "sched", "scheduler", "rounds", "settings"}  # names under which the settings' holders go
OWNER = "engine/adjust.py"  # apply_adjustment


def _holder(node: ast.expr) -> str | None:
    """The last name of an assignment's receiver: ``plan`` in ``ctx.plan.sync``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def test_only_the_adjustment_interface_assigns_the_run_settings():
    """No module but engine/adjust.py assigns η, b, α, τ, m, the learner mode, the sync or
    optimizer settings on the plan, the scheduler or the settings (``x.plan.lr = ...``,
    ``sched.sync = ...``): every change goes through ``Plan.adjust``."""
    package = Path(cg.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).as_posix() == OWNER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            for t in flat:
                if isinstance(t, ast.Attribute) and t.attr in SETTINGS and _holder(t.value) in HOLDERS:
                    found.append(f"{path.relative_to(package)}:{t.lineno} {ast.unparse(t)}")
    assert found == []
