"""``crossbow-graph train``: the plan, data, optimizer, schedule and policies its flags give, the
fit and its results (docs/benchmarking.md, The main job)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

import crossbow_graph as cg

from . import datasets, models
from .cli_lm import (LM_BETAS, LM_MODELS, apply_lm_defaults, is_language_model, lm_datasets,
                     lm_fit_options, lm_lr_schedule, print_lm_results)
from .cli_layout import learner_layout
from .cli_machine import apply_machine_defaults
from .cli_options import flag_default
from .cli_sync import DILOCO_H, sync_of
from .datasets import ImageDataset
from .engine.learning.threads import describe_threads
from .engine.sync import SyncAlgorithm
from .engine.transport.comm import z_digest
from .errors import CheckpointError, DistributedError, DivergenceError, TrainingInterrupted
from .tuning.metrics import MetricsMonitor
from .tuning.policies import AdaptiveBatchSize, MultiStepLR, parse_policy

__all__ = ["prepare_train", "run_train", "load_dataset", "DATASETS", "OPTIMIZERS", "LR_SCHEDULES",
           "DILOCO_H", "DEFAULT_LR", "DEFAULT_LR_BATCH", "WINDOW_SAMPLES"]

DATASETS = ("mnist", "fashion_mnist", "cifar10", "fortunes")
# --optimizer: the torch.optim class, its default η and the samples per round (k·b) that η was
# measured at on LeNet-5/MNIST (adaptive_batch's reference for the gain with the default η):
# AdamW's with the default OneCycle schedule at b = 256, k = 1 and b = 128, k = 2
# (bench/tta_baselines.py, docs/benchmarking.md); SGD's is η₁, the lr at k = 1 (W1's tuned η₁,
# bench/stat_eff.py), which SMA's η rule scales to 0.02 per learner at b = 16, k = 4, the η
# measured best there with 10× drops (bench/lr_sweep_w1.py)
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, 8e-3, 256), "adam": (torch.optim.Adam, 8e-3, 256),
    "sgd": (torch.optim.SGD, 0.01, 64), "rmsprop": (torch.optim.RMSprop, 1e-3, 256),
}
# samples per metrics window (MetricsMonitor(window_samples=...)): 50 rounds at the default k·b
WINDOW_SAMPLES = 12_800
LR_SCHEDULES = ("onecycle", "multistep", "cosine", "constant")
DEFAULT_LR, DEFAULT_LR_BATCH = OPTIMIZERS["adamw"][1:]  # the default optimizer's


def _metrics_monitor(every: int, measure_rounds: int):
    """``--metrics-every`` and ``--measure-rounds`` as fit's ``metrics_every`` (0: None, off).

    Raises:
        ValueError: a negative N, or R < 1 (MetricsMonitor's message, naming the flag)."""
    try:
        monitor = MetricsMonitor(every or 50, measure_rounds=measure_rounds,  # checks R too
                                 window_samples=WINDOW_SAMPLES)
        return monitor if every else None
    except ValueError as exc:
        raise ValueError(f"--metrics-every {every} --measure-rounds {measure_rounds}: {exc}") from None


def _first(dataset, n: int | None, flag: str):
    if n is None:
        return dataset
    if n < 1:
        raise ValueError(f"{flag} {n}: must be ≥ 1")
    return ImageDataset(dataset.images[:n], dataset.labels[:n], dataset.name)


def load_dataset(args: argparse.Namespace):
    """(train, test) datasets for ``--dataset`` and ``--data-dir``."""
    name, root = args.dataset, args.data_dir
    # a CIFAR-style zoo model (3×32×32 input, e.g. resnet32: docs/benchmarking.md W2) gets Fashion-MNIST
    # padded to 32×32 with the channel repeated (INPUT_SHAPES: the zoo's input shape per model)
    cifar_style = getattr(models, "INPUT_SHAPES", {}).get(args.model) == (3, 32, 32)
    if name not in DATASETS:
        raise ValueError(f"unknown dataset '{name}'; choose one of: {', '.join(DATASETS)}")
    if is_language_model(args):
        return lm_datasets(args, args.block_size)
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
    if cls in (torch.optim.AdamW, torch.optim.Adam) and is_language_model(args):
        kwargs["betas"] = LM_BETAS
    return cls(model.parameters(), **kwargs)


def _lr_schedule(args: argparse.Namespace, plan: cg.Plan, n_train: int):
    """``--lr-schedule`` onecycle or cosine as a torch LambdaLR over the plan's optimizer, a
    function of the run's progress (samples trained / (--epochs · samples per epoch)), so that
    it spans the run whatever the auto-tuner does to k; None for multistep (a policy) and
    constant."""
    epochs, warm = args.epochs, args.warmup_epochs
    if is_language_model(args) and args.lr_schedule == "cosine":  # over tokens: cli_lm.py
        return lm_lr_schedule(args, plan, n_train, args.block_size)
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

    The flags left out that depend on the machine (``--optimizer``, ``--batch-size``,
    ``--replicas``, ``--lr-schedule``, ``--cuda-graphs``) get its values first
    (cli_machine.py ``apply_machine_defaults``: the GPU ones it applied are listed in
    ``args.machine_defaults``).

    Raises:
        ValueError: a bad flag value (before any training)."""
    apply_lm_defaults(args)  # --model gpt / --dataset fortunes: cli_lm.py's defaults first
    args.machine_defaults = apply_machine_defaults(args)
    _check_ft_flags(args)
    sync = sync_of(args)  # a flag of another algorithm's setting fails here, naming its fix
    _check_sync_optimizer(args, sync)
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
    model, loss_fn = _model_and_loss(args)
    train_set, test_set = load_dataset(args)
    if args.data_shard is not None:
        train_set = _shard(train_set, args.data_shard)
    devices, replicas = learner_layout(args.devices, args.replicas, policies)
    plan = cg.compile(
        model, (train_set[0][0].unsqueeze(0),), loss_fn,
        batch_size=args.batch_size, devices=devices,
        replicas=replicas,
        learner_mode=args.learner_mode,
        optimizer=_optimizer(args, model, lr),
        precision=args.precision, memory_format=args.memory_format, cuda_graphs=args.cuda_graphs,
        sync=sync,
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
               max_grad_norm=args.max_grad_norm, cpu_threads=args.cpu_threads,
               target_loss=args.target_loss)
    fit.update(lm_fit_options(args))  # the language model's metric and evaluation lines
    return plan, fit


def _model_and_loss(args: argparse.Namespace) -> tuple[torch.nn.Module, Any]:
    """``--model``'s new model and its loss: ``models.lm_loss`` for the language model (its
    context in ``args.block_size``), cross-entropy for the zoo's image models."""
    if is_language_model(args):
        model = LM_MODELS[args.model]()
        args.block_size = model.block_size
        return model, models.lm_loss
    args.block_size = None
    return cg.models.get_model(args.model), torch.nn.functional.cross_entropy


