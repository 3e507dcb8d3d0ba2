"""FLOPs, activation bytes and the memory per learner of a shape-propagated fx graph at one
example batch (docs/design-overview.md §3; conventions and formulas: docs/compiler.md §2, §3)."""

from __future__ import annotations

import math
import os
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.fx as fx
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from .eager import EagerCost

__all__ = ["NodeCost", "ModelAnalysis", "MemoryEstimate", "MEMORY_PARTS", "analyze",
           "analysis_of_totals", "estimate_memory", "max_replicas_per_device", "unknown_modules",
           "cublas_workspace_bytes"]

#: The parts of a learner's memory estimate, in the order summaries print them.
MEMORY_PARTS = ("params", "grads", "optimizer", "buffers", "activations", "workspace", "library",
                "flat_share")

#: Gradient temporaries alive at the peak of backward, in largest activations, without and with
#: residual joins (calibrated: docs/compiler.md, "Measured error of the estimate").
_WORKSPACE_CHAIN = 1.5
_WORKSPACE_RESIDUAL = 3.0

# -- the op vocabulary: fx targets → a category ------------------------------------------------

_CONV_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORM_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm)
_MAXPOOL_MODULES = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)
_AVGPOOL_MODULES = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)
_ADAPTIVE_MODULES = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
                     nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
_VIEW_MODULES = (nn.Flatten, nn.Identity, nn.Unflatten)
_SAVE_OUTPUT_MODULES = (nn.ReLU, nn.ReLU6, nn.Sigmoid, nn.Tanh, nn.Softmax, nn.LogSoftmax, nn.ELU)
_SAVE_INPUT_MODULES = (nn.GELU, nn.SiLU, nn.LeakyReLU, nn.Hardtanh, nn.Softplus, nn.Mish)
_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)

_FUNCTIONS: dict[Any, str] = {
    F.conv1d: "conv", F.conv2d: "conv", F.conv3d: "conv", torch.conv2d: "conv",
    F.linear: "linear", F.scaled_dot_product_attention: "attention",
    torch.matmul: "matmul", torch.mm: "matmul", torch.bmm: "matmul", operator.matmul: "matmul",
    F.batch_norm: "norm", F.layer_norm: "norm", F.group_norm: "norm",
    F.max_pool1d: "maxpool", F.max_pool2d: "maxpool", F.max_pool3d: "maxpool",
    F.avg_pool1d: "avgpool", F.avg_pool2d: "avgpool", F.avg_pool3d: "avgpool",
    F.adaptive_avg_pool1d: "adaptive", F.adaptive_avg_pool2d: "adaptive",
    F.adaptive_avg_pool3d: "adaptive", F.adaptive_max_pool2d: "adaptive",
    F.relu: "save_output", torch.relu: "save_output", torch.sigmoid: "save_output",
    torch.tanh: "save_output", F.softmax: "save_output", F.log_softmax: "save_output",
    torch.softmax: "save_output", F.elu: "save_output", F.relu6: "save_input",
    F.gelu: "save_input", F.silu: "save_input", F.leaky_relu: "save_input",
    operator.add: "add", torch.add: "add", operator.sub: "add", torch.sub: "add",
    operator.iadd: "add", operator.neg: "add",
    operator.mul: "mul", torch.mul: "mul", operator.truediv: "mul", torch.div: "mul",
    F.dropout: "dropout",
    torch.flatten: "view", torch.reshape: "view", torch.squeeze: "view",
    torch.unsqueeze: "view", torch.transpose: "view", torch.permute: "view",
    torch.chunk: "view", torch.split: "view", operator.getitem: "view", getattr: "view",
    F.pad: "copy", torch.cat: "copy", torch.stack: "copy",
}
_METHODS: dict[str, str] = {
    "view": "view", "reshape": "view", "flatten": "view", "squeeze": "view", "unsqueeze": "view",
    "transpose": "view", "permute": "view", "t": "view", "expand": "view", "contiguous": "view",
    "chunk": "view", "split": "view", "view_as": "view", "narrow": "view",
    "relu": "save_output", "sigmoid": "save_output", "tanh": "save_output",
    "softmax": "save_output", "log_softmax": "save_output", "relu_": "save_output",
    "add": "add", "sub": "add", "add_": "add", "neg": "add",
    "mul": "mul", "div": "mul", "matmul": "matmul", "mm": "matmul", "bmm": "matmul",
    "size": "shape", "dim": "shape", "numel": "shape",
}
#: Categories whose output is a view of their first input (no new memory).
_ALIASES = {"view", "shape"}


