"""The benchmarks are scripts of bench/, run from a checkout; the CLI has no ``bench`` subcommand."""

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

from crossbow_graph.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_cli_has_train_and_inspect_only(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "tta"])
    assert "invalid choice: 'bench'" in capsys.readouterr().err
    assert build_parser().parse_args(["inspect"]).command == "inspect"


def test_tta_script_help_lists_the_systems():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "tta.py"), "--help"],
                         capture_output=True, text=True, check=True).stdout
    for system in ("plain-B32", "localsgd", "crossbow-r2", "crossbow-auto", "crossbow-ssgd"):
        assert system in out


def test_tta_baselines_smoke_runs_one_plain_recipe(tmp_path, capsys):
    """bench/tta_baselines.py --smoke: one plain-PyTorch recipe for one epoch of a subset, in a
    ``--one`` subprocess as every run of the sweep; its JSON holds the run's evaluations at the
    bench/tta.py cadence (here 2 per epoch) and the summary."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import tta_baselines

    out = tmp_path / "smoke.json"
    assert tta_baselines.main(["--smoke", "--threads", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    (run,) = data["runs"]
    assert run["system"] == "sgd-multistep:64:0.04" and "error" not in run["result"]
    assert [e["epoch"] for e in run["result"]["evals"]] == [0.5, 1.0]
    assert run["result"]["samples"] == 2048 // 64 * 64 and run["result"]["threads"] == 1
    assert data["summary"]["systems"]["sgd-multistep:64:0.04"]["runs"] == 1
    assert "sgd-multistep:64:0.04" in capsys.readouterr().out
    assert len(tta_baselines.grid()) == 3 * 4 * 3  # recipes × B × lrs
    assert tta_baselines.parse_config("adamw-onecycle:128:0.004") == dict(
        recipe="adamw-onecycle", batch=128, lr=0.004)


def test_tta_runs_the_cli_itself_for_a_cli_system():
    """bench/tta.py's ``cli:FLAGS`` systems (and ``crossbow-cli``, the defaults) run
    ``crossbow-graph train FLAGS`` through cli.prepare_train: the same plan and schedule."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import tta

    assert tta.system_spec("crossbow-cli") == {"kind": "cli", "argv": []}
    spec = tta.system_spec("cli:--train-samples 512 --test-samples 256 --optimizer adamw")
    out = tta.run_cli(spec, None, None, model_name="lenet5", seed=0, max_epochs=1, target=0.99,
                      evals_per_epoch=2)
    assert "--optimizer" in out["argv"] and len(out["evals"]) == 2
    assert out["samples"] == 512 and out["final_replicas_per_device"] == 1  # the CLI default m
    with pytest.raises(KeyError):
        tta.system_spec("crossbow-r9")


