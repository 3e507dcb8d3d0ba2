"""The crossbow-graph command line."""

import json
import os
import subprocess
import sys

import pytest

import crossbow_graph as cg

from crossbow_graph.cli import (DEFAULT_LR, DEFAULT_LR_BATCH, OPTIMIZERS, build_parser, main,
                                parse_args, prepare_train)
from crossbow_graph.cli_lm import LM_TARGET_LOSS, lr_factor
from crossbow_graph.cli_machine import apply_machine_defaults

from _reference import rule_lrs

# the layout of the SGD tests below: b = 16, 2 devices × 2 replicas (k·b = 64), SGD with drops
SGD16 = ["--batch-size", "16", "--devices", "2", "--replicas", "2", "--optimizer", "sgd",
         "--lr-schedule", "multistep"]


def test_train_defaults_are_the_main_job():
    """On this CPU (tests/test_cli_machine.py: on a GPU)."""
    args = build_parser().parse_args(["train"])
    assert (args.batch_size, args.optimizer, args.lr_schedule) == (None, None, None)  # the machine's
    assert apply_machine_defaults(args) == []
    assert (args.model, args.dataset, args.batch_size) == ("lenet5", "mnist", 256)
    assert (args.devices, args.replicas) == (None, None)  # 'auto' × 1, or 2 learners for a policy
    assert (args.optimizer, args.lr_schedule, args.epochs, args.target, args.lr) == ("adamw", "onecycle", 3, 0.99, None)
    assert (DEFAULT_LR, DEFAULT_LR_BATCH) == (8e-3, 256)  # --lr's default η and its k·b (AdamW)
    assert OPTIMIZERS["sgd"][1:] == (0.01, 64) and args.lr_milestones == (2, 4)
    assert build_parser().parse_args(["train", "--lr-milestones", ""]).lr_milestones == ()


def test_metrics_flags(tmp_path, capsys):
    """--metrics-every N --measure-rounds R reach fit (windows of N rounds in history.json);
    0 turns metrics off; a bad R is a one-line error before any work."""
    args = build_parser().parse_args(["train"])
    assert (args.metrics_every, args.measure_rounds) == (None, 10)  # None: 50 with a --policy, else off
    assert main(["train", "--measure-rounds", "0", "--quiet"]) == 2
    assert "--measure-rounds 0" in capsys.readouterr().err
    small = ["train", "--train-samples", "512", "--test-samples", "256", "--epochs", "1",
             "--target", "0", "--evals-per-epoch", "1", "--quiet", *SGD16]
    for every, rounds in ((4, [4, 8]), (0, [])):  # 512 samples / (k·b = 64) = 8 rounds
        log = tmp_path / f"log{every}"
        assert main(small + ["--metrics-every", str(every), "--measure-rounds", "2",
                             "--log-dir", str(log)]) == 0
        metrics = json.loads((log / "history.json").read_text())["metrics"]
        assert [m["round"] for m in metrics] == rounds


def test_adaptive_batch_gain_refers_to_the_default_lrs_batch(tmp_path):
    """With the default η, adaptive_batch's gain takes the k·b that η was measured at (SGD: 64
    samples per round) as its reference: at b = 4, k = 4 (16 per round) η falls below the
    default (0.01) by the gain. With --lr the reference is the k·b the run starts at: r = 1 there, η stays."""
    small = ["train", "--train-samples", "512", "--test-samples", "256", "--epochs", "1",
             "--target", "0", "--evals-per-epoch", "1", "--quiet", *SGD16, "--batch-size", "4",
             "--metrics-every", "2", "--measure-rounds", "1", "--lr-milestones", "",
             "--policy", "adaptive_batch:max_batch_size=4"]
    lrs = {}
    for name, extra in (("default", []), ("given", ["--lr", "0.02"])):
        log = tmp_path / name
        assert main(small + extra + ["--log-dir", str(log)]) == 0
        policy = json.loads((log / "history.json").read_text())["policy"]
        lrs[name] = [p["changes"]["lr"] for p in policy if "lr" in p["changes"]]
    # the floor 16/64 is reached where the noise dominates (r = B/B₀); η = η_now·r/r_now then
    # rounds to within a few ulps of it, on either side
    lr0 = OPTIMIZERS["sgd"][1]
    floor = lr0 * 16 / 64 * (1 - 1e-12)
    assert lrs["default"] and all(floor <= lr < lr0 for lr in lrs["default"])
    assert lrs["given"] == []


