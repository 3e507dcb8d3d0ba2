"""Each learner's local optimiser: any torch.optim optimizer, run by the SGD kernels or as row
optimizers over the flat layout; the SMA correction c_j = α·(ŵ_j − z) from the pre-step weights
(docs/optimizers.md, "What runs", "Which implementation"; docs/design-overview.md §2, step 1)."""

from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch
from torch import nn

from ...config import SGD

__all__ = ["LocalOptimizer", "OptimizerRows", "KernelSGD", "ELEMENTWISE", "SHARED_SECOND_MOMENT",
           "as_local_optimizer", "shared_adam_step"]

# exact classes whose update of a tensor reads only that tensor, its gradient and its own state
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
               torch.optim.Adagrad, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
               torch.optim.Adadelta, torch.optim.Rprop, torch.optim.ASGD)
# exact classes with torch.optim's fused CPU and CUDA kernels (``fused=True``), which the row
# optimizers use for one replica's (dense) row where the user left ``fused`` and ``foreach``
# unset: one kernel per tensor, about 3× faster than the single-tensor loop for LeNet-5's AdamW
# (bench/optim_rows.py)
FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
# exact classes whose learners may share one second moment (SMA's ``share_second_moment``)
SHARED_SECOND_MOMENT = (torch.optim.Adam, torch.optim.AdamW)
_REFUSED = {
    torch.optim.LBFGS: "LBFGS re-evaluates the model through a closure at every step, which a "
                       "replica's local step cannot do; use Adam/AdamW or SGD",
    torch.optim.SparseAdam: "SparseAdam needs sparse gradients, and replicas' gradients are dense "
                            "rows of one buffer; use Adam",
}


class KernelSGD(NamedTuple):
    """The SGD settings the fused SMA kernels take (kernels/protocol.py ``local_update``)."""

    lr: float
    momentum: float
    nesterov: bool
    weight_decay: float


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _hyper_keys(defaults: dict[str, Any]) -> tuple[str, ...]:
    """The keys of a group that an LR scheduler may change: numbers and tuples of numbers."""
    keys = []
    for k, v in defaults.items():
        if _is_number(v) or (isinstance(v, tuple) and v and all(_is_number(x) for x in v)):
            keys.append(k)
    return tuple(sorted(keys))


@dataclass(eq=False)
class LocalOptimizer:
    """The plan's local optimiser: the user's torch.optim optimizer and where its groups live.

    Attributes:
        optimizer: the ``torch.optim.Optimizer`` (never stepped; its ``param_groups`` hold the
            hyper-parameters in force, what an LR scheduler over it changes).
        groups: per param group, the indices of its parameters in the flat layout's entries.
        hyper_keys: the numeric keys of a group (``lr``, ``momentum``, ``betas``, ...), those a
            scheduler may change: what a round's ``Hyper`` snapshot holds.
        kernel: the fused SGD kernels run it (one-group ``torch.optim.SGD`` without dampening).
        stacked: an elementwise optimizer: one instance over a device's rows of the same age
            (not where a group sets ``fused=True``: torch's fused kernels take dense tensors only).
        lr_factor: the factor of SMA's η rule in force (training/sma_lr.py; 1: none): a round
            steps every group at its lr × this, the groups' lr untouched (the user's η₁)."""

    optimizer: torch.optim.Optimizer
    groups: tuple[tuple[int, ...], ...]
    hyper_keys: tuple[str, ...]
    kernel: bool
    stacked: bool
    lr_factor: float = 1.0

    @property
    def lr(self) -> float:
        """η: the first param group's learning rate in force."""
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def round_lr(self) -> float:
        """The η a round steps with: ``lr`` × ``lr_factor`` (``round_hyper`` of the first group)."""
        return float(self.round_hyper(self.optimizer.param_groups[0], "lr"))

    def sgd(self) -> KernelSGD:
        """The first group as the SGD kernels take it (``kernel`` optimizers; the lr as set: a
        round's η is its ``Hyper`` snapshot's)."""
        g = self.optimizer.param_groups[0]
        return KernelSGD(float(g["lr"]), float(g.get("momentum", 0.0)),
                         bool(g.get("nesterov", False)), float(g.get("weight_decay", 0.0)))

    def round_hyper(self, group: dict[str, Any], key: str) -> Any:
        """``group[key]`` as a round steps with it (the lr times ``lr_factor``)."""
        if key != "lr" or self.lr_factor == 1.0:
            return group[key]
        return float(group[key]) * self.lr_factor

    def describe(self) -> dict[str, Any]:
        """The class and every group's settings (no tensors): for summaries, the torchrun
        agreement and checkpoints."""
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                   if k != "params" and (v is None or isinstance(v, (bool, int, float, str, tuple)))}
                  for g in self.optimizer.param_groups]
        return {"class": f"{type(self.optimizer).__module__}.{type(self.optimizer).__qualname__}",
                "kernel": self.kernel, "stacked": self.stacked,
                "groups": [dict(g, params=len(ix)) for g, ix in zip(groups, self.groups)]}

    def group_settings(self) -> list[dict[str, Any]]:
        """Every group's settings but its parameters (``describe()['groups']`` without counts)."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]


def _model_param_index(model: nn.Module, names: list[str]) -> dict[int, int]:
    """id(parameter) of ``model`` → its index in the flat layout's entries (by name)."""
    index = {n: i for i, n in enumerate(names)}
    out: dict[int, int] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if n in index:
            out.setdefault(id(p), index[n])
    return out