def test_gpu_acceptance_smoke_runs_every_section_on_the_cpu(tmp_path):
    """bash bench/gpu_acceptance.sh --smoke: every section of the GPU acceptance check end to end
    on the CPU (tiny sizes, Triton interpreted, gloo, the race probes on a RaceRecorder); it
    exits 0, its summary lists every section with a status and the checks only a GPU can make,
    and it writes at most 8 files. The smoke run is untimed (no section limit binds on a loaded
    machine); its graph cells replay."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import acceptance_report

    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable,
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("SECTIONS", None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_acceptance.sh"), "--smoke"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    log = (out / "acceptance.log").read_text() if (out / "acceptance.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:] + log[-4000:]
    summary = (out / "summary.md").read_text()
    for _, label in acceptance_report.SECTIONS:
        status = summary.split(f"| {label} | ")[1].split(" |")[0]
        assert status in ("pass", "skip"), (label, status, summary)
    for label in ("2. gpu-marked tests: graph rounds, device data", "9. the other gpu-marked tests"):
        assert f"| {label} | skip |" in summary  # no GPU here: every gpu test skipped
    assert "**Overall: PASS**" in summary and "Checks only a GPU can make" in summary
    gpu_tests = {"tests-early": 0, "tests-late": 0}  # gpu-marked tests only, each skipped here
    for name in gpu_tests:
        suite = ET.parse(out / f"pytest-{name}.xml").getroot().find("testsuite")
        gpu_tests[name] = int(suite.get("tests"))
        assert int(suite.get("skipped")) == gpu_tests[name] > 0
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert files == ["acceptance.log", "pytest-tests-early.xml", "pytest-tests-late.xml",
                     "results.json", "results.md", "summary.md"], files
    results = json.loads((out / "results.json").read_text())
    assert results["mode"] == "smoke"
    assert [t["met"] for t in results["targets"]] == [None] * 4  # every target: GPU only
    precompiled = results["sections"]["env"]["data"]["precompile"]  # Triton's cache may have it
    assert precompiled["compiled"] + precompiled["cached"] == 1 and not precompiled["failed"]
    assert results["sections"]["races"]["data"]["sleep_cycles"] == 0  # simulated streams
    assert results["sections"]["nccl"]["data"]["backend"] == "gloo"
    decisive = results["sections"]["decisive"]["data"]["cells"][0]
    assert decisive["per_replica graphs m=4"] > 0 and "replayed" in decisive["per_replica graphs m=4 graphs"]
    assert int(decisive["fused graphs m=4 graphs"].split(", ")[1].split()[0]) > 0  # replays
    memory = results["sections"]["memory"]["data"]
    assert memory["steady"]["replays"] > 0 and memory["failed"]["captures"] == 0
    assert results["sections"]["profile"]["data"]["fused, eager rounds, m=4"]["kernels_per_round"] > 0
    assert results["sections"]["w1"]["data"]["runs"]["SMA m=4"]["replicas_per_device"] == 4


def test_gpu_acceptance_sections_fit_the_gpu_machines_limits():
    """The sections' time limits add up to at most 360 s (with the machine's start, ≤ 7
    minutes), each section's at most 600 s (one command's limit); the sanitizer's and the
    torchrun rank's child processes get ≥ 25 s inside their sections' limits; an unknown name in
    SECTIONS is refused before anything runs, naming the sections."""
    text = open(os.path.join(ROOT, "bench", "gpu_acceptance.sh")).read()
    table = text.split("declare -A LIMIT=(")[1].split(")")[0]
    limits = {name: int(s) for name, s in re.findall(r"\[([\w-]+)\]=(\d+)", table)}
    order = text.split("ORDER=(")[1].split(")")[0].split()
    assert sorted(limits) == sorted(order) and len(order) == 12
    assert sum(limits.values()) <= 360 and max(limits.values()) <= 600, limits
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import acceptance_checks

    for name, timeout in (("races", acceptance_checks.sanitizer_timeout),
                          ("nccl", acceptance_checks.rank_timeout)):  # python's budget: limit − 8
        assert 25 <= timeout(limits[name] - 8) <= limits[name] - 3, name
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_acceptance.sh"), "--smoke"],
                          env={**os.environ, "SECTIONS": "w1 nonsense"}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 3 and "unknown section 'nonsense'" in proc.stdout
    assert "tests-early decisive w1" in proc.stdout


def test_gpu_acceptance_report_names_a_miss_with_its_profile_and_skips_unselected(tmp_path):
    """On a GPU: a missed target fails its section and the summary lists it with the profile of
    its system (kernels and host µs per round, the GPU's busy share); sections SECTIONS left out
    are "not selected" and do not fail the run."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import acceptance_report
    from acceptance_common import Section

    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    env = Section("env", work)
    env.data = {"card": {"name": "NVIDIA H100 80GB HBM3", "graph_node_us": 2.0, "copy_GBps": 2900.0}}
    decisive = Section("decisive", work)
    decisive.target("per_replica graph rounds, m = 4, LeNet-5 b = 16", 150e3, 160e3,
                    unit="samples/s", scale="scaled", gpu=True, explain="per_replica, graph rounds, m=4")
    profile = Section("profile", work)
    profile.data = {"per_replica, graph rounds, m=4": {"kernels_per_round": 180.0,
                                                       "host_us_per_round": 320.0, "gpu_busy_share": 0.45}}
    for sec in (env, decisive, profile):
        assert sec.write(quiet=True) == (1 if sec is decisive else 0)
        (work / f"{sec.name}.rc").write_text("0 1.0\n" if sec is not decisive else "1 1.0\n")
    args = ["--work", str(work), "--out", str(out), "--mode", "gpu", "--sections", "decisive profile"]
    assert acceptance_report.main(args + ["--final"]) == 1
    summary = (out / "summary.md").read_text()
    assert "## Targets on NVIDIA H100 80GB HBM3" in summary
    assert ("MISS: per_replica graph rounds, m = 4, LeNet-5 b = 16: per_replica, graph rounds, m=4: "
            "180 kernels and 320 host µs per round, GPU busy 45%; host-bound") in summary
    assert "| 4. W1 time to 99.0 % on real MNIST | not selected |" in summary
    assert "**Overall: FAIL — 3. LeNet-5 at b = 16 in every system** (1 target(s) missed)" in summary
    decisive.failures.clear()
    decisive.data["targets"][0].update(value=170e3, met=True)
    decisive.write(quiet=True)
    (work / "decisive.rc").write_text("0 1.0\n")
    assert acceptance_report.main(args + ["--final"]) == 0


def test_gpu_acceptance_section_cut_short_keeps_its_finished_cells(tmp_path, monkeypatch):
    """A section stopped by SIGINT (``timeout --signal=INT``) writes the cells it finished and
    fails naming the cut; a graph cell with zero replays fails."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu_acceptance as ga
    from acceptance_common import run_cell

    def section(args, sec):
        cell = {"model": "lenet5", "b": 16}
        sec.data["cells"] = [cell]
        run_cell(sec, cell, "plain eager", lambda: 123.0)
        run_cell(sec, cell, "fused graphs m=4", lambda: {"rate": 5.0, "captures": 1, "replays": 0,
                                                         "graph_failure": None})
        raise KeyboardInterrupt

    monkeypatch.setitem(ga.SECTIONS, "decisive", section)
    assert ga.main(["decisive", "--work", str(tmp_path), "--smoke"]) == 1
    doc = json.loads((tmp_path / "decisive.json").read_text())
    assert doc["status"] == "fail" and doc["data"]["cells"][0]["plain eager"] == 123.0
    assert any("0 replays" in n for n in doc["notes"]) and any("cut short" in n for n in doc["notes"])


def test_diloco_w1_variants_and_summary():
    """bench/diloco_w1.py runs the CLI's flags per variant (local SGD: DiLoCo with outer lr 1, no
    momentum) and summarises epochs to 99.0 % with a miss counted as +∞."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import diloco_w1

    assert diloco_w1.VARIANTS["diloco-16"] == ["--sync", "diloco", "--sync-every", "16"]
    assert diloco_w1.VARIANTS["local-sgd-4"][-4:] == ["--outer-lr", "1", "--outer-momentum", "0"]
    args = build_parser().parse_args(["train", *diloco_w1.BASE, *diloco_w1.VARIANTS["local-sgd-4"]])
    assert (args.sync, args.sync_every, args.outer_lr, args.outer_momentum) == ("diloco", 4, 1.0, 0.0)
    rows = [dict(variant="diloco-4", seed=s, reached=e is not None, epochs_to_accuracy=e,
                 final_accuracy=0.99, best_accuracy=0.991, rounds=10) for s, e in
            [(0, 2.0), (1, None), (2, None)]]
    summary = diloco_w1.summarise(rows)["variants"]["diloco-4"]
    assert summary["reached"] == "1/3" and summary["median_epochs_to_99"] is None
    assert "| diloco-4 |" in diloco_w1.table(diloco_w1.summarise(rows))



