"""Per-device training state in flat buffers: m replicas whose parameters, gradients and float
buffers are views of the rows of ``w, g [m, P]`` and ``buf [m, Q]``, beside ``v [m, P]``,
``z, z_prev [P]`` and ``zbuf [Q]`` (docs/design-overview.md §4; dtypes: docs/kernels.md,
"Low precision"; padded CUDA rows: docs/kernels.md, "CUDA tunings")."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Literal, get_args

import torch
from torch import nn

from ..data.inputs import NO_FLAGS, CallFlags, example_call
from .precision import LossScales

__all__ = ["FlatLayout", "DeviceState", "bind_flat", "channels_last_weights", "check_grad_hooks",
           "copy_module", "grad_hooks", "model_dtype", "master_dtype", "row_length",
           "LOW_PRECISION", "MemoryFormat", "MEMORY_FORMATS", "ROW_ALIGN"]

LOW_PRECISION = (torch.bfloat16, torch.float16)
ROW_ALIGN = 32  # elements: CUDA devices pad the rows of w, v, g, w_model to a multiple of it
MemoryFormat = Literal["auto", "channels_last", "contiguous"]  # of convolution weights in the rows
MEMORY_FORMATS = get_args(MemoryFormat)
_PAD_ROWS_ON_CPU = False  # tests set it: pad the rows on CPU devices too (no CUDA here)


def row_length(P: int, device: torch.device) -> int:
    """Elements from one row of ``w, v, g, w_model`` to the next on ``device``: P rounded up to a
    multiple of ``ROW_ALIGN`` on a CUDA device, P on others."""
    if device.type == "cuda" or _PAD_ROWS_ON_CPU:
        return -(-P // ROW_ALIGN) * ROW_ALIGN
    return P


def _zero_rows(m: int, P: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros ``[m, P]`` whose rows are ``row_length(P, device)`` apart."""
    P_pad = row_length(P, device)
    rows = torch.zeros(m, P_pad, dtype=dtype, device=device)
    return rows[:, :P] if P_pad != P else rows


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a module lives in a flat row (docs/runtime.md, "Convolution weights
    channels-last").

    Attributes:
        entries: ``(name, shape, offset, numel)`` per tensor, in ``named_parameters()`` (tied ones
            once) or ``named_buffers()`` order.
        size: total scalars (P for parameters, Q for float buffers).
        channels_last: names of the 4-D weights ``[O, I, kH, kW]`` stored as ``[O, kH, kW, I]``."""

    entries: tuple[tuple[str, tuple[int, ...], int, int], ...]
    size: int
    channels_last: frozenset[str] = frozenset()

    @staticmethod
    def of(named: list[tuple[str, torch.Tensor]], channels_last: frozenset[str] = frozenset()
           ) -> "FlatLayout":
        entries, off = [], 0
        for name, t in named:
            n = t.numel()
            entries.append((name, tuple(t.shape), off, n))
            off += n
        return FlatLayout(tuple(entries), off, frozenset(channels_last))

    def view(self, flat: torch.Tensor, entry: tuple[str, tuple[int, ...], int, int]) -> torch.Tensor:
        """The tensor of ``entry`` as a view ``[..., *shape]`` of ``flat [..., ≥ P]``."""
        name, shape, off, n = entry
        segment = flat[..., off:off + n]
        if name in self.channels_last:
            o, i, h, w = shape
            return segment.unflatten(-1, (o, h, w, i)).movedim(-1, -3)
        return segment.unflatten(-1, shape) if shape else segment.squeeze(-1)

    def to_standard(self, flat: torch.Tensor) -> torch.Tensor:
        """A copy of ``flat [..., P]`` in the standard order (every tensor ``flatten()``-ed)."""
        out = flat.clone(memory_format=torch.contiguous_format)
        for entry in self._permuted():
            out[..., entry[2]:entry[2] + entry[3]] = self.view(flat, entry).flatten(-4)
        return out

    def from_standard(self, flat: torch.Tensor) -> torch.Tensor:
        """A copy of ``flat [..., P]`` (standard order, as ``to_standard`` gives) in this layout."""
        out = flat.clone(memory_format=torch.contiguous_format)
        for entry in self._permuted():
            _, shape, off, n = entry
            self.view(out, entry).copy_(flat[..., off:off + n].unflatten(-1, shape))
        return out

    def zeros(self, lead: tuple[int, ...], entry: tuple[str, tuple[int, ...], int, int], *,
              dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """Zeros ``[*lead, *shape]`` with the strides of ``entry``'s views."""
        name, shape, _, n = entry
        return self.view(torch.zeros(*lead, n, dtype=dtype, device=device), (name, shape, 0, n))

    def _permuted(self) -> list[tuple[str, tuple[int, ...], int, int]]:
        return [e for e in self.entries if e[0] in self.channels_last]


def channels_last_weights(module: nn.Module, memory_format: str, device_types: set[str],
                          example_inputs: Any = None) -> frozenset[str]:
    """The trainable ``nn.Conv2d`` weights a plan stores channels-last under ``memory_format``
    (one of ``MEMORY_FORMATS``; ``"auto"``: on CPU devices only) on ``device_types``; which
    weights qualify: docs/runtime.md, "Convolution weights channels-last". With
    ``example_inputs``, a copy so laid out runs one forward on them first.

    Raises:
        ValueError: with ``"channels_last"``, that forward fails (``"auto"`` warns and keeps
            every weight contiguous)."""
    if memory_format == "contiguous" or (memory_format == "auto" and device_types != {"cpu"}):
        return frozenset()
    trainable = {id(p): n for n, p in trainable_named(module)}
    owners: dict[int, int] = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    names = frozenset(
        trainable[id(w)] for m in module.modules()
        if isinstance(m, nn.Conv2d) and type(m).forward is nn.Conv2d.forward
        and (w := m._parameters.get("weight")) is not None and id(w) in trainable
        and w.dim() == 4 and owners[id(w)] == 1)
    failure = _channels_last_failure(module, names, example_inputs) if names else None
    if failure is None:
        return names
    text = (f"the model's forward fails with its Conv2d weights channels-last ({failure}): "
            "it reads a weight with .view() or as contiguous memory")
    if memory_format == "channels_last":
        raise ValueError(f"memory_format='channels_last': {text}; use memory_format='contiguous'")
    warnings.warn(f"{text}; its weights stay contiguous (memory_format='contiguous' says so)",
                  stacklevel=5)  # compile's caller
    return frozenset()


def _channels_last_failure(module: nn.Module, names: frozenset[str], example_inputs: Any
                           ) -> str | None:
    """Why a copy of ``module`` with ``names`` channels-last fails a forward, or None."""
    if example_inputs is None:
        return None
    probe = copy.deepcopy(module)
    layout = FlatLayout.of(trainable_named(probe), names)
    bind_flat(probe, torch.zeros(layout.size, dtype=model_dtype(trainable_named(probe)),
                                 device=next(iter(probe.parameters())).device),
              None, None, layout, FlatLayout((), 0))
    args, kwargs = example_call(example_inputs)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):  # the caller's RNG untouched
            probe(*args, **kwargs)
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return None