@dataclass(frozen=True, kw_only=True)
class NodeCost:
    """The analysis of one fx node at the example batch.

    Attributes:
        name, target: the fx node's name; what it calls (module path, function or method).
        op: its category (conv, linear, matmul, norm, …, other; ``measured``: measured eagerly,
            compiler/eager.py; ``module``, ``rest``: a model analysed eagerly as a whole).
        shape, dtype: of the output (None for non-tensor outputs).
        flops: forward FLOPs (multiply-add = 2).
        bytes: bytes of the output tensor (0 for views and shapes).
        saved_bytes: bytes of the output that autograd keeps for backward, plus what the op
            saves besides (max pooling's indices, dropout's mask)."""

    name: str
    op: str
    target: str
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    flops: int
    bytes: int
    saved_bytes: int


@dataclass(frozen=True, kw_only=True)
class ModelAnalysis:
    """Costs of a traced model: ``nodes`` (one NodeCost per fx node, in graph order) at
    ``example_batch``, and per-sample totals (FLOPs, of a training step 3 × forward; bytes of
    new tensors, of those kept for backward, of the largest one); bytes of the largest trainable
    tensor, of the parameters (trainable, frozen) and buffers; P = ``num_trainable``, Q =
    ``num_float_buffers``; ``residual_joins``; ``workspace_activations`` (1.5, or 3 with
    residual joins); ``overhang_conv_weight_bytes``: bytes of the largest weight of a
    convolution whose kernel is larger than its input in every spatial dimension (0: none)."""

    nodes: tuple[NodeCost, ...]
    example_batch: int
    forward_flops_per_sample: float
    train_flops_per_sample: float
    activation_bytes_per_sample: float
    saved_bytes_per_sample: float
    max_activation_bytes_per_sample: float
    max_param_bytes: int
    param_bytes: int
    trainable_bytes: int
    frozen_bytes: int
    buffer_bytes: int
    num_trainable: int
    num_float_buffers: int
    residual_joins: int
    workspace_activations: float
    overhang_conv_weight_bytes: int = 0

    def forward_flops(self, batch_size: int) -> int:
        """Forward FLOPs of a batch of ``batch_size`` samples."""
        return int(round(self.forward_flops_per_sample * batch_size))

    def train_step_flops(self, batch_size: int) -> int:
        """FLOPs of one learner's training step at batch b: 3 × forward + 4P (the SGD update)."""
        return int(round(self.train_flops_per_sample * batch_size)) + 4 * self.num_trainable

    def table(self, *, limit: int | None = None) -> str:
        """The per-node table at the example batch (``crossbow-graph inspect --nodes``)."""
        rows = [f"per node at the example batch of {self.example_batch}:",
                f"{'node':<28}{'op':<12}{'calls':<28}{'shape':<22}{'dtype':<10}{'MFLOP':>10}{'KiB':>10}{'saved KiB':>11}"]
        for n in self.nodes[:limit]:
            shape = "x".join(map(str, n.shape)) if n.shape is not None else "-"
            dtype = str(n.dtype).replace("torch.", "") if n.dtype is not None else "-"
            rows.append(f"{n.name[:27]:<28}{n.op:<12}{n.target[:27]:<28}{shape[:21]:<22}{dtype:<10}"
                        f"{n.flops / 1e6:>10.3f}{n.bytes / 1024:>10.1f}{n.saved_bytes / 1024:>11.1f}")
        rows.append(f"forward {self.forward_flops_per_sample / 1e6:.3f} MFLOP/sample, training step "
                    f"{self.train_flops_per_sample / 1e6:.3f} MFLOP/sample, saved for backward "
                    f"{self.saved_bytes_per_sample / 1024:.1f} KiB/sample")
        return "\n".join(rows)


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Memory of one learner at batch b = ``batch_size`` on a device with m =
    ``replicas_per_device`` learners, in bytes, by part (``MEMORY_PARTS``; each part's formula:
    docs/compiler.md §3)."""

    params: int
    grads: int
    optimizer: int
    buffers: int
    activations: int
    workspace: int
    flat_share: int
    batch_size: int
    replicas_per_device: int
    library: int = 0

    @property
    def total(self) -> int:
        """Bytes per learner: the sum of every part."""
        return sum(getattr(self, p) for p in MEMORY_PARTS)

    @property
    def training_step(self) -> int:
        """Bytes of one eager training step (no flat share, no library workspace)."""
        return self.total - self.flat_share - self.library

    def breakdown(self) -> str:
        """``"params 1.8 + grads 1.8 + ... MiB"``: the parts of ``total`` in MiB."""
        return " + ".join(f"{p} {getattr(self, p) / 2**20:.2f}" for p in MEMORY_PARTS) + " MiB"

    def as_dict(self) -> dict[str, int]:
        return {p: getattr(self, p) for p in MEMORY_PARTS + ("batch_size", "replicas_per_device")}


def _itemsize(dtype: torch.dtype | None) -> int:
    return torch.empty((), dtype=dtype).element_size() if dtype is not None else 0


def _tensor_meta(node: fx.Node) -> tuple[tuple[int, ...] | None, torch.dtype | None]:
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return tuple(tm.shape), tm.dtype
    return None, None


def _category(node: fx.Node, modules: dict[str, nn.Module]) -> tuple[str, str]:
    """(category, readable target) of a node."""
    if node.op == "placeholder":
        return "input", str(node.target)
    if node.op == "get_attr":
        return "param", str(node.target)
    if node.op == "output":
        return "output", "output"
    if node.op == "call_module":
        mod = modules[node.target]
        name = f"{node.target} ({type(mod).__name__})"
        for types, cat in ((_CONV_MODULES, "conv"), ((nn.Linear,), "linear"),
                           (_NORM_MODULES, "norm"), (_MAXPOOL_MODULES, "maxpool"),
                           (_AVGPOOL_MODULES, "avgpool"), (_ADAPTIVE_MODULES, "adaptive"),
                           (_VIEW_MODULES, "view"), (_SAVE_OUTPUT_MODULES, "save_output"),
                           (_SAVE_INPUT_MODULES, "save_input"), (_DROPOUT_MODULES, "dropout")):
            if isinstance(mod, types):
                return cat, name
        return "other", name
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
        return _FUNCTIONS.get(node.target, "other"), name
    return _METHODS.get(str(node.target), "other"), f".{node.target}()"


def _numel(shape: tuple[int, ...] | None) -> int:
    return math.prod(shape) if shape is not None else 0


def _arg_shape(arg: Any) -> tuple[int, ...] | None:
    return _tensor_meta(arg)[0] if isinstance(arg, fx.Node) else None


def _flops(node: fx.Node, cat: str, out_shape: tuple[int, ...] | None,
           modules: dict[str, nn.Module]) -> int:
    out = _numel(out_shape)
    mod = modules.get(node.target) if node.op == "call_module" else None
    in_shape = _arg_shape(node.args[0]) if node.args else None
    if cat in ("conv", "linear"):
        if mod is not None:
            w_shape, has_bias = tuple(mod.weight.shape), mod.bias is not None
        else:
            w_shape = _arg_shape(node.args[1] if len(node.args) > 1 else node.kwargs.get("weight"))
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            has_bias = bias is not None
        per_out = math.prod(w_shape[1:]) if w_shape else 0
        return 2 * out * per_out + (out if has_bias else 0)
    if cat == "matmul":
        return 2 * out * (in_shape[-1] if in_shape else 0)
    if cat == "attention":  # q·kᵀ and (attention weights)·v: 2·2·N·H·Tq·Tk·D, a causal mask counted full
        return 4 * out * _key_length(node)
    if cat == "norm":
        return 4 * out
    if cat in ("maxpool", "avgpool"):
        k = mod.kernel_size if mod is not None else (node.args[1] if len(node.args) > 1
                                                     else node.kwargs.get("kernel_size", 1))
        dims = max(len(out_shape or ()) - 2, 1)
        k = (k,) * dims if isinstance(k, int) else tuple(k)
        return out * math.prod(k)
    if cat == "adaptive":
        return _numel(in_shape)
    if cat in ("save_output", "save_input", "add", "mul", "dropout", "other"):
        return out
    return 0


def _key_length(node: fx.Node) -> int:
    """Tk of ``scaled_dot_product_attention(q, k, v, ...)``: the keys' ``[..., Tk, D]``."""
    key = _arg_shape(node.args[1] if len(node.args) > 1 else node.kwargs.get("key"))
    return key[-2] if key else 0


