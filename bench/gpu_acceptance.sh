#!/usr/bin/env bash
# The GPU acceptance check: every GPU check of crossbow_graph in one call, its sections' limits
# adding up to 360 s (with the GPU machine's 1–2 minute start, ≤ 7 minutes). From the repository root:
#   PYTHONPATH=. OUT=/some/empty/dir bash bench/gpu_acceptance.sh          (on a GPU)
#   SECTIONS="decisive w1" bash bench/gpu_acceptance.sh    (env, then only those: rerun what failed)
#   bash bench/gpu_acceptance.sh --smoke     (every section on the CPU, tiny sizes, untimed, two at a time)
# W1 reads real MNIST: 'python bench/gpu_acceptance.py stage-mnist --work /tmp' copies its four
# files into bench/mnist (ignored by git); carry that folder to the GPU machine (or set MNIST_DIR).
# Each section runs under its own time limit (`timeout --signal=INT`: a section cut short keeps
# every cell it finished); every one runs whatever the others did, and the exit status is 1 at the
# end if any failed (a missed target fails its section). In order (bench/gpu_acceptance.py):
#   env          versions, the card's copy GB/s and launch µs; the Triton kernels compiled meanwhile
#   tests-early  the gpu-marked tests of graph rounds and device data (pytest --durations)
#   decisive     LeNet-5 at b = 16 in every system; targets: graph rounds m = 4, fused m = 16
#   w1           real MNIST to 99.0 %: the defaults against tuned plain PyTorch; SMA at m = 1, 4, 16
#   memory       peak against the estimate at m = 1, 8, 32; memory_reserved() flat over many rounds
#   bandwidth    the SMA kernel against the copy bandwidth (target at ResNet-50's size, m = 8)
#   throughput   ResNet-32 and LeNet-5 against plain at b and 4b; the data paths
#   profile      torch.profiler of the targets' systems: kernels and host µs per round
#   tests-late   every other gpu-marked test file (pytest --durations)
#   races, reference, nccl: the CUDA sanitizer and delayed streams; GPU against CPU; NCCL
# Writes under $OUT (a temporary folder when unset), six files: summary.md (the card, every
# section's status, the targets met or missed with the profile that explains a miss, the tables;
# rewritten after every section and when interrupted), results.md, results.json,
# pytest-tests-early.xml, pytest-tests-late.xml, acceptance.log.
set -uo pipefail
cd "$(dirname "$0")/.."

SMOKE=0
[[ "${1:-}" == "--smoke" ]] && SMOKE=1
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d -t gpu_acceptance.XXXXXX)}
mkdir -p "$OUT"
WORK=$(mktemp -d -t gpu_acceptance_work.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
LOG="$OUT/acceptance.log"
: >"$LOG"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

ORDER=(env tests-early decisive w1 memory bandwidth throughput profile tests-late races reference nccl)
declare -A LIMIT=([env]=25 [tests-early]=35 [decisive]=45 [w1]=60 [memory]=30 [bandwidth]=20
                  [throughput]=20 [profile]=10 [tests-late]=40 [races]=30 [reference]=15 [nccl]=30)
TOTAL=0
for name in "${ORDER[@]}"; do TOTAL=$((TOTAL + LIMIT[$name])); done
SELECTED="${SECTIONS:-}"
for name in $SELECTED; do
    [[ -v "LIMIT[$name]" ]] || { echo "SECTIONS: unknown section '$name'; choose from: ${ORDER[*]}"; exit 3; }
done
if ((SMOKE)); then
    MODE=smoke SMOKE_FLAG=--smoke ARCH=90
    export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1
    for name in "${ORDER[@]}"; do LIMIT[$name]=600; done  # untimed: a loaded machine is slow, not wrong
else
    MODE=gpu SMOKE_FLAG=
    unset TRITON_INTERPRET
    export TRITON_DEFAULT_FP_FUSION=1
    ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '. ')
    [[ "$ARCH" =~ ^[0-9]+$ ]] || ARCH=90
fi
echo "GPU acceptance ($MODE): sections' limits $TOTAL s${SELECTED:+, sections: env $SELECTED}; results under $OUT"

# What this run needs, from the image's own Python (nothing is installed): the versions found, or a
# clear message within seconds naming what is missing and how to bring it.
"$PY" - "$MODE" <<'PY' 2>&1 | tee -a "$LOG"
import importlib, sys
need = {"torch": (2, 11), "networkx": None, "numpy": None, "tqdm": None, "pytest": None}
if sys.argv[1] == "gpu":
    need["triton"] = (3, 6)
found, missing = [], []
for name, least in need.items():
    try:
        version = importlib.import_module(name).__version__
    except Exception as exc:  # noqa: BLE001 (any failure to import is "missing")
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
        continue
    found.append(f"{name} {version}")
    have = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    if least and have < least:
        missing.append(f"{name} {version} (needs >= {'.'.join(map(str, least))})")
