"""The benchmarks are scripts of bench/, run from a checkout; the CLI has no ``bench`` subcommand."""

import os
import subprocess
import sys

import pytest

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