def _without_matplotlib(statement: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``statement`` in a fresh interpreter where ``import matplotlib`` fails, with bench/
    on the path and ``args`` as ``sys.argv[1:]``."""
    code = "import sys; sys.modules['matplotlib'] = None; sys.path.insert(0, %r); " % os.path.join(
        ROOT, "bench") + statement
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=120)


def test_report_prints_its_tables_without_matplotlib():
    """bench/report.py is text only: with matplotlib unimportable it prints the robustness table
    (whose title reads the run length) and the epochs table; bench/plots.py, asked for a figure,
    says what to install."""
    results = os.path.join(ROOT, "bench", "results")
    proc = _without_matplotlib("import report; sys.exit(report.main(sys.argv[1:]))",
                               "--robustness", os.path.join(results, "stat_eff-robustness.json"),
                               "--epochs", os.path.join(results, "stat_eff-epochs.json"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| system | b=4 |" in proc.stdout and "| crossbow |" in proc.stdout
    assert "after 1 epoch(s) of the first 12,000 training samples" in proc.stdout
    assert "| system | k | epochs to 99.0% |" in proc.stdout
    plots = _without_matplotlib("import plots")
    assert plots.returncode != 0 and "plots need matplotlib: pip install" in plots.stderr


def test_stat_eff_robustness_runs_both_systems_to_the_end(tmp_path):
    """``bench/stat_eff.py --robustness`` on 320 MNIST images at b = 16: both systems train the
    whole epoch (no target stops them, none is rejected) and report a final accuracy."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import stat_eff
    out = str(tmp_path / "robustness.json")
    assert stat_eff.robustness(out, epochs=1, train_samples=320, bs=(16,)) == 0
    with open(out) as f:
        runs = json.load(f)["runs"]
    assert [r["system"] for r in runs] == ["crossbow", "crossbow-lr-as-set", "plain"]
    for r in runs:
        assert "error" not in r["result"], r["result"]
        assert 0.0 <= r["result"]["final_accuracy"] <= 1.0
    import report
    assert "| crossbow-lr-as-set |" in report.robustness_table(out)  # the report reads it


@pytest.mark.skipif(not os.path.isfile("/usr/share/games/fortunes/fortunes"),
                    reason="Debian packages fortunes and fortunes-min not installed (bash "
                           "scripts/setup.sh installs them)")
def test_lm_baselines_smoke_records_validation_loss_against_tokens(tmp_path, capsys):
    """bench/lm_baselines.py --smoke: plain AdamW and SGD, SMA (k = 2, b = 2), DiLoCo and LocalSGD
    on a one-layer GPT for 4,096 tokens each, in ``--one`` subprocesses as every run (two at a time,
    ``--jobs 2``: the runs listed in their order all the same): the validation loss at the start
    and every 2,048 tokens, training seconds and tokens/s, the table; --report writes the summary
    and the plot."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import lm_baselines

    out = tmp_path / "smoke.json"
    assert lm_baselines.main(["--smoke", "--jobs", "2", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["config"] for r in runs] == ["adamw:b=8:lr=3e-3", "sgd:b=2:lr=0.3",
                                           "sma-adamw:k=2:b=2:lr=3e-3", "diloco-adamw:k=2:b=2:lr=3e-3:H=2",
                                           "localsgd-adamw:k=2:b=2:lr=3e-3:H=2"]
    for run in runs:
        assert [e["tokens"] for e in run["evals"]] == [0, 2048, 4096]
        assert run["evals"][-1]["val_loss"] < run["evals"][0]["val_loss"] and run["tokens_per_s"] > 0
    assert "sma-adamw:k=2:b=2:lr=3e-3" in capsys.readouterr().out
    summary, png = tmp_path / "summary.json", tmp_path / "lm.png"
    assert lm_baselines.main(["--report", str(out), "--target", "4.5", "--out", str(summary),
                              "--plot", str(png)]) == 0
    assert set(json.loads(summary.read_text())["summary"]) == {r["config"] for r in runs}
    assert png.stat().st_size > 1000
    assert len(lm_baselines.grid()) == 4 * 3 and lm_baselines.grid()[:3] == [
        "adamw:b=8:lr=0.00071", "adamw:b=8:lr=0.0014", "adamw:b=8:lr=0.0028"]
    assert lm_baselines.lr_factor(0, 100) == pytest.approx(0.2)  # warm-up of 5 steps
    assert lm_baselines.lr_factor(99, 100) == pytest.approx(0.1)  # the cosine's end


def test_noise_scale_gpt_estimate_is_the_single_window_gradients_sample_variance_over_the_mean():
    """bench/noise_scale_gpt.py's two-batch estimate from K single-window gradients (b = 1,
    B = K) is tr Σ = the sum of their unbiased sample variances and |G|² = |ḡ|² − tr Σ/K (oracle:
    each window's gradient by backward, one at a time); the model's weights and grads are left as they were."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import noise_scale_gpt
    from crossbow_graph import datasets, models

    torch.manual_seed(0)
    model = models.gpt(n_layer=1, n_head=2, n_embd=16, block_size=16)
    text = datasets.TextDataset(torch.randint(0, 256, (16 * 40 + 1,)), 16, "t")
    before = [p.detach().clone() for p in model.parameters()]
    est = noise_scale_gpt.noise_scale(model, text, 8, torch.Generator().manual_seed(3))
    assert all(torch.equal(a, b) and b.grad is None for a, b in zip(before, model.parameters()))
    x, y = text.tensors
    grads = []
    for i in torch.randint(len(x), (8,), generator=torch.Generator().manual_seed(3)).tolist():
        model.zero_grad()
        models.lm_loss(model(x[i:i + 1]), y[i:i + 1]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).double())
    g = torch.stack(grads)
    trace = float(g.var(dim=0, unbiased=True).sum())
    assert est["trace_sigma"] == pytest.approx(trace, rel=1e-4)
    assert est["grad_sq"] == pytest.approx(float(g.mean(0).pow(2).sum()) - trace / 8, rel=1e-4)
    assert est["b_noise"] == pytest.approx(est["trace_sigma"] / est["grad_sq"])


