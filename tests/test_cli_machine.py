"""``crossbow-graph train``'s defaults per machine (cli_machine.py): on a CUDA GPU SMA at b = 16 with
4 replicas per GPU, the SGD kernels, a multistep schedule and graph rounds; on a CPU the measured
CPU defaults. A CUDA machine is faked where the defaults read it (``torch.cuda.device_count``,
``torch.cuda.is_available``); ``cg.compile`` is replaced by a recorder of its arguments where
the plan would need the GPU."""

from __future__ import annotations

import pytest
import torch

import crossbow_graph as cg
from crossbow_graph.cli import build_parser
from crossbow_graph.cli_machine import CPU_DEFAULTS, apply_machine_defaults
from crossbow_graph.cli_train import prepare_train
from crossbow_graph.engine.backends.graphs.capture import RoundGraph
from crossbow_graph.testing.capture_check import SimulatedGraphs
from crossbow_graph.testing.race_check import RaceRecorder


def _args(*flags: str):
    return build_parser().parse_args(["train", *flags])


@pytest.fixture
def cuda(monkeypatch):
    """This machine as one with ``cuda.gpus`` CUDA GPUs (default 1), for the defaults only."""
    class Cuda:
        gpus = 1

    monkeypatch.setattr(torch.cuda, "device_count", lambda: Cuda.gpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: Cuda.gpus > 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return Cuda


def test_a_cuda_machine_trains_sma_with_several_replicas_and_graph_rounds(cuda):
    args = _args()
    applied = apply_machine_defaults(args)
    assert (args.optimizer, args.batch_size, args.replicas, args.lr_schedule, args.cuda_graphs) == \
        ("sgd", 16, 4, "multistep", True)
    assert applied == ["--optimizer sgd", "--batch-size 16", "--lr-schedule multistep",
                       "--replicas 4", "--cuda-graphs"]


@pytest.mark.parametrize("flags, graphs", [
    (("--optimizer", "adamw"), False),  # a row optimizer: its rounds cannot replay
    (("--no-cuda-graphs",), False),
    (("--fault-tolerant",), False),  # refused with cuda_graphs=True
    (("--sync", "diloco"), False),
    (("--precision", "fp16"), False),  # loss scales settle on the host
    (("--batch-size", "32", "--replicas", "8"), True),
])
def test_flags_given_on_a_cuda_machine_override_its_defaults(cuda, flags, graphs):
    args = _args(*flags)
    apply_machine_defaults(args)
    assert args.cuda_graphs is graphs
    given = dict(zip(flags[::2], flags[1::2]))
    assert args.batch_size == int(given.get("--batch-size", 16))
    assert args.replicas == int(given.get("--replicas", 4))
    assert args.optimizer == given.get("--optimizer", "sgd")


def test_graph_rounds_are_off_by_default_where_they_would_not_replay(cuda, monkeypatch):
    """Several GPUs (a graph captures one device's streams) or a torchrun group: the GPU recipe,
    without graph rounds."""
    cuda.gpus = 2
    args = _args()
    apply_machine_defaults(args)
    assert (args.optimizer, args.replicas, args.cuda_graphs) == ("sgd", 4, False)
    cuda.gpus = 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = _args()
    apply_machine_defaults(args)
    assert args.cuda_graphs is False


def test_a_cpu_machine_keeps_its_measured_defaults():
    """No GPU here: AdamW at b = 256, a OneCycle schedule, the replicas left to cli_layout (1),
    no graph rounds; --devices 2 (logical CPU devices) too."""
    for flags in ((), ("--devices", "2")):
        args = _args(*flags)
        assert apply_machine_defaults(args) == []
        assert {k: getattr(args, k) for k in CPU_DEFAULTS} == CPU_DEFAULTS
        assert args.replicas is None and args.cuda_graphs is False


def test_train_compiles_the_gpu_defaults_into_its_plan(cuda, monkeypatch):
    """``prepare_train`` with no flags on a CUDA machine compiles SMA over 'auto' × 4 replicas at
    b = 16 with torch.optim.SGD (η 0.01, momentum 0.9: the fused kernels) and graph rounds; its
    schedule is the multistep policy (×0.1 at epochs 2 and 4)."""
    seen = {}

    class Compiled(Exception):
        pass

    def compile_(model, example, loss_fn, **kw):
        seen.update(kw)
        raise Compiled

    monkeypatch.setattr(cg, "compile", compile_)
    with pytest.raises(Compiled):
        prepare_train(_args("--train-samples", "64", "--test-samples", "64"))
    opt = seen["optimizer"]
    assert (seen["batch_size"], seen["devices"], seen["replicas"], seen["cuda_graphs"]) == \
        (16, "auto", 4, True)
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["lr"] == 0.01 and \
        opt.defaults["momentum"] == 0.9
    assert isinstance(seen["sync"], cg.SMA)


def test_the_gpu_defaults_run_their_rounds_as_graphs(cuda, monkeypatch):
    """The GPU defaults' plan (SMA with the SGD kernels, b = 16, m = 4), compiled here on the CPU,
    runs its rounds as simulated CUDA graphs on simulated streams: captured and replayed, no round
    eager (AdamW, the CPU's default, a row optimizer, runs every round eagerly)."""
    real = cg.compile

    def on_this_cpu(model, example, loss_fn, **kw):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
        return real(model, example, loss_fn, **{**kw, "cuda_graphs": False, "executor": "inline"})

    monkeypatch.setattr(cg, "compile", on_this_cpu)
    plan, fit = prepare_train(_args("--train-samples", "640", "--test-samples", "64", "--epochs",
                                    "1", "--evals-per-epoch", "1", "--quiet"))
    assert plan.replicas_per_device == 4 and plan.batch_size == 16
    rec = RaceRecorder().attach(plan.rounds)
    plan.rounds.executors.round_graph = RoundGraph(SimulatedGraphs())
    with rec:
        history = plan.fit(**fit)
    assert history.cuda_graphs["captures"] == 1 and history.cuda_graphs["replays"] == 6, \
        history.cuda_graphs
    assert history.cuda_graphs["eager_rounds"] == {} and rec.races == []