def trainable_named(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Trainable parameters, tied ones once, in ``named_parameters()`` order."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def grad_hooks(module: nn.Module) -> dict[str, list[Callable]]:
    """The gradient hooks on ``module``'s trainable parameters, by name, in running order."""
    return {n: list(p._backward_hooks.values()) for n, p in trainable_named(module)
            if p._backward_hooks}


def check_grad_hooks(module: nn.Module) -> None:
    """Raises ValueError naming the parameter when one has a post-accumulate-grad hook
    (docs/runtime.md, "Learner modes")."""
    for name, p in module.named_parameters():
        if p._post_accumulate_grad_hooks:
            hooks = ", ".join(getattr(fn, "__qualname__", type(fn).__name__)
                              for fn in p._post_accumulate_grad_hooks.values())
            raise ValueError(
                f"parameter '{name}' of {type(module).__name__} has a post-accumulate-grad hook "
                f"(register_post_accumulate_grad_hook: {hooks}), which runs on the accumulated "
                "gradient, e.g. to step an optimizer in backward; every replica's optimizer "
                "steps in the plan's local sync instead: remove the hook (a gradient hook, "
                "p.register_hook(fn), runs on every replica's gradient; clip with "
                "fit(max_grad_norm=...))")


def copy_module(module: nn.Module, hooks: dict[str, list[Callable]] | None = None) -> nn.Module:
    """``copy.deepcopy(module)`` with ``hooks`` (default ``grad_hooks(module)``) registered on
    the copy's parameters, since deepcopy drops tensor hooks."""
    out = copy.deepcopy(module)
    named = dict(out.named_parameters())
    for name, fns in (grad_hooks(module) if hooks is None else hooks).items():
        for fn in fns:
            named[name].register_hook(fn)
    return out


def float_buffers_named(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Floating-point buffers (averaged at sync); integer ones are carried, never averaged."""
    return [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]


def _set_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    sub = module.get_submodule(owner) if owner else module
    sub._buffers[leaf] = value


def bind_flat(module: nn.Module, params_row: torch.Tensor, grads_row: torch.Tensor | None,
              bufs_row: torch.Tensor | None, params: FlatLayout, buffers: FlatLayout, *,
              copy_values: bool = True) -> None:
    """Make ``module``'s trainable parameters (and gradients, float buffers) views into flat
    rows, copying their values into the rows first when ``copy_values``."""
    named = dict(module.named_parameters())
    for entry in params.entries:
        p = named[entry[0]]
        view = params.view(params_row, entry)
        if copy_values:
            view.copy_(p.detach())
        p.data = view
        if grads_row is not None:
            p.grad = params.view(grads_row, entry)
    if bufs_row is not None:
        named_b = dict(module.named_buffers())
        for name, shape, off, n in buffers.entries:
            view = bufs_row[off:off + n].view(shape)
            if copy_values:
                view.copy_(named_b[name])
            _set_buffer(module, name, view)


def model_dtype(params: list[tuple[str, torch.Tensor]]) -> torch.dtype:
    """The one dtype of a model's trainable parameters: float32, float64, bfloat16 or float16
    (others train in float32). Raises ValueError naming two parameters when dtypes mix."""
    dtypes = {p.dtype for _, p in params}
    if len(dtypes) > 1:
        first = {}
        for name, p in params:
            first.setdefault(p.dtype, name)
        a, b = list(first.items())[:2]
        raise ValueError(f"trainable parameters mix dtypes: '{a[1]}' is {a[0]} but '{b[1]}' is "
                         f"{b[0]}; cast the model to one dtype, e.g. model.to(torch.bfloat16)")
    dtype = dtypes.pop() if dtypes else torch.float32
    return dtype if dtype in (torch.float64, *LOW_PRECISION) else torch.float32


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of ``w, v, z, z_prev`` for a model of ``dtype``: float64 or float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _CopyBack:
    """Forward pre-hook: copy ``owner.<master>`` into ``owner.<model>`` when it changed."""

    def __init__(self, owner: object, master: str, model: str) -> None:
        self.owner, self.master, self.model = owner, master, model
        self.seen: tuple[int, int] = (-1, -1)  # (id, version) of the master when last copied

    def __call__(self, *_: object) -> None:
        master = getattr(self.owner, self.master)
        key = (id(master), master._version)
        if key != self.seen:
            getattr(self.owner, self.model).copy_(master)
            self.seen = key


class _CopyRow:
    """Forward pre-hook of replica ``j``: copy ``w[j]`` into ``w_model[j]``, every time
    (docs/kernels.md, "Low precision")."""

    def __init__(self, owner: "DeviceState", j: int) -> None:
        self.owner, self.j = owner, j

    def __call__(self, *_: object) -> None:
        self.owner.w_model[self.j].copy_(self.owner.w[self.j])


class DeviceState:
    """The m replicas of one device and their flat buffers.

    Attributes:
        name, torch_device: ``"cpu:0"``, ``"cuda:1"``, … and its torch.device.
        replicas: m modules in training mode, parameters views of ``w_model``.
        w, v, g: ``[m, P]`` parameters and momentum (``master_dtype``), gradients (model
            dtype); rows ``row_length(P, device)`` apart.
        buf: ``[m, Q]`` float buffers (model dtype).
        ints: the replicas' other buffers (``num_batches_tracked``) stacked, ``[m, *shape]`` by
            name; replica j's buffer is the view ``ints[name][j]``.
        z, z_prev, zbuf: ``[P]``, ``[P]``, ``[Q]``: the central model, its previous value, its
            float buffers.
        dtype: the model's dtype, that of ``w_model [m, P]`` and ``z_model [P]`` (``w`` and
            ``z`` themselves for float32 and float64).
        first_step: per replica, momentum not yet initialised.
        grad_hooks: the template's gradient hooks by parameter name, on every replica.
        optim_rows: a row optimizer's state (engine/state/optim.py ``OptimizerRows``), else None.
        precision, loss_scales: ``"fp32"``, ``"bf16"`` or ``"fp16"``; the replicas'
            ``LossScales`` with ``"fp16"``, else None.
        call_flags: compile's keyword flags that every forward of the replicas gets
            (engine/data/inputs.py ``CallFlags``)."""

    def __init__(self, name: str, torch_device: torch.device, template: nn.Module, m: int,
                 params: FlatLayout, buffers: FlatLayout, *, precision: str = "fp32",
                 call_flags: CallFlags = NO_FLAGS) -> None:
        self.name = name
        self.call_flags = call_flags
        self.torch_device = torch_device
        self.precision = precision
        self.loss_scales = LossScales(m) if precision == "fp16" else None
        self.params = params
        self.buffers = buffers
        self.dtype = dtype = model_dtype(trainable_named(template))
        master = master_dtype(dtype)
        self.w = _zero_rows(m, params.size, master, torch_device)
        self.v = _zero_rows(m, params.size, master, torch_device)
        self.g = _zero_rows(m, params.size, dtype, torch_device)
        self.buf = torch.zeros(m, buffers.size, dtype=dtype, device=torch_device)
        self.z = torch.zeros(params.size, dtype=master, device=torch_device)
        self.zbuf = torch.zeros(buffers.size, dtype=dtype, device=torch_device)
        low = dtype in LOW_PRECISION
        self.w_model = _zero_rows(m, params.size, dtype, torch_device) if low else self.w
        self.z_model = torch.zeros_like(self.z, dtype=dtype) if low else self.z
        self._low = low
        self._template = template
        self.grad_hooks = grad_hooks(template)  # every replica's parameters run them
        self.replicas: list[nn.Module] = []
        for j in range(m):
            self.replicas.append(self._new_replica(template, j))
        self.ints: dict[str, torch.Tensor] = {}
        self._bind_ints()
        if low:
            self.w.copy_(self.w_model)
        self.z.copy_(self.w[0])
        self.z_prev = self.z.clone()
        self.zbuf.copy_(self.buf[0])
        self.first_step = [True] * m
        self.optim_rows = None  # engine/state/optim.py OptimizerRows: the state of a row optimizer

    @property
    def m(self) -> int:
        """Replicas on this device (rows of ``w``); the plan's ``settings.replicas_per_device``."""
        return len(self.replicas)

    @property
    def template(self) -> nn.Module:
        """The model every replica is a copy of, in training mode, never trained (read only)."""
        return self._template

    def _new_replica(self, template: nn.Module, j: int) -> nn.Module:
        r = copy_module(template, self.grad_hooks).to(self.torch_device)
        r.train()
        bind_flat(r, self.w_model[j], self.g[j], self.buf[j], self.params, self.buffers)
        if self._low:
            r.register_forward_pre_hook(_CopyRow(self, j))
        return r

    def _bind_ints(self) -> None:
        """Stack the replicas' non-float buffers into ``ints`` and make each a view of its row."""
        names = [n for n, b in self.replicas[0].named_buffers() if not b.is_floating_point()]
        self.ints = {n: torch.stack([r.get_buffer(n) for r in self.replicas]) for n in names}
        for n, stacked in self.ints.items():
            for j, r in enumerate(self.replicas):
                _set_buffer(r, n, stacked[j])

    def bind_central(self, module: nn.Module, buffers: torch.Tensor | None = None) -> None:
        """Make ``module`` (a copy of the model) show this device's central model: parameters
        views of ``z_model``, float buffers views of ``buffers [Q]`` (default ``zbuf``)."""
        bind_flat(module, self.z_model, None, self.zbuf if buffers is None else buffers,
                  self.params, self.buffers)
        if self.z_model is not self.z:
            module.register_forward_pre_hook(_CopyBack(self, "z", "z_model"))

    @torch.no_grad()
    def resize(self, m: int) -> None:
        """Change the number of replicas to ``m`` between rounds (docs/runtime.md, "Changing m
        while training"): new ``w, v, g, buf`` tensors, in ordinary memory. Raises ValueError
        when ``m < 1``."""
        if m < 1:
            raise ValueError(f"replicas per device must be ≥ 1, got {m}")
        keep = min(m, self.m)
        P = self.params.size
        w = _zero_rows(m, P, self.w.dtype, self.torch_device)
        v = _zero_rows(m, P, self.v.dtype, self.torch_device)
        g = _zero_rows(m, P, self.g.dtype, self.torch_device)
        buf = torch.zeros(m, self.buffers.size, dtype=self.buf.dtype, device=self.torch_device)
        w[:keep].copy_(self.w[:keep])
        v[:keep].copy_(self.v[:keep])
        buf[:keep].copy_(self.buf[:keep])
        w[keep:].copy_(self.z.expand(m - keep, -1))
        buf[keep:].copy_(self.zbuf.expand(m - keep, -1))
        ints = {n: b.clone() for n, b in self.replicas[0].named_buffers() if not b.is_floating_point()}
        low = self._low
        self.w, self.v, self.g, self.buf = w, v, g, buf
        self.w_model = _zero_rows(m, P, self.dtype, self.torch_device) if low else w
        if low:
            self.w_model.copy_(w)
        replicas = []
        for j in range(m):
            r = self.replicas[j] if j < keep else \
                copy_module(self._template, self.grad_hooks).to(self.torch_device)
            r.train()
            bind_flat(r, self.w_model[j], g[j], buf[j], self.params, self.buffers, copy_values=False)
            if low and j >= keep:
                r.register_forward_pre_hook(_CopyRow(self, j))
            if j >= keep:
                for name, value in r.named_buffers():
                    if name in ints:
                        value.copy_(ints[name])
            replicas.append(r)
        self.replicas = replicas
        self._bind_ints()
        self.first_step = self.first_step[:keep] + [True] * (m - keep)
        if self.optim_rows is not None:
            self.optim_rows.resize(self, keep, m)
        if self.loss_scales is not None:
            self.loss_scales = self.loss_scales.resized(m)

    def share_memory(self) -> None:
        """Move every flat buffer and the replicas' integer buffers to shared memory, in place."""
        for t in (self.w, self.v, self.g, self.buf, self.z, self.z_prev, self.zbuf, self.w_model,
                  self.z_model):
            t.share_memory_()
        if self.loss_scales is not None:
            self.loss_scales.share_memory()
        for stacked in self.ints.values():  # the replicas' integer buffers are views of them
            stacked.share_memory_()
        if self.optim_rows is not None:
            self.optim_rows.share_memory()