def test_lm_baselines_bound_sets_alpha_to_a_share_of_the_pull_bound():
    """``bound=f``: SMA's α = f·2(1 + μ_z)/(1 + k + μ_z) at μ_z = 0.9 (design §2), at most 1;
    without it α = 1/k; k = 1 leaves α unset."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import lm_baselines

    assert lm_baselines._alpha(lm_baselines.parse("sma-adamw:k=4:b=1:bound=0.8")) == pytest.approx(
        0.8 * 2 * 1.9 / 5.9)
    assert lm_baselines._alpha(lm_baselines.parse("sma-adamw:k=2:b=1:bound=1.5")) == 1.0
    assert lm_baselines._alpha(lm_baselines.parse("sma-sgd:k=8:b=1")) == 1 / 8
    assert lm_baselines._alpha(lm_baselines.parse("sma-sgd:k=1:b=1:bound=0.8")) is None
    assert lm_baselines.parse("diloco-adamw:k=4:b=1:olr=0.1")["olr"] == 0.1  # DiLoCo's outer lr
    for bad in ("sma-adamw:k=4:b=1:olr=0.1", "diloco-sgd:k=4:b=1:olr=-1", "diloco-sgd:k=4:olr=nan"):
        with pytest.raises(ValueError, match="olr"):
            lm_baselines.parse(bad)
    assert lm_baselines.parse("sma-adamw:k=8:b=1:share=1")["share"] == 1  # one second moment
    for bad in ("adamw:b=4:share=1", "sma-sgd:k=4:b=1:share=1", "sma-adamw:k=1:b=1:share=1"):
        with pytest.raises(ValueError, match="share"):
            lm_baselines.parse(bad)


@pytest.mark.parametrize("workload", ["w1", "fm", "gpt"])
def test_stat_eff_summary_is_derived_from_its_committed_curves(workload, tmp_path):
    """bench/stat_eff.py's committed summary is what its committed curves give: every run's
    epochs to each target re-read from its evaluations, S-SGD's m re-chosen, the medians and
    ratios recomputed (no raw runs: an empty runs folder); the GPT's from W4's summary."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import stat_eff

    path = os.path.join(ROOT, "bench", "results", f"stat_eff_{workload}.json")
    if not os.path.exists(path):
        pytest.skip(f"no committed summary for {workload}")
    with open(path) as f:
        committed = json.load(f)
    committed.pop("commands")
    if workload == "gpt":
        summary = stat_eff.gpt_summary()
        assert json.loads(json.dumps(summary)) == committed
        assert all(rows["1"]["ratio_to_k1"] in (1.0, None) for rows in summary["lines"].values())
        return
    runs = stat_eff.collect(workload, runs_dir=str(tmp_path))
    summary = stat_eff.summarise(runs, workload)
    assert json.loads(json.dumps(summary)) == committed  # tuples as JSON lists
    assert summary["systems"]["sma"]["1"][summary["target"]]["ratio_to_k1"] in (1.0, None)
    # SMA's defaults, by run name: SMA()'s rule (--alpha default) from k = 2 on, and up to k = 4,
    # where SMA() is CROSSBOW's update at 0.8 of the pull's bound, --alpha bound:0.8 too; plain SGD
    # at k = 1; α = 1/k (ainv) and bound:0.8 from k = 5 are configurations of their own
    lr = stat_eff.WORKLOADS[workload]["lr"]
    for r in (r for r in runs if r["system"] == "sma"):
        rules = ["ainv-mu0.9-s1"] if r["k"] == 1 else ["adefault-mu0.9-sengine"] + (
            ["abound_0.8-mu0.9-sengine"] if r["k"] <= 4 else [])
        named = any(f"-b16-lr{lr:g}-{rule}-w0-seed" in r["name"] for rule in rules)
        assert ("config" not in r) == named, r["name"]
    assert any(r.get("config", "").endswith("-abound_0.8-mu0.9-sengine-w0") for r in runs)
    assert any(r["config"].endswith("-ainv-mu0.9-sengine-w0") for r in runs if r.get("config"))