def as_local_optimizer(optimizer: Any, model: nn.Module, template: nn.Module,
                       names: list[str]) -> LocalOptimizer:
    """Check the user's ``optimizer`` against ``model`` and map its groups to the flat layout.

    Args:
        optimizer: a ``torch.optim.Optimizer`` built over ``model``'s parameters (a subset is
            allowed: parameters in no group are not stepped, as in eager PyTorch; frozen ones,
            ``requires_grad=False``, are skipped, as torch.optim skips them); or
            ``config.SGD``, built here as a one-group ``torch.optim.SGD`` over ``template``'s
            trainable parameters.
        model: the model given to ``compile``.
        template: the plan's copy of it (the same parameter names).
        names: the flat layout's parameter names (trainable ones, tied once).

    Raises:
        TypeError: not a torch.optim optimizer; an optimizer class that cannot be replicated
            (LBFGS, SparseAdam: the message says why and what to use); a group setting given
            as a tensor (``lr=torch.tensor(1e-3)``).
        ValueError: a group holds a tensor that is not a trainable parameter of ``model``, or a
            parameter twice."""
    if isinstance(optimizer, SGD):
        params = [p for p in template.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=optimizer.lr, momentum=optimizer.momentum,
                                    nesterov=optimizer.nesterov,
                                    weight_decay=optimizer.weight_decay)
        model = template
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim optimizer built over the model's "
                        f"parameters, e.g. torch.optim.AdamW(model.parameters(), lr=1e-3), or "
                        f"crossbow_graph.SGD(lr=...); got {type(optimizer).__name__}")
    for cls, why in _REFUSED.items():
        if isinstance(optimizer, cls):
            raise TypeError(f"optimizer={type(optimizer).__name__}: cannot run one per replica: {why}")
    _refuse_tensor_settings(optimizer)
    groups = _group_rows(optimizer, model, names)  # raises ValueError
    g0 = optimizer.param_groups[0]
    kernel = (type(optimizer) is torch.optim.SGD and len(optimizer.param_groups) == 1
              and len(groups[0]) == len(names) and g0.get("dampening", 0) == 0
              and not g0.get("maximize", False) and not g0.get("differentiable", False))
    # torch's fused kernels write a strided view as if it were contiguous (outside the view):
    # the user's fused=True runs one instance per replica's dense row
    asks_fused = any(g.get("fused") for g in optimizer.param_groups)
    return LocalOptimizer(optimizer=optimizer, groups=tuple(groups),
                          hyper_keys=_hyper_keys(optimizer.defaults), kernel=kernel,
                          stacked=type(optimizer) in ELEMENTWISE and not asks_fused)