print(f"Python {sys.version.split()[0]} at {sys.executable}; " + ", ".join(found))
try:
    import crossbow_graph
    print(f"crossbow_graph from {crossbow_graph.__file__}")
except Exception as exc:  # noqa: BLE001
    missing.append(f"crossbow_graph ({type(exc).__name__}: {exc}; run from the repository root)")
if missing:
    print("missing: " + "; ".join(missing) + ". Nothing is installed here: carry a wheel of each "
          "(the device tool's README, .whl in carry) or set PYTHON to an interpreter that has them")
    sys.exit(3)
PY
[[ ${PIPESTATUS[0]} == 0 ]] || exit 3

report() { "$PY" bench/acceptance_report.py --work "$WORK" --out "$OUT" --mode "$MODE" --sections "$SELECTED" "$@"; }

# Interrupted (the device tool's limit, ^C): the summary still says what finished.
trap 'kill $(jobs -p) 2>/dev/null; report >/dev/null 2>&1; echo "interrupted: $OUT/summary.md has what finished"; exit 130' INT TERM

# section NAME COMMAND...: unless SECTIONS leaves NAME out, runs COMMAND under `timeout` (NAME's
# limit), its output appended to the log, records "<exit status> <seconds>", rewrites the summary.
# On a GPU one section at a time; the smoke run (untimed) runs two at a time after env, each
# section's output into the log when it ends (in order: `finish`).
PARALLEL=$((SMOKE ? 2 : 1))
RUN=()  # the smoke run's sections started, in order
section() {
    local name=$1
    shift
    [[ -z "$SELECTED" || "$name" == env || " $SELECTED " == *" $name "* ]] || return 0
    if ((PARALLEL == 1)) || [[ "$name" == env ]]; then
        run_section "$name" "$LOG" "$@"
        return
    fi
    while (($(jobs -rp | wc -l) >= PARALLEL)); do wait -n; done
    RUN+=("$name")
    run_section "$name" "$WORK/$name.log" "$@" &
}
run_section() {
    local name=$1 log=$2 limit=${LIMIT[$1]} t0 rc ms
    shift 2
    printf '\n===== %s (limit %s s): %s\n' "$name" "$limit" "$*" >>"$log"
    t0=$(date +%s%N)
    timeout --signal=INT -k 5 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    ms=$((($(date +%s%N) - t0) / 1000000))
    printf '%d %d.%03d\n' "$rc" $((ms / 1000)) $((ms % 1000)) >"$WORK/$name.rc"
    report
    echo "  $name: exit $rc, $((ms / 1000)) s"
}
finish() {  # the sections still running end; their logs join the log in order
    wait
    for name in "${RUN[@]}"; do cat "$WORK/$name.log" >>"$LOG"; done
}

# acc NAME: bench/gpu_acceptance.py's section NAME, told its budget (its limit − 8 s)
acc() { echo "$PY bench/gpu_acceptance.py $1 --work $WORK --budget-s $((LIMIT[$1] - 8)) --arch $ARCH $SMOKE_FLAG"; }
EXACT="env CUBLAS_WORKSPACE_CONFIG=:4096:8"  # deterministic cuBLAS on several streams

# tests NAME FILE...: the gpu-marked tests of FILEs, the slowest listed, a JUnit report per section
PER_TEST=()  # a hung test fails alone, not the whole section
"$PY" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout "$((SMOKE ? 300 : 25))")
tests() {
    local name=$1
    shift
    section "$name" "$PY" -m pytest "$@" -m gpu -q -p no:cacheprovider --durations=15 \
        "${PER_TEST[@]}" --junitxml="$OUT/pytest-$name.xml" -o junit_family=xunit1
}
EARLY=(tests/test_graphs.py tests/test_graph_inputs.py tests/test_device_data.py)
mapfile -t LATE < <(grep -l "mark.gpu" tests/test_*.py | grep -vxF "$(printf '%s\n' "${EARLY[@]}")")

# shellcheck disable=SC2046  # acc's words are split on purpose (no spaces inside them)
section env $(acc env)
if ((!SMOKE)) && [[ "$(cut -d' ' -f1 "$WORK/env.rc")" != 0 ]] && ! "$PY" -c \
        "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA GPU here (acceptance.log): run 'bash bench/gpu_acceptance.sh --smoke' on a CPU"
    exit 2
fi
((SMOKE)) || nvidia-smi >>"$LOG" 2>&1 || true
tests tests-early "${EARLY[@]}"
section decisive $(acc decisive)
section w1 $(acc w1)
section memory $(acc memory)
section bandwidth $(acc bandwidth)
section throughput $(acc throughput)
section profile $(acc profile)
tests tests-late "${LATE[@]}"
section races $EXACT $(acc races)
section reference $EXACT $(acc reference)
section nccl $(acc nccl)
finish

report --final
status=$?
cat "$OUT/summary.md"
echo
echo "files under $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $status