def test_stat_eff_tunes_sma_by_its_fastest_configuration_at_seed_0():
    """The line of SMA at its best (α, η) per k takes, of the defaults and every other SMA
    configuration at η₁ and b = 16, the fastest at seed 0 to the first target, with all its seeds;
    the defaults on a tie; a configuration at another η₁ or of another system is no candidate."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import stat_eff

    def run(name, system, k, seed, epochs, config=None):
        hit = None if epochs is None else dict(epochs=epochs, samples=int(epochs * 60000))
        r = dict(name=f"w1-{name}-seed{seed}", system=system, k=k, seed=seed, lr_mult=None,
                 max_epochs=6, best_accuracy=0.99 if hit else 0.97, evals=[],
                 to_target={"0.985": hit, "0.99": None})
        return r if config is None else {**r, "config": config}

    strong, weak = "sma-k16-b16-lr0.01-ainv_3-mu0.9-sengine-w0", "sma-k16-b16-lr0.01-ainv_2-mu0.9-sengine-w0"
    other_lr, local = "sma-k16-b16-lr0.02-ainv_3-mu0.9-sengine-w0", "localsgd-k16-b16-lr0.01-s4-w0.25-H4"
    runs = [run("sma-k1", "sma", 1, s, 2.0) for s in range(3)]
    runs += [run("sma-k16", "sma", 16, s, e) for s, e in enumerate((3.0, 2.5, None))]
    runs += [run("sma-k4", "sma", 4, s, 1.5) for s in range(3)]
    runs += [run(strong, "sma", 16, s, e, strong) for s, e in enumerate((2.5, 3.5, 2.0))]
    runs += [run(weak, "sma", 16, 0, 2.75, weak), run(other_lr, "sma", 16, 0, 1.0, other_lr),
             run(local, "localsgd", 16, 0, 1.0, local), run(weak, "sma", 4, 0, 1.5, weak)]
    tuned = stat_eff.summarise(runs, "w1")["systems"]["sma_tuned"]
    assert tuned["16"]["config"] == strong and tuned["16"]["seeds"] == [0, 1, 2]
    assert tuned["16"]["0.985"]["epochs"] == [2.5, 3.5, 2.0]
    assert tuned["16"]["0.985"]["median"] == 2.5 and tuned["16"]["0.985"]["ratio_to_k1"] == 1.25
    assert tuned["4"]["config"] == "defaults" and tuned["4"]["seeds"] == [0, 1, 2]  # a tie


def test_lm_baselines_report_keeps_one_run_per_seed_and_carries_summary_rows(tmp_path, capsys):
    """``--report`` over files that repeat a run counts it once (the last file's); a row that only
    an earlier summary holds is carried with its seeds, and its seeds the runs lack join a row
    the runs hold; the file it writes reads back to the same summary and runs."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import lm_baselines

    def run(config, seed, loss):
        return dict(config=config, seed=seed, tokens_per_s=1000.0,
                    evals=[dict(tokens=0, train_seconds=0.0, val_loss=3.0),
                           dict(tokens=4096, train_seconds=2.0, val_loss=loss)])

    old = dict(target=2.4, summary={
        "sgd:b=4:lr=1": dict(seeds=[0], tokens=[None], seconds=[None], final=[3.5], tps=[900.0]),
        "adamw:b=4:lr=1e-3": dict(seeds=[2], tokens=[8192], seconds=[4.0], final=[2.3],
                                  tps=[800.0])})
    first = dict(runs=[run("adamw:b=4:lr=1e-3", 0, 2.6)])
    second = dict(runs=[run("adamw:b=4:lr=1e-3", 0, 2.35), run("adamw:b=4:lr=1e-3", 1, 2.5)])
    paths = []
    for name, data in (("old", old), ("first", first), ("second", second)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    out = tmp_path / "out.json"
    assert lm_baselines.main(["--report", *map(str, paths), "--target", "2.4", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    adamw = summary["adamw:b=4:lr=1e-3"]
    assert adamw["seeds"] == [0, 1, 2] and adamw["tokens"] == [4096, None, 8192]
    assert adamw["reached"] == 2 and adamw["median_tokens"] == 8192
    assert summary["sgd:b=4:lr=1"]["seeds"] == [0] and summary["sgd:b=4:lr=1"]["reached"] == 0
    again = tmp_path / "again.json"
    assert lm_baselines.main(["--report", str(out), "--target", "2.4", "--out", str(again)]) == 0
    assert json.loads(again.read_text())["summary"] == summary
    assert json.loads(again.read_text())["runs"] == json.loads(out.read_text())["runs"]


def test_sma_rules_runs_each_engine_system_with_its_own_sync_and_name():
    """bench/sma_rules.py builds SMA, S-SGD, EASGD (α and β apart), LocalSGD and DiLoCo from its
    flags, names every run apart, and refuses SMA's η rule (``--scale engine``) for the others."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import sma_rules

    import crossbow_graph as cg

    parser = sma_rules.build_parser()
    flags = {"sma": [], "easgd": ["--alpha", "0.5", "--centre-rate", "0.8"],
             "localsgd": ["--sync-every", "4"], "diloco": ["--sync-every", "4"], "allreduce": []}
    names = set()
    for system, extra in flags.items():
        args = parser.parse_args(["run", "--system", system, "--k", "16", "--scale", "sqrt", *extra])
        rule = sma_rules.Rule(args.alpha, args.mu_z, args.scale, args.batch)
        sync = sma_rules.engine_sync(args, rule, 16)
        names.add(sma_rules.run_name(args))
        if system == "easgd":
            assert isinstance(sync, cg.EASGD)
            assert (sync.alpha_for(16), sync.centre_rate, sync.sync_every) == (0.5, 0.8, 1)
        elif system == "sma":
            assert isinstance(sync, cg.SMA) and sync.alpha_for(16) == pytest.approx(1 / 16)
            assert sync.scale_lr is False  # the bench's LambdaLR scales η, not the engine
        elif system == "allreduce":
            assert isinstance(sync, cg.SSGD) and sync.scale_lr is False
        else:
            assert type(sync) is {"localsgd": cg.LocalSGD, "diloco": cg.DiLoCo}[system]
            assert sync.sync_every == 4
    assert len(names) == 5
    # DiLoCo's outer lr (0.7 and no name of its own unless set) and a --metrics run are named apart
    tuned = parser.parse_args(["run", "--system", "diloco", "--k", "16", "--outer-lr", "0.1"])
    outer = sma_rules.engine_sync(tuned, rule, 16).outer_optimizer([torch.zeros(1, requires_grad=True)])
    assert isinstance(outer, torch.optim.SGD) and outer.defaults["lr"] == 0.1
    assert outer.defaults["nesterov"] and outer.defaults["momentum"] == 0.9
    default = parser.parse_args(["run", "--system", "diloco", "--k", "16"])
    assert sma_rules.engine_sync(default, rule, 16).outer_optimizer(
        [torch.zeros(1, requires_grad=True)]).defaults["lr"] == 0.7
    assert "-olr0.1-" in sma_rules.run_name(tuned) and "olr" not in sma_rules.run_name(default)
    with pytest.raises(SystemExit):  # argparse: not a finite number > 0
        parser.parse_args(["run", "--system", "diloco", "--outer-lr", "-1"])
    with pytest.raises(SystemExit, match="DiLoCo's outer lr"):
        sma_rules.cmd_run(parser.parse_args(["run", "--system", "localsgd", "--outer-lr", "0.1"]))
    metrics = parser.parse_args(["run", "--k", "4", "--alpha", "default", "--metrics"])
    assert sma_rules.run_name(metrics) == sma_rules.run_name(
        parser.parse_args(["run", "--k", "4", "--alpha", "default"])).replace("-seed", "-metrics-seed")
    args = parser.parse_args(["run", "--system", "allreduce", "--k", "16", "--scale", "engine"])
    assert sma_rules.engine_sync(args, sma_rules.Rule("inv", "0.9", "engine", 16), 16).scale_lr
    args = parser.parse_args(["run", "--system", "easgd", "--k", "16", "--scale", "engine"])
    with pytest.raises(SystemExit, match="SMA's"):
        sma_rules.engine_sync(args, sma_rules.Rule("inv", "0.9", "engine", 16), 16)