def _check_ft_flags(args: argparse.Namespace) -> None:
    """Raises ValueError: ``--lighthouse``, ``--replica-group`` or ``--min-replicas`` (other than
    its default) without ``--fault-tolerant``."""
    given = [flag for flag, value in (("--lighthouse", args.lighthouse),
                                      ("--replica-group", args.replica_group),
                                      ("--min-replicas", args.min_replicas))
             if value != flag_default(flag)]
    if given and not args.fault_tolerant:
        raise ValueError(f"{' '.join(given)} without --fault-tolerant: they set up a torchft replica "
                         "group; add --fault-tolerant, or drop them")


def _check_sync_optimizer(args: argparse.Namespace, sync: SyncAlgorithm) -> None:
    """Raises ValueError, in the CLI's flags, for ``sync`` (``sync_of(args)``): ``--sync ssgd``
    with an ``--optimizer`` other than sgd (S-SGD's global step is SGD's, engine/sync/ssgd.py);
    ``--share-second-moment`` with one other than adamw or adam (design §2, One second moment per
    device)."""
    if type(sync) is cg.SSGD and args.optimizer != "sgd":
        raise ValueError(f"--sync {args.sync} with --optimizer {args.optimizer}: S-SGD steps with "
                         f"SGD only; add --optimizer sgd, or use another --sync (sma, the default)")
    if sync.shares_second_moment and args.optimizer not in ("adamw", "adam"):
        raise ValueError(f"--share-second-moment with --optimizer {args.optimizer}: the learners "
                         f"share Adam's second moment; add --optimizer adamw (or adam), or drop "
                         f"--share-second-moment")


def _shard(dataset: Any, spec: str) -> torch.utils.data.Subset:
    """``--data-shard I/N``: the samples i of ``dataset`` with i mod N = I.

    Raises:
        ValueError: not two integers with 0 ≤ I < N."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        i = n = -1
    if not 0 <= i < n:
        raise ValueError(f"--data-shard {spec}: use I/N with 0 ≤ I < N, e.g. 0/2 and 1/2 for two "
                         "replica groups")
    return torch.utils.data.Subset(dataset, range(i, len(dataset), n))


def run_train(args: argparse.Namespace) -> int:
    """``crossbow-graph train``: the plan's summary, the fit, the results; the exit status
    (2: a checkpoint, divergence or distributed error, printed on one line; 128 + the signal
    after SIGTERM)."""
    plan, fit = prepare_train(args)
    comm = plan.comm  # under torchrun: only rank 0 prints, every rank prints its z checksum
    main_rank = comm is None or comm.is_main
    if main_rank:
        if args.machine_defaults:
            print(f"defaults on a CUDA GPU: {' '.join(args.machine_defaults)} (SMA at a small batch "
                  "with several replicas per GPU; flags given override them)", flush=True)
        print(plan.summary(), flush=True)
        if comm is not None:
            k = "this replica group's k" if comm.settings.fault_tolerant else "k"
            print(f"torchrun: {comm.world_size} processes ({comm.backend}) × "
                  f"{plan.num_learners // comm.world_size} learners = {k} {plan.num_learners}; "
                  f"{comm.settings.sync_bytes(plan.num_parameters, plan.states[0].buf.shape[1]):,} "
                  f"bytes per process per sync ({comm.settings.sync_dtype} corrections)", flush=True)
    if args.sync_dtype != "fp32" and comm is None:
        print(f"note: --sync-dtype {args.sync_dtype} applies under torchrun only (one process has "
              "no all-reduce); training as given", file=sys.stderr, flush=True)
    target = fit["target_accuracy"]
    try:
        with logging_redirect_tqdm():  # log records (membership changes) above the progress bar
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
    for c in history.membership if main_rank else ():  # torchft: every change of the live groups
        print(f"membership: round {c.round_index}: {c.groups} group(s), k = {c.learners}"
              + (" (recovered from a peer)" if c.recovered else "")
              + (f" after {c.failed_attempts} discarded all-reduce(s)" if c.failed_attempts else ""),
              flush=True)
    if main_rank and is_language_model(args):
        print_lm_results(plan, history, args)
    elif main_rank:
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
          f"{samples / max(plan.train_seconds, 1e-9):,.0f} samples/s, "
          f"{describe_threads(history.cpu_threads, history.free_cores)}")
