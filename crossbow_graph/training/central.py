"""The central average model z as a module: its buffers, BatchNorm re-estimation, evaluation
(docs/design-overview.md §2, BatchNorm; docs/distributed.md: the integer buffers under torchrun)."""

from __future__ import annotations

import copy
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..engine.state.flat import DeviceState, FlatLayout, copy_module
from .batchnorm import BNRecalibration
from .data import collate_of
from .evaluation import eval_samples, evaluate_model
from .validate import check_eval_dataset

if TYPE_CHECKING:
    from .fit_plan import FitPlan

__all__ = ["CentralModel", "start_from_rank0"]


class CentralModel:
    """The plan's evaluated copy of z: a copy of the template on the first device whose
    parameters are views of that device's z and whose float buffers are its own ``buf [Q]``.

    Attributes:
        module: that copy (evaluation mode).
        recalibration: its BatchNorm re-estimation (training/batchnorm.py), set by every fit.
        last_eval_extras: the last ``evaluate``'s ``Evaluation.extras``."""

    def __init__(self, plan: "FitPlan", params: FlatLayout) -> None:
        self._plan, self._params = plan, params
        first = plan.states[0]
        self.module = copy.deepcopy(plan.template).to(first.torch_device).eval()
        self._buf = first.zbuf.clone()  # [Q] the evaluated central model's float buffers
        first.bind_central(self.module, self._buf)
        self.recalibration = BNRecalibration(self.module)
        self.last_eval_extras: dict[str, float] = {}
        self._unscored_warned = False  # evaluate's warning that no accuracy can be computed

    def weights(self, device: int) -> torch.Tensor:
        """A copy of device ``device``'s z, ``[P]``, in ``named_parameters()`` order."""
        self._plan.rounds.flush()
        return self._params.to_standard(self._plan.states[device].z.detach())

    def replica_weights(self) -> torch.Tensor:
        """A copy of every replica's parameters, ``[k, P]``, device-major (j = d·m + r)."""
        states = self._plan.states
        self._plan.rounds.flush()
        return self._params.to_standard(
            torch.cat([s.w.detach().to(states[0].torch_device) for s in states]))

    def refresh(self) -> None:
        """The module's buffers for the current z: float buffers from zbuf, BatchNorm statistics
        re-estimated (``BNRecalibration.refresh``), integer buffers from the first replica
        (under torchrun on rank 0 only: the others hold rank 0's, ``int_buffers_from_rank0``)."""
        plan = self._plan
        plan.rounds.flush()
        first = plan.states[0]
        self.recalibration.refresh(self.module, self._buf, z=first.z, zbuf=first.zbuf,
                                   batch_size=plan.settings.batch_size, num_learners=plan.num_learners,
                                   round_index=plan.progress.rounds_done, flags=first.call_flags)
        if plan.comm is not None and not plan.comm.is_main:
            return
        src = dict(first.replicas[0].named_buffers())
        for name, b in self.module.named_buffers():
            if not b.is_floating_point():
                b.copy_(src[name])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The refreshed module on ``args`` (tensors moved to the first device) and ``kwargs``."""
        device = self._plan.states[0].torch_device
        moved = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        self.refresh()
        return self.module(*moved, **kwargs)

    def state(self) -> dict[str, torch.Tensor]:
        """The refreshed module's state_dict: z's parameters (views of z: copy what you keep)
        and the buffers ``copy`` has."""
        self.refresh()
        return self.module.state_dict()

    def copy(self) -> nn.Module:
        """The refreshed module as a new module of the template's class, evaluation mode."""
        out = copy_module(self._plan.template)
        out.load_state_dict({k: v.detach().clone() for k, v in self.state().items()})
        return out.eval()

    @torch.no_grad()
    def evaluate(self, dataset: Any, *, batch_size: int, metric_fn: Callable[[Any, Any], Any] | None,
                 check: bool = True) -> tuple[float | None, float]:
        """(accuracy or None, mean loss) of the refreshed module (``evaluate_model``), with
        ``check`` after ``check_eval_dataset`` (training/validate.py: TypeError, ValueError
        before any forward); the first unscored evaluation warns (UserWarning)."""
        plan = self._plan
        if check:
            check_eval_dataset(plan, dataset)
        data, dataset = dataset, eval_samples(dataset)
        self.refresh()
        result = evaluate_model(self.module, plan.loss_fn, dataset, batch_size=batch_size,
                                device=plan.states[0].torch_device, metric_fn=metric_fn,
                                collate_fn=collate_of(data), flags=plan.states[0].call_flags,
                                workers_of=data if isinstance(data, DataLoader) else None)
        self.last_eval_extras = result.extras  # a dict loss_fn's other entries (EvalRecord)
        if result.unscored and not self._unscored_warned:
            self._unscored_warned = True
            warnings.warn(f"{plan.model_graph.name}: no test accuracy: {result.unscored}; "
                          "test_accuracy is None and target_accuracy cannot stop training",
                          UserWarning, stacklevel=4)  # the caller of Plan.evaluate
        return result.accuracy, result.loss

    @torch.no_grad()
    def int_buffers_from_rank0(self, *, replicas: bool, round_index: int = -1) -> None:
        """Under torchrun: rank 0's first replica's integer buffers (one broadcast) into the
        module on every rank, and into every replica with ``replicas`` (at start-up)."""
        plan = self._plan
        ints = {n: b.cpu() for n, b in plan.states[0].replicas[0].named_buffers()
                if not b.is_floating_point()}
        if not ints:  # the same on every rank: the model fingerprints agree
            return
        ints = plan.comm.broadcast_object(ints, round_index)
        modules = [self.module] + ([r for s in plan.states for r in s.replicas] if replicas else [])
        for module in modules:
            for name, b in module.named_buffers():
                if name in ints:
                    b.copy_(ints[name])


@torch.no_grad()
def start_from_rank0(states: list[DeviceState], comm: Any) -> None:
    """Every rank's replicas, z, z_prev and float buffers become rank 0's (two broadcasts;
    docs/design-overview.md §2: one initialisation, cloned)."""
    first = states[0]
    z, zbuf = first.z.clone(), first.zbuf.clone()
    comm.broadcast_tensor_(z, -1)
    if zbuf.numel():
        comm.broadcast_tensor_(zbuf, -1)
    for s in states:
        s.z.copy_(z)
        s.z_prev.copy_(z)
        s.w.copy_(z.expand_as(s.w))
        if zbuf.numel():
            s.zbuf.copy_(zbuf)
            s.buf.copy_(zbuf.expand_as(s.buf))
