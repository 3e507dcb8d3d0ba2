"""The ``crossbow-graph`` command line: ``train`` (and, as they land, ``inspect`` and ``bench``)."""

from __future__ import annotations

import argparse
import sys

import torch

__all__ = ["main", "build_parser"]

DATASETS = ("mnist",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crossbow-graph",
        description="Small-batch, many-replica training with synchronous model averaging (SMA).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="train a zoo model on a real dataset with SMA",
        description="Train a model of the zoo with SMA and print the central model's test accuracy. "
                    "With no arguments: LeNet-5 on MNIST, b=16, 2 devices, auto-tuned replicas, until "
                    "99.0%% test accuracy or 5 epochs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    train.add_argument("--model", default="lenet5", help="zoo model name (crossbow_graph.models.MODELS)")
    train.add_argument("--dataset", default="mnist", help=f"dataset: one of {', '.join(DATASETS)}")
    train.add_argument("--batch-size", type=int, default=16, help="b, samples per learner per round")
    train.add_argument("--devices", default="2",
                       help="devices: 'auto' (every GPU, else one CPU device) or a count G")
    train.add_argument("--replicas", default="auto",
                       help="m, replicas (learners) per device, or 'auto' (the auto-tuner)")
    train.add_argument("--learner-mode", default="per_replica", choices=("per_replica", "fused"),
                       help="learners' mode (the auto-tuner also tries the other one)")
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


def _load_dataset(name: str):
    from . import datasets

    if name == "mnist":
        return datasets.mnist(train=True), datasets.mnist(train=False)
    raise ValueError(f"unknown dataset '{name}'; choose one of: {', '.join(DATASETS)}")


def _train(args: argparse.Namespace) -> int:
    import crossbow_graph as cg

    torch.manual_seed(args.seed)
    model = cg.models.get_model(args.model)
    train_set, test_set = _load_dataset(args.dataset)
    devices = args.devices if args.devices == "auto" else int(args.devices)
    plan = cg.compile(
        model, (train_set[0][0].unsqueeze(0),), torch.nn.functional.cross_entropy,
        batch_size=args.batch_size, devices=devices,
        replicas=args.replicas if args.replicas == "auto" else int(args.replicas),
        learner_mode=args.learner_mode,
        optimizer=cg.SGD(lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay),
        sync=cg.SMA(alpha=args.alpha, central_momentum=args.central_momentum),
    )
    print(plan.summary(), flush=True)
    target = args.target if args.target > 0 else None
    history = plan.fit(train_set, args.epochs, eval_dataset=test_set, seed=args.seed,
                       target_accuracy=target, evals_per_epoch=args.evals_per_epoch,
                       progress=not args.quiet)
    for d in history.autotune:
        print(f"autotune round {d.round}: m={d.replicas_per_device} {d.learner_mode} "
              f"{d.samples_per_s:,.0f} samples/s → {d.action} (m={d.next_replicas_per_device}, "
              f"{d.next_learner_mode})")
    for e in history.epochs:
        acc = f"{e.test_accuracy:.4f}" if e.test_accuracy is not None else "-"
        print(f"epoch {e.epoch}: loss {e.train_loss:.4f}  test accuracy {acc}  "
              f"{e.samples_per_s:,.0f} samples/s  {e.train_seconds:.1f} s  "
              f"(m={e.replicas_per_device}, {e.learner_mode})")
    epochs = history.epochs_to_accuracy or float(len(history.epochs))
    seconds = history.time_to_accuracy_s or plan.train_seconds
    samples = sum(e.samples for e in history.epochs)
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