def test_adaptive_batch_with_the_default_layout_trains_two_learners(capsys):
    """The default layout is one CPU device × 1 replica here; a policy that needs k ≥ 2 learners
    gets 2 replicas on it and a note that says so. An explicit --devices 1 (or --replicas 1) is
    the user's k = 1: the policy's one-line error names the fix."""
    argv = ["train", "--train-samples", "512", "--test-samples", "256", "--epochs", "1", "--quiet",
            "--target", "0", "--evals-per-epoch", "1", "--policy", "adaptive_batch"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "note: AdaptiveBatchSize needs k ≥ 2 learners: training 2 replicas on each of 1 " \
           "device(s)" in captured.err
    assert "epoch 1:" in captured.out and "(m=2, per_replica)" in captured.out
    for layout in (["--devices", "1"], ["--replicas", "1"]):
        assert main(argv + layout) == 2
        err = capsys.readouterr().err
        assert "k = 1" in err and "--devices 2" in err and "note:" not in err


def test_bad_lr_milestones_are_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--lr-milestones", "4,2"])
    assert "increasing" in capsys.readouterr().err


def test_help_explains_every_flag():
    out = subprocess.run([sys.executable, "-m", "crossbow_graph", "train", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for flag in ("--model", "--batch-size", "--devices", "--replicas", "--lr", "--epochs", "--target", "--seed"):
        assert flag in out


def test_unknown_model_is_a_one_line_error(capsys):
    assert main(["train", "--model", "lenet6", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'lenet6'" in err and "lenet5" in err


@pytest.mark.slow
def test_train_stops_at_the_target_and_prints_the_result(capsys):
    assert main(["train", "--epochs", "1", "--target", "0.9", "--evals-per-epoch", "10", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "reached target 0.9" in out and "samples/s" in out and "training seconds" in out


@pytest.mark.parametrize("optimizer,schedule", [("adamw", "onecycle"), ("sgd", "cosine"),
                                                ("rmsprop", "constant")])
def test_optimizer_and_lr_schedule_flags_reach_the_fit(tmp_path, optimizer, schedule):
    """--optimizer builds that torch.optim optimizer (default η per optimizer); --lr-schedule
    onecycle and cosine are LambdaLRs of the run's progress: η per round in history.json, the
    schedule's value × SMA's η factor (k = 4: 1 → 2 over a quarter epoch)."""
    log = tmp_path / "log"
    assert main(["train", "--train-samples", "512", "--test-samples", "256", "--epochs", "2",
                 "--target", "0", "--evals-per-epoch", "1", "--quiet", "--batch-size", "16",
                 "--devices", "2", "--replicas", "2", "--optimizer", optimizer, "--lr-schedule", schedule,
                 "--log-dir", str(log)]) == 0
    rounds = json.loads((log / "history.json").read_text())["lr"]
    assert len(rounds) == 16  # 2 epochs × 512 / (k·b = 64)
    lrs = [lr / f for lr, f in zip(rounds, rule_lrs(1.0, [4] * 16, 16, 512))]  # the schedule's
    peak = OPTIMIZERS[optimizer][1]
    if schedule == "constant":
        assert lrs == [peak] * 16
    elif schedule == "onecycle":  # warm-up from peak/25 for 30 % of the run, then down
        top = lrs.index(max(lrs))
        assert lrs[0] == pytest.approx(peak / 25) and 3 <= top <= 6 and lrs[-1] < lrs[top] / 10
    else:  # linear warm-up for 0.25 epochs from 0.1·peak, then cosine towards 0
        assert lrs[0] == pytest.approx(0.1 * peak) and max(lrs) <= peak and lrs[-1] < 0.05 * peak


def test_bad_optimizer_flags_are_one_line_errors(capsys):
    assert main(["train", "--lr-schedule", "cosine", "--warmup-epochs", "9", "--quiet"]) == 2
    assert "--warmup-epochs 9" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--optimizer", "lbfgs"])
    out = subprocess.run([sys.executable, "-m", "crossbow_graph", "train", "--help"],
                         capture_output=True, text=True, check=True).stdout
    out = " ".join(out.split())  # argparse wraps the help
    assert "--optimizer" in out and "(default: sgd on a GPU, adamw on a CPU)" in out
    assert "(default: multistep on a GPU, onecycle on a CPU)" in out


def test_precision_flag_reaches_the_plan(capsys, monkeypatch):
    """--precision (default fp32, said by --help) compiles the learners' precision; a bad one is
    an argparse usage error naming the choices."""
    assert build_parser().parse_args(["train"]).precision == "fp32"
    helptext = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "--precision" in helptext and "fp32 (default)" in helptext
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--precision", "bf17"])
    err = capsys.readouterr().err
    assert "'bf17'" in err and all(p in err for p in ("fp32", "bf16", "fp16"))
    plans = []
    compile_ = cg.compile
    monkeypatch.setattr(cg, "compile", lambda *a, **kw: plans.append(compile_(*a, **kw)) or plans[-1])
    small = ["train", "--train-samples", "512", "--test-samples", "256", "--epochs", "1",
             "--target", "0", "--evals-per-epoch", "1", "--quiet", "--metrics-every", "0"]
    assert main(small + ["--precision", "bf16"]) == 0
    assert [p.precision for p in plans] == ["bf16"]


def test_sync_diloco_flags_build_a_diloco_plan(capsys):
    """--sync diloco --sync-every H trains with DiLoCo (its default H without the flag, its outer
    SGD from --outer-lr, --outer-momentum); --alpha with it is a one-line error before any work;
    --sync-every sets SMA's τ too."""
    from crossbow_graph.cli import DILOCO_H, prepare_train

    small = ["train", "--train-samples", "256", "--test-samples", "128", "--epochs", "1",
             "--target", "0", "--evals-per-epoch", "1", "--quiet", "--batch-size", "16",
             "--devices", "2"]
    plan, fit = prepare_train(build_parser().parse_args(small + ["--sync", "diloco", "--sync-every", "4"]))
    assert isinstance(plan.sync, cg.DiLoCo) and plan.sync.sync_every == 4
    assert plan.rounds.resolved_executor() == "inline"
    group = plan.rounds.sync_state.optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.7, 0.9, True)  # DiLoCo's
    plan.fit(**fit)
    assert plan.rounds_done == 8 and plan.rounds.sync_state.optimizer.state  # 2 outer steps
    plan, _ = prepare_train(build_parser().parse_args(
        small + ["--sync", "diloco", "--outer-lr", "1", "--outer-momentum", "0"]))  # local SGD
    group = plan.rounds.sync_state.optimizer.param_groups[0]
    assert plan.sync.sync_every == DILOCO_H and (group["lr"], group["momentum"], group["nesterov"]) == (1, 0, False)
    plan, _ = prepare_train(build_parser().parse_args(small + ["--sync-every", "3"]))
    assert plan.sync == cg.SMA(sync_every=3)
    assert main(small + ["--sync", "diloco", "--alpha", "0.5"]) == 2
    assert "--alpha with --sync diloco" in capsys.readouterr().err
    for flags, says in [(["--sync", "diloco", "--central-momentum", "0.5"], "--central-momentum with --sync diloco"),
                        (["--outer-lr", "1"], "--outer-lr with --sync sma"),
                        (["--outer-momentum", "0"], "--outer-momentum with --sync sma"),
                        (["--sync", "diloco", "--outer-momentum", "1.5"], "--outer-momentum 1.5: must be in [0, 1)"),
                        (["--sync", "diloco", "--outer-lr", "0"], "--outer-lr 0: the outer SGD's lr must be > 0")]:
        assert main(small + flags) == 2, flags
        assert says in capsys.readouterr().err, flags


def test_sync_local_sgd_flag_builds_a_local_sgd_plan(capsys):
    """--sync local_sgd --sync-every H trains with LocalSGD (DiLoCo's default H without the flag);
    an SMA or outer-optimizer flag with it is a one-line error before any work."""
    from crossbow_graph.cli import DILOCO_H, prepare_train

    small = ["train", "--train-samples", "256", "--test-samples", "128", "--epochs", "1",
             "--target", "0", "--evals-per-epoch", "1", "--quiet", "--batch-size", "16",
             "--devices", "2"]
    plan, _ = prepare_train(build_parser().parse_args(small + ["--sync", "local_sgd", "--sync-every", "4"]))
    assert plan.sync == cg.LocalSGD(sync_every=4)
    plan, _ = prepare_train(build_parser().parse_args(small + ["--sync", "local_sgd"]))
    assert plan.sync == cg.LocalSGD(sync_every=DILOCO_H)
    for flags, says in [(["--alpha", "0.5"], "--alpha with --sync local_sgd: it is a setting of SMA, "
                                             "EASGD, not of LocalSGD"),
                        (["--outer-lr", "1"], "--outer-lr with --sync local_sgd: it sets an outer "
                                              "optimizer, which LocalSGD has not; add --sync diloco")]:
        assert main(small + ["--sync", "local_sgd"] + flags) == 2, flags
        assert says in capsys.readouterr().err, flags


def test_sync_flags_are_generated_from_each_algorithms_fields(capsys):
    """--sync easgd with --alpha and --centre-rate builds EASGD from its fields' flags (no CLI
    code names it); a field of another algorithm is refused; an algorithm added to
    engine/sync's ALGORITHMS gets --sync and a flag per number field by itself."""
    import dataclasses

    from crossbow_graph import cli_sync
    from crossbow_graph.cli import prepare_train
    from crossbow_graph.engine import sync as sync_package

    small = ["train", "--train-samples", "256", "--test-samples", "128", "--epochs", "1",
             "--target", "0", "--evals-per-epoch", "1", "--quiet", "--batch-size", "16",
             "--devices", "2"]
    plan, _ = prepare_train(build_parser().parse_args(
        small + ["--sync", "easgd", "--alpha", "0.25", "--centre-rate", "0.5", "--sync-every", "2"]))
    assert plan.sync == cg.EASGD(alpha=0.25, centre_rate=0.5, sync_every=2)
    assert main(small + ["--sync", "local_sgd", "--centre-rate", "0.5"]) == 2
    assert ("--centre-rate with --sync local_sgd: it is a setting of SMA, EASGD, not of LocalSGD; "
            "drop --centre-rate, or use --sync sma") in capsys.readouterr().err
    assert main(small + ["--sync", "easgd", "--centre-rate", "1.5"]) == 2  # EASGD's own check
    assert "EASGD(centre_rate=1.5): a moving rate must be in (0, 1]" in capsys.readouterr().err

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class PullSGD(cg.SMA):
        """A new algorithm.

        Attributes:
            pull_steps: rounds a pull lasts (≥ 1).
            sync_every: τ.
        """

        pull_steps: int = 3

    algorithms = sync_package.ALGORITHMS
    try:
        sync_package.ALGORITHMS = algorithms + (PullSGD,)
        parser = build_parser()
        args = parser.parse_args(small + ["--sync", "pull_sgd", "--pull-steps", "5"])
        assert cli_sync.sync_of(args) == PullSGD(pull_steps=5)
        train = next(a for a in parser._actions if a.dest == "command").choices["train"]
        helps = {a.option_strings[0]: a.help for a in train._actions if a.option_strings}
        assert helps["--pull-steps"] == "pull_sgd: rounds a pull lasts (≥ 1)"
    finally:
        sync_package.ALGORITHMS = algorithms


def test_sync_dtype_without_torchrun_says_it_has_no_effect(capsys):
    small = ["train", "--train-samples", "256", "--test-samples", "128", "--epochs", "1",
             "--target", "0", "--evals-per-epoch", "1", "--quiet", "--batch-size", "64"]
    assert main(small + ["--sync-dtype", "bf16"]) == 0
    assert "--sync-dtype bf16 applies under torchrun only" in capsys.readouterr().err


def test_max_grad_norm_flag_reaches_fit(tmp_path, capsys):
    """--max-grad-norm (off by default, as --help says) reaches fit: the History records the
    norm the learners were clipped to; a value that is not a positive number is an argparse
    usage error naming the flag."""
    assert build_parser().parse_args(["train"]).max_grad_norm is None
    helptext = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "--max-grad-norm" in helptext and "(default: no clipping)" in helptext
    for bad in ("0", "-1", "inf", "nan", "one"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["train", "--max-grad-norm", bad])
        err = capsys.readouterr().err
        assert "--max-grad-norm" in err and f"'{bad}': give a positive number" in err
    log = tmp_path / "log"
    assert main(["train", "--train-samples", "256", "--test-samples", "128", "--epochs", "1",
                 "--target", "0", "--evals-per-epoch", "1", "--quiet", "--batch-size", "64",
                 "--max-grad-norm", "0.5", "--log-dir", str(log)]) == 0
    assert json.loads((log / "history.json").read_text())["max_grad_norm"] == 0.5


def test_fault_tolerance_flags_without_fault_tolerant_are_a_one_line_error(capsys):
    """--lighthouse, --replica-group or --min-replicas ≠ 1 without --fault-tolerant: exit 2 before
    any data is read, naming the flags; --data-shard alone shards an ordinary run."""
    from crossbow_graph.cli import prepare_train

    for flags in (["--lighthouse", "http://127.0.0.1:1"], ["--replica-group", "g5"],
                  ["--min-replicas", "2"]):
        assert main(["train", "--dataset", "nonexistent"] + flags) == 2, flags  # before the data
        err = capsys.readouterr().err
        assert err == f"crossbow-graph train: error: {flags[0]} without --fault-tolerant: they set " \
                      "up a torchft replica group; add --fault-tolerant, or drop them\n", flags
    _, fit = prepare_train(build_parser().parse_args(
        ["train", "--train-samples", "256", "--test-samples", "128", "--data-shard", "1/2"]))
    assert len(fit["train_dataset"]) == 128


def test_ssgd_with_another_optimizer_is_a_one_line_error_naming_the_flag(capsys):
    """--sync ssgd with AdamW (the language model's default optimizer) or RMSprop: exit 2 before
    any data is read, naming --optimizer sgd, the flag that fixes it."""
    for given, name in ((["--dataset", "nonexistent", "--optimizer", "adamw"], "adamw"),
                        (["--dataset", "nonexistent", "--optimizer", "rmsprop"], "rmsprop"),
                        (["--model", "gpt", "--dataset", "fortunes"], "adamw")):
        assert main(["train", "--sync", "ssgd"] + given) == 2, given
        err = capsys.readouterr().err
        assert err == f"crossbow-graph train: error: --sync ssgd with --optimizer {name}: S-SGD " \
                      "steps with SGD only; add --optimizer sgd, or use another --sync (sma, the " \
                      "default)\n", given


def test_share_second_moment_with_another_optimizer_is_a_one_line_error_naming_the_flag(capsys):
    """--share-second-moment with SGD or RMSprop: exit 2 before any data is read, naming
    --optimizer adamw, the flag that fixes it (not the Python keyword)."""
    for name in ("sgd", "rmsprop"):
        assert main(["train", "--dataset", "nonexistent", "--share-second-moment",
                     "--optimizer", name]) == 2, name
        err = capsys.readouterr().err
        assert err == f"crossbow-graph train: error: --share-second-moment with --optimizer {name}: " \
                      "the learners share Adam's second moment; add --optimizer adamw (or adam), " \
                      "or drop --share-second-moment\n", name
    assert main(["train", "--dataset", "nonexistent", "--sync", "ssgd", "--share-second-moment"]) == 2
    assert "--share-second-moment with --sync ssgd: it is a setting of SMA, not of SSGD; drop " \
           "--share-second-moment" in capsys.readouterr().err
    plan, _ = prepare_train(build_parser().parse_args(
        ["train", "--train-samples", "64", "--test-samples", "32", "--share-second-moment",
         "--optimizer", "adamw", "--replicas", "2"]))
    assert plan.settings.sync.shares_second_moment


def test_fault_tolerant_without_torchft_is_a_one_line_error_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    assert main(["train", "--fault-tolerant", "--lighthouse", "http://127.0.0.1:1", "--replicas", "2",
                 "--train-samples", "256", "--test-samples", "128", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("crossbow-graph train: error: ") and err.count("\n") == 1
    assert "pip install 'crossbow_graph[ft]'" in err and "Traceback" not in err


def test_an_error_in_the_fit_is_printed_on_a_line_of_its_own_below_the_progress_bar(monkeypatch, capsys):
    """The bar is cleared when the fit fails, so the CLI's error line (read as a terminal shows
    it: \\r returns to the line's start) is the error alone."""
    from crossbow_graph import cli_train
    from crossbow_graph.errors import DistributedError

    class LoseThePeers(cg.Hook):
        def after_round(self, ctx):
            if ctx.round_in_epoch == 2:
                raise DistributedError("the peers are gone", task_id="sync", device="cpu",
                                       round_index=2)

    prepare = cli_train.prepare_train

    def prepare_failing(args):
        plan, fit = prepare(args)
        return plan, {**fit, "hooks": [LoseThePeers()]}

    monkeypatch.setattr(cli_train, "prepare_train", prepare_failing)
    assert main(["train", "--train-samples", "256", "--test-samples", "128", "--batch-size", "16",
                 "--epochs", "1", "--target", "0"]) == 2
    err = capsys.readouterr().err
    assert "epoch 1" in err  # the bar was shown
    assert err.replace("\r", "\n").splitlines()[-1].startswith("crossbow-graph train: error: the peers")


def test_bad_fault_tolerance_set_ups_are_one_line_errors(monkeypatch, capsys):
    """A malformed --data-shard, and --fault-tolerant with no Lighthouse address (torchft
    installed): exit 2 with the fix in one line."""
    small = ["train", "--train-samples", "256", "--test-samples", "128", "--quiet"]
    for spec in ("2/2", "1-2", "a/b"):
        assert main(small + ["--data-shard", spec]) == 2
        assert f"--data-shard {spec}: use I/N with 0 ≤ I < N" in capsys.readouterr().err
    pytest.importorskip("torchft", reason="torchft is the 'ft' extra")
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    assert main(small + ["--fault-tolerant", "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no Lighthouse address" in err and "TORCHFT_LIGHTHOUSE" in err


# --model gpt --dataset fortunes: tiny caps (16 training windows, 4 validation windows)
GPT_TINY = ["--train-samples", "16", "--test-samples", "4", "--evals-per-epoch", "2", "--quiet"]
needs_fortunes = pytest.mark.skipif(
    not all(os.path.isfile(os.path.join(cg.datasets.FORTUNES_DIR, f))
            for f in cg.datasets.FORTUNES_FILES),
    reason="Debian packages fortunes and fortunes-min not installed (bash scripts/setup.sh)")


@needs_fortunes
@pytest.mark.parametrize("named", [["--model", "gpt"], ["--dataset", "fortunes"]])
def test_gpt_on_fortunes_takes_the_language_models_defaults(named):
    """Either flag names the workload; the flags left out take cli_lm.LM_DEFAULTS, the fit stops
    at the target validation loss and not at a test accuracy, the cosine runs over tokens."""
    args = parse_args(["train", *named, *GPT_TINY, "--lr-schedule-tokens", "4096"])
    plan, fit = prepare_train(args)
    assert (args.model, args.dataset, args.epochs) == ("gpt", "fortunes", 1)
    assert (plan.batch_size, plan.num_learners) == (4, 1)
    group = plan.optimizer.param_groups[0]
    assert type(plan.optimizer).__name__ == "AdamW"
    assert (group["initial_lr"], group["betas"], group["weight_decay"]) == (1e-3, (0.9, 0.99), 0.1)
    assert (fit["target_loss"], fit["target_accuracy"]) == (LM_TARGET_LOSS, None)
    assert fit["metric_fn"] is cg.models.token_accuracy and len(fit["eval_dataset"]) == 4
    history = plan.fit(**fit)
    assert history.tokens_per_sample == 128 and len(history.evals) == 2
    steps = 4096 // (4 * 128)  # 8 rounds of the schedule; 4 rounds ran
    assert history.lr == pytest.approx([1e-3 * lr_factor(r, steps) for r in range(4)], rel=1e-12)


@needs_fortunes
def test_flags_given_with_gpt_override_its_defaults():
    args = parse_args(["train", "--model", "gpt", "--epochs", "3", "--batch-size", "2",
                       "--target", "0.5", "--optimizer", "sgd", "--lr", "0.3", "--momentum", "0"])
    plan, fit = prepare_train(args)
    assert (args.epochs, plan.batch_size, fit["target_accuracy"]) == (3, 2, 0.5)
    assert fit["target_loss"] == LM_TARGET_LOSS
    group = plan.optimizer.param_groups[0]
    assert (type(plan.optimizer).__name__, group["initial_lr"], group["momentum"]) == ("SGD", 0.3, 0)


@needs_fortunes
def test_gpt_prints_loss_perplexity_tokens_per_s_and_a_sample(capsys):
    assert main(["train", "--model", "gpt", *GPT_TINY, "--sample", "24", "--target-loss", "9"]) == 0
    out = capsys.readouterr().out
    assert "tokens 1,024: validation loss " in out and "(perplexity " in out
    final = next(line for line in out.splitlines() if line.startswith("final validation loss"))
    assert "reached target 9) after 1,024 tokens (0.50 epochs)" in final  # the first evaluation
    assert "tokens/s" in final and "samples/s" in final
    assert "sample of 24 bytes from z (temperature 0.8):" in out


def test_gpt_with_an_image_dataset_or_sample_with_lenet5_is_a_one_line_error(capsys):
    assert main(["train", "--model", "gpt", "--dataset", "mnist", "--quiet"]) == 2
    assert "use --model gpt --dataset fortunes" in capsys.readouterr().err
    assert main(["train", "--sample", "10", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--sample 10 with --model lenet5" in err and "language model" in err


def test_help_lists_the_language_model():
    out = subprocess.run([sys.executable, "-m", "crossbow_graph", "train", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for text in ("or gpt, the language model", "--target-loss", "--sample N", "fortunes"):
        assert text in out