def _refuse_tensor_settings(optimizer: torch.optim.Optimizer) -> None:
    """TypeError for a group setting given as a tensor (``lr=torch.tensor(1e-3)``, tensor betas):
    a round steps with a snapshot of the settings as numbers (``Hyper``), SMA's η rule scaling
    the lr."""
    for i, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            parts = value if isinstance(value, tuple) else (value,)
            if key != "params" and any(isinstance(v, torch.Tensor) for v in parts):
                number = ", ".join(f"{float(torch.as_tensor(v).detach()):g}" for v in parts)
                number = f"({number})" if isinstance(value, tuple) else number
                fix = (f"torch.optim.{type(optimizer).__name__}(model.parameters(), {key}={number})"
                       if len(optimizer.param_groups) == 1 else
                       f"param group {i}'s \"{key}\": {number} in its dict")
                raise TypeError(
                    f"optimizer param group {i} holds {key} as a tensor: the learners step with "
                    f"the groups' settings as numbers, read every round (SMA's η rule scales the "
                    f"lr); give a number, e.g. {fix} (an LR scheduler built over the optimizer "
                    f"writes its own values there: give it numbers too)")


def _group_rows(optimizer: torch.optim.Optimizer, model: nn.Module,
                names: list[str]) -> list[tuple[int, ...]]:
    """Per param group of ``optimizer``, the flat layout's indices of its parameters (frozen
    ones left out); ValueError for a tensor that is not a trainable parameter of ``model`` or a
    parameter twice."""
    where = _model_param_index(model, names)
    groups, seen = [], set()
    for gi, group in enumerate(optimizer.param_groups):
        ix = []
        for p in group["params"]:
            if id(p) not in where:
                if not p.requires_grad and any(q is p for q in model.parameters()):
                    continue  # a frozen parameter: never stepped, as in eager PyTorch
                raise ValueError(
                    f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} that is "
                    f"not a parameter of the model passed to compile; build the optimizer over "
                    f"that model's parameters, e.g. torch.optim.AdamW(model.parameters(), "
                    f"lr=1e-3), before compile")
            i = where[id(p)]
            if i in seen:
                raise ValueError(f"optimizer param group {gi}: parameter '{names[i]}' is in two "
                                 f"groups (or twice in one); torch.optim refuses that too")
            seen.add(i)
            ix.append(i)
        groups.append(tuple(ix))
    return groups


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` fills its memory without gaps, in some order of its dimensions (one row's
    view, channels-last or not; a stack of several rows is strided), as torch's fused optimizer
    kernels take it when its gradient and state have the same strides (``FlatLayout.zeros``)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class OptimizerRows:
    """One device's optimizer state per replica, and the step of a range of its rows.

    Args:
        local: the plan's LocalOptimizer (not ``kernel``).
        state: the device's DeviceState (its flat layout, ``w [m, P]`` and ``g [m, P]``).
        share_second_moment: a step of two or more rows runs ``shared_adam_step``.

    Attributes:
        store: per parameter (flat layout entry), state key → ``[m, *shape]`` (``[m]`` for
            scalar state), in the dtype torch.optim gives it (``step``: float32).
        shared: ``(entry index, key)`` of the state a stacked instance keeps as one scalar for
            all its rows (``step``), as against a 0-dim parameter's per-row state.
        age: ``[m]`` int64, steps since each replica's state was fresh (0: fresh); the host
            reads and writes it through a NumPy view, outside the streams (no tensor op).

    Raises:
        TypeError: the optimizer cannot be rebuilt as ``type(opt)(groups, **defaults)`` or
            keeps state that is not a tensor (found by one step on a scratch copy)."""

    def __init__(self, local: LocalOptimizer, state: Any, share_second_moment: bool = False) -> None:
        self.local = local
        self.share_second_moment = share_second_moment
        self.layout = state.params
        self.entries = state.params.entries
        self._cache: dict[tuple, tuple[torch.optim.Optimizer, list]] = {}
        self._bound: set[tuple] = set()  # cache keys whose instance's state is bound to the store
        self._order = [i for ix in local.groups for i in ix]  # an instance's params → entries
        self._g32: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        self.shared: set[tuple[int, str]] = set()
        self.store = self._allocate(state)
        self._set_age(torch.zeros(state.m, dtype=torch.int64))

    def _set_age(self, age: torch.Tensor) -> None:
        """Adopt ``age [m]`` and its NumPy view ``_ages``, through which the rounds read and write it."""
        self.age, self._ages = age, age.numpy()

    # -- building instances ---------------------------------------------------------------------

    def _views(self, flat: torch.Tensor, a: int, b: int) -> list[torch.Tensor]:
        """Per entry, rows a … b−1 of ``flat`` as ``[n, *shape]`` (stacked) or row a as
        ``shape`` (one replica)."""
        rows = flat[a:b] if self.local.stacked else flat[a]
        return [self.layout.view(rows, entry) for entry in self.entries]

    def _build(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.optim.Optimizer:
        opt = self.local.optimizer
        for p, g in zip(params, grads):
            p.grad = g
        groups = [dict({k: v for k, v in group.items() if k != "params"},
                       params=[params[i] for i in ix])
                  for group, ix in zip(opt.param_groups, self.local.groups)]
        if type(opt) in FUSED and all(_dense(p) for p in params) and \
                all(g.get("fused") is None and g.get("foreach") is None for g in groups):
            for g in groups:  # the user left the implementation to torch: its fused kernels,
                # which take contiguous tensors only (one replica's row; stacked rows are strided)
                g["fused"] = True
        try:
            accepted = inspect.signature(type(opt).__init__).parameters
            kwargs = {k: v for k, v in opt.defaults.items() if k in accepted}
            inst = type(opt)(groups, **kwargs)
            inst.defaults = dict(opt.defaults)  # e.g. AdamW's decoupled_weight_decay, not an argument
            return inst
        except TypeError as exc:
            raise TypeError(f"optimizer {type(opt).__name__} cannot be rebuilt per replica as "
                            f"{type(opt).__name__}(param_groups, **optimizer.defaults): {exc}; give "
                            f"its __init__ the keyword arguments of its defaults") from None

    def _allocate(self, state: Any) -> list[dict[str, torch.Tensor]]:
        """One step on a scratch copy of replica 0 shows the state's keys, shapes and dtypes."""
        params = [t.clone() for t in self._views(state.w, 0, 1)]
        grads = [torch.zeros_like(t) for t in params]
        scratch = self._build(params, grads)
        with torch.no_grad():
            scratch.step()
        store: list[dict[str, torch.Tensor]] = [{} for _ in params]
        for i, p in enumerate(params):
            for key, t in scratch.state.get(p, {}).items():
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"optimizer {type(self.local.optimizer).__name__} keeps state "
                                    f"'{key}' as {type(t).__name__}; replicas' optimizer state "
                                    f"must be tensors")
                shape = t.shape[1:] if self.local.stacked and t.dim() else t.shape
                if self.local.stacked and not t.dim():
                    self.shared.add((i, key))
                store[i][key] = self._zeros(state.m, i, shape, t)
        return store

    def _zeros(self, m: int, i: int, shape: torch.Size, like: torch.Tensor) -> torch.Tensor:
        """Zeros ``[m, *shape]`` for entry i's state: laid out as the parameter's views when
        shaped as it (so that torch's fused kernels may walk both in memory order)."""
        if tuple(shape) == self.entries[i][1]:
            return self.layout.zeros((m,), self.entries[i], dtype=like.dtype, device=like.device)
        return torch.zeros(m, *shape, dtype=like.dtype, device=like.device)

    def _instance(self, state: Any, a: int, b: int) -> tuple[tuple, torch.optim.Optimizer, list]:
        """The instance of rows a … b−1 (built once per row range and buffers): (its cache key,
        it, its parameters in ``local.groups`` order)."""
        key = (a, b, state.w.data_ptr(), state.g.data_ptr())
        if key not in self._cache:
            grads = state.g if state.g.dtype == state.w.dtype else self._g32
            inst = self._build(self._views(state.w, a, b), self._views(grads, a, b))
            self._cache[key] = inst, [p for g in inst.param_groups for p in g["params"]]
        return (key, *self._cache[key])

    # -- the step -------------------------------------------------------------------------------

    def segments(self, r0: int, r1: int) -> list[tuple[int, int]]:
        """Rows r0 … r1−1 as runs of one instance: replicas of equal age (stacked), or single
        replicas."""
        if not self.local.stacked:
            return [(j, j + 1) for j in range(r0, r1)]
        ages = self._ages[r0:r1].tolist()
        runs, start = [], r0
        for j in range(r0 + 1, r1 + 1):
            if j == r1 or ages[j - r0] != ages[start - r0]:
                runs.append((start, j))
                start = j
        return runs

    @torch.no_grad()
    def step(self, state: Any, r0: int, r1: int, groups: Sequence[dict[str, Any]],
             faulty: list[int] | torch.Tensor = ()) -> None:
        """The optimizer's step of replicas r0 … r1−1 of ``state`` (weights ``w``, gradients
        ``g``), with the round's hyper-parameters ``groups`` (``Hyper.groups``: per param group,
        ``hyper_keys`` → value); ``faulty``: the rows found faulty this round (indices, or a mask
        ``[r1 − r0]``), whose zeroed gradients a shared second moment leaves out of its mean."""
        if state.g.dtype != state.w.dtype:  # low precision: the float32 copy the instances read
            if self._g32 is None or self._g32.shape != state.w.shape:
                self._g32 = torch.zeros_like(state.w)
                self._cache.clear()
                self._bound.clear()
            self._g32[r0:r1].copy_(state.g[r0:r1])
        if self.share_second_moment and r1 - r0 > 1:
            self._shared_step(state, r0, r1, groups, faulty)
            return
        for a, b in self.segments(r0, r1):
            key, inst, params = self._instance(state, a, b)
            for mine, theirs in zip(inst.param_groups, groups):
                for k in self.local.hyper_keys:
                    mine[k] = theirs[k]
            fresh = int(self._ages[a]) == 0
            if fresh:
                inst.state.clear()  # torch.optim's own initialisation at this step
            elif key not in self._bound:  # views of the store, which the steps update in place
                self._bind(inst, params, a, b)
                self._bound.add(key)
            inst.step()
            if fresh:
                self._adopt(inst, params, a, b)
                self._bound.add(key)
            elif self.local.stacked and b - a > 1:  # one scalar (step) stands for every row
                for i, key in self.shared:
                    t = self.store[i][key]
                    t[a + 1:b] = t[a]
            self._ages[a:b] += 1

    def _shared_step(self, state: Any, r0: int, r1: int, groups: Sequence[dict[str, Any]],
                     faulty: list[int] | torch.Tensor) -> None:
        """``shared_adam_step`` of rows r0 … r1−1; rows of age 0 from zero state."""
        grads = state.g if state.g.dtype == state.w.dtype else self._g32
        fresh = self._ages[r0:r1] == 0
        fresh = torch.from_numpy(fresh) if fresh.any() else None
        healthy = _healthy_rows(faulty, r1 - r0)
        opt = self.local.optimizer
        for group, hyper, ix in zip(opt.param_groups, groups, self.local.groups):
            decoupled = bool(group.get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW)))
            for i in ix:
                st = {key: t[r0:r1] for key, t in self.store[i].items()}
                if fresh is not None:
                    for t in st.values():
                        t[fresh] = 0
                shared_adam_step(self.layout.view(state.w[r0:r1], self.entries[i]),
                                 self.layout.view(grads[r0:r1], self.entries[i]),
                                 st["exp_avg"], st["exp_avg_sq"], st["step"],
                                 lr=float(hyper["lr"]), betas=hyper["betas"], eps=float(hyper["eps"]),
                                 weight_decay=float(hyper["weight_decay"]), decoupled=decoupled,
                                 healthy=healthy)
        self._ages[r0:r1] += 1

    def _bind(self, inst, params, a, b) -> None:
        stacked = self.local.stacked
        for p, i in zip(params, self._order):
            inst.state[p] = {key: (t[a] if ((i, key) in self.shared or not stacked) else t[a:b])
                             for key, t in self.store[i].items()}

    def _adopt(self, inst, params, a, b) -> None:
        """Copy a fresh step's state into the store and bind the instance to it."""
        for p, i in zip(params, self._order):
            for key, t in inst.state.get(p, {}).items():
                self.store[i][key][a:b].copy_(t)
        self._bind(inst, params, a, b)

    def scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A tensor shaped and typed as ``like`` (the corrections ``[n, P]``), kept between calls
        (this process's own)."""
        if self._scratch is None or self._scratch.shape != like.shape or \
                self._scratch.dtype != like.dtype or self._scratch.device != like.device:
            self._scratch = torch.empty_like(like)
        return self._scratch

    # -- replicas come and go -------------------------------------------------------------------

    def reset(self, rows: Sequence[int]) -> None:
        """Give replicas ``rows`` fresh state (torch.optim's initialisation at their next step)."""
        if len(rows):
            self._ages[list(rows)] = 0

    def resize(self, state: Any, keep: int, m: int) -> None:
        """Rows 0 … keep−1 keep their state; new rows up to m start fresh (DeviceState.resize)."""
        for i, per_param in enumerate(self.store):
            for key, t in per_param.items():
                new = self._zeros(m, i, t.shape[1:], t)
                new[:keep].copy_(t[:keep])
                per_param[key] = new
        age = torch.zeros(m, dtype=torch.int64)
        age[:keep] = self.age[:keep]
        self._set_age(age)
        self._cache.clear()
        self._bound.clear()
        self._g32 = None

    def share_memory(self) -> None:
        """Move the state and ages to shared memory (worker processes step their rows)."""
        for per_param in self.store:
            for t in per_param.values():
                t.share_memory_()
        self._set_age(self.age.share_memory_())
        self._cache.clear()
        self._bound.clear()

    def state_dict(self) -> dict[str, Any]:
        """``{"age": [m], "state": {"<index>/<key>": [m, ...]}}``, CPU copies."""
        return {"age": self.age.clone(),
                "state": {f"{i}/{k}": t.detach().cpu().clone()
                          for i, per_param in enumerate(self.store) for k, t in per_param.items()}}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore ``state_dict()`` in place (same keys and shapes).

        Raises:
            ValueError: other keys or shapes (another optimizer or model)."""
        mine = {f"{i}/{k}": t for i, per_param in enumerate(self.store) for k, t in per_param.items()}
        if set(mine) != set(saved["state"]) or saved["age"].shape != self.age.shape:
            raise ValueError("the saved optimizer state has other keys or replicas than this "
                             "plan's optimizer")
        for name, t in mine.items():
            t.copy_(saved["state"][name])
        self.age.copy_(saved["age"])


def _healthy_rows(faulty: list[int] | torch.Tensor, n: int) -> int | torch.Tensor | None:
    """How many of n rows are not ``faulty`` (at least 1; a mask's count stays on its device, no
    host read); None where none is faulty."""
    if isinstance(faulty, torch.Tensor):
        return (~faulty).sum().clamp_min(1)
    return max(n - len(faulty), 1) if faulty else None


@torch.no_grad()
def shared_adam_step(w: torch.Tensor, g: torch.Tensor, exp_avg: torch.Tensor,
                     exp_avg_sq: torch.Tensor, step: torch.Tensor, *, lr: float,
                     betas: tuple[float, float], eps: float, weight_decay: float,
                     decoupled: bool, healthy: int | torch.Tensor | None = None) -> None:
    """Adam's (``decoupled``: AdamW's) step of n learners' rows ``[n, *shape]`` in place, with one
    second moment from their mean gradient ḡ over ``healthy`` rows (≥ 1; None: all n; a faulty
    row's gradient is zero), floored at their mean square over n²; ``step [n]`` float32 (design
    §2, "One second moment per device")."""
    beta1, beta2 = float(betas[0]), float(betas[1])
    if weight_decay and not decoupled:
        g = g.add(w, alpha=weight_decay)
    step += 1
    if weight_decay and decoupled:
        w.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    n = g.shape[0] if healthy is None else healthy
    mean = g.sum(dim=0) / n
    # floor at 1/n of E[ḡ²]'s lower bound E[mean_j g_j²]/n: where the learners' gradients
    # cancel, ḡ² alone can be far below every g_j² (a step of g_j/|ḡ|)
    sq = torch.maximum(mean.square(), g.square().sum(dim=0) / (n * n * n))
    exp_avg_sq.mul_(beta2).add_(sq.expand_as(exp_avg_sq), alpha=1 - beta2)
    rows = (-1,) + (1,) * (w.dim() - 1)
    t = step.to(torch.float64)
    step_size = (lr / (1 - beta1 ** t)).to(w.device, w.dtype).view(rows)  # torch keeps step on
    root = (1 - beta2 ** t).sqrt().to(w.device, w.dtype).view(rows)  # the CPU unless capturable
    denom = (exp_avg_sq.sqrt() / root).add_(eps)
    w.sub_(exp_avg / denom * step_size)
