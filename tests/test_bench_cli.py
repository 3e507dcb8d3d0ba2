"""`crossbow-graph bench tta|throughput|kernel`: the wiring to bench/ (nothing is measured)."""

import os

import pytest

from crossbow_graph.cli import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name, script, quick", [
    ("tta", "tta.py", "--quick"),
    ("throughput", "throughput.py", "--quick"),
    ("kernel", "sma_kernel.py", "--reps 2"),
])
def test_bench_runs_the_script_with_quick_arguments(capsys, name, script, quick):
    assert main(["bench", name, "--quick", "--dry-run"]) == 0
    cmd = capsys.readouterr().out.strip()
    assert cmd.split()[1] == os.path.join(ROOT, "bench", script)
    assert os.path.isfile(cmd.split()[1])
    assert quick in cmd


def test_bench_passes_arguments_through_and_defaults_are_full_runs(capsys):
    assert main(["bench", "tta", "--dry-run", "--", "--seeds", "0", "1"]) == 0
    assert main(["bench", "tta", "--dry-run"]) == 0
    with_args, default = capsys.readouterr().out.strip().splitlines()
    assert with_args.endswith("tta.py --seeds 0 1")
    assert default.endswith("tta.py")  # no --quick: the script's own (full) defaults


def test_bench_rejects_an_unknown_benchmark(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "nope"])
    assert "invalid choice" in capsys.readouterr().err


def test_tta_script_help_lists_the_systems():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "tta.py"), "--help"],
                         capture_output=True, text=True, check=True).stdout
    for system in ("plain-B32", "localsgd", "crossbow-r2", "crossbow-auto", "crossbow-ssgd"):
        assert system in out