def _attention_saved(node: fx.Node) -> tuple[list[fx.Node], bool, int]:
    """What ``scaled_dot_product_attention`` keeps, as torch's CPU kernels do: without dropout
    the fused kernel keeps q, k, v, its output and the log-sum-exp ``[N, H, Tq]`` float32;
    with ``dropout_p`` > 0 the composite path keeps copies of q, k, v and three ``[N, H, Tq,
    Tk]`` tensors (the softmax, the dropout mask, the dropped weights) of the output's dtype."""
    tensors = [a for a in node.args[:3] if isinstance(a, fx.Node)] or \
        [node.kwargs[k] for k in ("query", "key", "value") if isinstance(node.kwargs.get(k), fx.Node)]
    shape, dtype = _tensor_meta(node)
    out, size = _numel(shape), _itemsize(dtype)
    dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    if not dropout:
        return tensors, True, 4 * (out // shape[-1] if shape else 0)
    return [], False, size * (3 * out + 3 * (out // shape[-1]) * _key_length(node) if shape else 0)


def _saved_inputs(node: fx.Node, cat: str, modules: dict[str, nn.Module]) -> tuple[list[fx.Node], bool, int]:
    """(input nodes the op keeps for backward, whether it keeps its output, extra bytes it
    keeps: int64 indices (8 per output element), a dropout mask (1 per element), attention's
    own tensors)."""
    tensor_args = [a for a in node.args if isinstance(a, fx.Node) and _arg_shape(a) is not None]
    data = tensor_args[:1]
    numel = _numel(_tensor_meta(node)[0])
    if cat in ("conv", "linear", "norm", "save_input", "avgpool", "adaptive"):
        return data, False, 0
    if cat == "maxpool":
        return data, False, 8 * numel
    if cat == "attention":
        return _attention_saved(node)
    if cat == "matmul":
        return tensor_args[:2], False, 0
    if cat == "mul":
        return tensor_args[:2] if len(tensor_args) >= 2 else [], False, 0
    if cat == "save_output":
        return [], True, 0
    if cat == "dropout":
        mod = modules.get(node.target) if node.op == "call_module" else None
        p = mod.p if mod is not None else node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        return [], False, (numel if p > 0 else 0)
    if cat in ("add", "view", "copy", "shape", "input", "param", "output"):
        return [], False, 0
    return tensor_args, True, 0  # unknown op: assume it keeps its inputs and its output


def _overhang_weight_bytes(node: fx.Node, modules: dict[str, nn.Module]) -> int:
    """A convolution module's weight bytes when its kernel is larger than its input in every
    spatial dimension (a 3 × 3 kernel over a 2 × 2 map), else 0."""
    mod = modules.get(node.target) if node.op == "call_module" else None
    in_shape = _arg_shape(node.args[0]) if node.args else None
    if mod is None or in_shape is None:
        return 0
    kernel = tuple(mod.weight.shape[2:])
    spatial = tuple(in_shape[-len(kernel):]) if kernel else ()
    if not kernel or not all(s < k for s, k in zip(spatial, kernel)):
        return 0
    return mod.weight.numel() * mod.weight.element_size()


def _is_inplace(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return bool(getattr(modules[node.target], "inplace", False))
    if node.op == "call_method":
        return str(node.target).endswith("_")
    return bool(node.kwargs.get("inplace", False))


def unknown_modules(module: fx.GraphModule) -> list[str]:
    """The targets of ``call_module`` nodes that §2 of docs/compiler.md has no formula for."""
    modules = dict(module.named_modules())
    return list(dict.fromkeys(str(n.target) for n in module.graph.nodes
                              if n.op == "call_module" and _category(n, modules)[0] == "other"))


def analyze(module: fx.GraphModule, example_batch: int, *, parameters: list, buffers: list,
            measured: "Mapping[str, EagerCost] | None" = None) -> ModelAnalysis:
    """The ModelAnalysis of ``module``, shape-propagated on an example batch of
    ``example_batch`` samples, with the ParamInfo inventory ``parameters, buffers``; a
    ``call_module`` target in ``measured`` takes its measured EagerCost (compiler/eager.py).
    Source: docs/compiler.md §2."""
    modules = dict(module.named_modules())
    measured = dict(measured or {})
    base: dict[str, str] = {}  # node name → the node owning its memory
    cats: dict[str, tuple[str, str]] = {}
    saved_base: set[str] = set()
    extra: dict[str, int] = {}
    joins = 0
    for node in module.graph.nodes:
        cat, target = _category(node, modules)
        cats[node.name] = (cat, target)
        first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        alias = cat in _ALIASES or (_is_inplace(node, modules) and first is not None)
        base[node.name] = base[first.name] if alias and first is not None else node.name
        if _measured(node, measured) is not None:
            continue  # its saved bytes are measured, inputs included
        inputs, keeps_output, extra_bytes = _saved_inputs(node, cat, modules)
        for a in inputs:
            saved_base.add(base[a.name])
        if keeps_output:
            saved_base.add(base[node.name])
        if cat == "add" and sum(1 for a in node.args if isinstance(a, fx.Node)
                                and cats.get(a.name, ("",))[0] != "param") == 2:
            joins += 1
        if extra_bytes:
            extra[node.name] = extra_bytes
    nodes, largest = [], 0
    overhang = max((_overhang_weight_bytes(n, modules) for n in module.graph.nodes
                    if cats[n.name][0] == "conv"), default=0)
    for node in module.graph.nodes:
        cat, target = cats[node.name]
        shape, dtype = _tensor_meta(node)
        cost = _measured(node, measured)
        if cost is not None:
            calls = max(cost.calls, 1)
            nodes.append(NodeCost(name=node.name, op="measured", target=target, shape=shape,
                                  dtype=dtype, flops=cost.flops // calls,
                                  bytes=cost.activation_bytes // calls,
                                  saved_bytes=cost.saved_bytes // calls))
            largest = max(largest, cost.max_activation_bytes)
            continue
        owns = base[node.name] == node.name and cat not in ("param", "output")
        nbytes = _numel(shape) * _itemsize(dtype) if owns and shape is not None else 0
        saved = (nbytes if node.name in saved_base else 0) + extra.get(node.name, 0)
        nodes.append(NodeCost(name=node.name, op=cat, target=target, shape=shape, dtype=dtype,
                              flops=_flops(node, cat, shape, modules), bytes=nbytes,
                              saved_bytes=saved))
        largest = max(largest, nbytes)
    return analysis_of_totals(
        nodes, example_batch, parameters=parameters, buffers=buffers,
        forward_flops=sum(c.flops for c in nodes),
        activation_bytes=sum(c.bytes for c in nodes if c.op != "input"),
        saved_bytes=sum(c.saved_bytes for c in nodes), max_activation_bytes=largest,
        residual_joins=joins, overhang_conv_weight_bytes=overhang)


def _measured(node: fx.Node, measured: dict[str, "EagerCost"]) -> "EagerCost | None":
    return measured.get(str(node.target)) if node.op == "call_module" else None


def analysis_of_totals(nodes: list[NodeCost], example_batch: int, *, parameters: list,
                       buffers: list, forward_flops: float, activation_bytes: float,
                       saved_bytes: float, max_activation_bytes: float,
                       residual_joins: int | None,
                       overhang_conv_weight_bytes: int = 0) -> ModelAnalysis:
    """A ModelAnalysis from totals at an example batch of N samples (per sample: / N); bytes of
    parameters and buffers from the inventory; ``residual_joins=None`` (unknown) takes the
    residual workspace factor."""
    n = max(example_batch, 1)
    joins = residual_joins or 0
    workspace = _WORKSPACE_RESIDUAL if residual_joins is None or joins else _WORKSPACE_CHAIN
    return ModelAnalysis(
        nodes=tuple(nodes), example_batch=example_batch,
        forward_flops_per_sample=forward_flops / n, train_flops_per_sample=3 * forward_flops / n,
        activation_bytes_per_sample=activation_bytes / n,
        saved_bytes_per_sample=saved_bytes / n,
        max_activation_bytes_per_sample=max_activation_bytes / n,
        max_param_bytes=max((p.numel * _itemsize(p.dtype) for p in parameters if p.trainable), default=0),
        param_bytes=sum(p.numel * _itemsize(p.dtype) for p in parameters),
        trainable_bytes=sum(p.numel * _itemsize(p.dtype) for p in parameters if p.trainable),
        frozen_bytes=sum(p.numel * _itemsize(p.dtype) for p in parameters if not p.trainable),
        buffer_bytes=sum(b.numel * _itemsize(b.dtype) for b in buffers),
        num_trainable=sum(p.numel for p in parameters if p.trainable),
        num_float_buffers=sum(b.numel for b in buffers if b.dtype.is_floating_point),
        residual_joins=joins,
        workspace_activations=workspace,
        overhang_conv_weight_bytes=overhang_conv_weight_bytes,
    )


def cublas_workspace_bytes(capability: tuple[int, int], config: str | None = None) -> int:
    """cuBLAS's workspace bytes per stream on a GPU of compute ``capability``, from ``config``
    (default: ``$CUBLAS_WORKSPACE_CONFIG``, else PyTorch's default; PyTorch's CUDA semantics,
    cuBLAS workspaces). Raises ValueError when ``config`` is not ``:SIZE_KiB:COUNT`` pairs."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG") if config is None else config
    if not config:
        config = ":4096:8" if capability >= (9, 0) else ":4096:2:16:8"
    fields = config.split(":")[1:]
    if len(fields) % 2 or not all(f.isdigit() for f in fields):
        raise ValueError(f"CUBLAS_WORKSPACE_CONFIG={config!r}: use :SIZE_KiB:COUNT pairs, e.g. :4096:8")
    return sum(int(size) * int(count) * 1024 for size, count in zip(fields[::2], fields[1::2]))


def estimate_memory(analysis: ModelAnalysis, batch_size: int, replicas_per_device: int = 1,
                    *, library_workspace: int = 0) -> MemoryEstimate:
    """Memory of one learner at batch b = ``batch_size`` with m = ``replicas_per_device``
    learners per device: ``params + grads + optimizer + buffers + activations(b) +
    workspace(b) + library + flat_share(m)`` bytes (docs/compiler.md §3), ``library_workspace``
    bytes per learner. Raises ValueError when b < 1 or m < 1."""
    if batch_size < 1 or replicas_per_device < 1:
        raise ValueError(f"estimate_memory(batch_size={batch_size}, replicas_per_device="
                         f"{replicas_per_device}): both must be ≥ 1")
    p4 = 4 * analysis.num_trainable
    shared = 3 * p4 + 4 * analysis.num_float_buffers
    largest = analysis.max_activation_bytes_per_sample * batch_size
    return MemoryEstimate(
        params=analysis.param_bytes, grads=p4, optimizer=p4, buffers=analysis.buffer_bytes,
        activations=int(math.ceil(analysis.saved_bytes_per_sample * batch_size)),
        workspace=int(math.ceil(max(analysis.workspace_activations * largest,
                                    largest + analysis.max_param_bytes))),
        flat_share=int(math.ceil(shared / replicas_per_device)),
        batch_size=batch_size, replicas_per_device=replicas_per_device,
        library=int(library_workspace),
    )


def max_replicas_per_device(analysis: ModelAnalysis, batch_size: int, memory_budget_bytes: int,
                            *, limit: int = 1024) -> int:
    """The largest m ≤ ``limit`` with ``m × estimate_memory(analysis, b, m).total ≤ budget``
    (0 when none fits; docs/design-overview.md §3). Raises ValueError when b < 1."""
    best = 0
    for m in range(1, limit + 1):
        if m * estimate_memory(analysis, batch_size, m).total > memory_budget_bytes:
            break
        best = m
    return best
