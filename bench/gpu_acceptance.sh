#!/usr/bin/env bash
# The GPU acceptance check: every GPU check of crossbow_graph in one run of ≤ 5 minutes on one GPU.
#   PYTHONPATH=. OUT=/some/empty/dir bash bench/gpu_acceptance.sh   (from the repository root, on a GPU)
#   bash bench/gpu_acceptance.sh --smoke      (the same sections on the CPU, tiny sizes, untimed)
# W1 reads real MNIST: 'python bench/gpu_acceptance.py stage-mnist --work /tmp' copies its four
# files into bench/mnist (ignored by git); carry that folder to the GPU machine (or set MNIST_DIR).
# Sections, the decisive first (bench/gpu_acceptance.py has the details), each under its own time
# limit (`timeout --signal=INT`: a section cut short keeps every cell it finished); every one runs
# whatever the others did, and the exit status is 1 at the end if any failed:
#   1. decisive: LeNet-5 at b = 16 in every system (plain eager and in one graph; crossbow_graph
#      per_replica and fused, eager and graph rounds, m = 1, 4, 16, 32)
#   2. SMA kernel bandwidth (ResNet-50 size at m = 8 first), data out of L2
#   3. throughput: ResNet-32 at b = 16, 32 and LeNet-5 at b = 32; the data paths
#   4. W1 on real MNIST: time to 99.0 % against tuned plain PyTorch
#   5. torch.profiler: kernels and host µs per round, the GPU's busy share
#   6. the gpu-marked tests (pytest -m gpu, a per-test timeout when pytest-timeout is importable)
#   7. race probes  8. CUDA fits against the CPU reference  9. NCCL with one rank (torchrun)
# Writes under $OUT (a temporary folder when unset): summary.md (every section's status, key
# numbers and tables), results.md (the tables), results.json, pytest.xml, acceptance.log; the
# summary is rewritten after every section and when the script is interrupted.
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
if ((SMOKE)); then
    MODE=smoke SMOKE_FLAG=--smoke
    export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1
    # untimed: a loaded machine makes every section slow, and nothing here is a timing
    LIMITS=(      600 600      600       600        600 600     600   600   600       600)
else
    MODE=gpu SMOKE_FLAG=
    unset TRITON_INTERPRET
    export TRITON_DEFAULT_FP_FUSION=1
    #             env decisive bandwidth throughput w1  profile tests races reference nccl
    LIMITS=(      15  50       20        30         50  15      40    30    15        20)  # 285 s
fi
echo "GPU acceptance ($MODE): results under $OUT"

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

report() { "$PY" bench/acceptance_report.py --work "$WORK" --out "$OUT" --mode "$MODE" "$@"; }

# Interrupted (the device tool's limit, ^C): the summary still says what finished.
trap 'report >/dev/null 2>&1; echo "interrupted: $OUT/summary.md has what finished"; exit 130' INT TERM

# section NAME LIMIT_S COMMAND...: runs COMMAND under `timeout`, its output appended to the log,
# records "<exit status> <seconds>" for the report, then rewrites the summary.
section() {
    local name=$1 limit=$2 t0 rc ms
    shift 2
    printf '\n===== %s (limit %s s): %s\n' "$name" "$limit" "$*" >>"$LOG"
    t0=$(date +%s%N)
    timeout --signal=INT -k 5 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    ms=$((($(date +%s%N) - t0) / 1000000))
    printf '%d %d.%03d\n' "$rc" $((ms / 1000)) $((ms % 1000)) >"$WORK/$name.rc"
    report
    echo "  $name: exit $rc, $((ms / 1000)) s"
}

# acc NAME I: the command of bench/gpu_acceptance.py's section NAME, told its budget (LIMITS[I] − 8 s)
acc() { echo "$PY bench/gpu_acceptance.py $1 --work $WORK --budget-s $((LIMITS[$2] - 8)) $SMOKE_FLAG"; }
EXACT="env CUBLAS_WORKSPACE_CONFIG=:4096:8"  # deterministic cuBLAS on several streams

# shellcheck disable=SC2046  # acc's words are split on purpose (no spaces inside them)
section env "${LIMITS[0]}" $(acc env 0)
if ((!SMOKE)) && [[ "$(cut -d' ' -f1 "$WORK/env.rc")" != 0 ]]; then  # no CUDA GPU: nothing to run
    echo "no CUDA GPU here (acceptance.log): run 'bash bench/gpu_acceptance.sh --smoke' on a CPU"
    exit 2
fi
nvidia-smi >>"$LOG" 2>&1 || true
section decisive "${LIMITS[1]}" $(acc decisive 1)
section bandwidth "${LIMITS[2]}" $(acc bandwidth 2)
section throughput "${LIMITS[3]}" $(acc throughput 3)
section w1 "${LIMITS[4]}" $(acc w1 4)
section profile "${LIMITS[5]}" $(acc profile 5)
PER_TEST=()  # a hung test fails alone, not the whole section
"$PY" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout "$((SMOKE ? 300 : 30))")
section tests "${LIMITS[6]}" "$PY" -m pytest tests -m gpu -q -p no:cacheprovider "${PER_TEST[@]}" \
    --junitxml="$OUT/pytest.xml" -o junit_family=xunit1
section races "${LIMITS[7]}" $EXACT $(acc races 7)
section reference "${LIMITS[8]}" $EXACT $(acc reference 8)
section nccl "${LIMITS[9]}" $(acc nccl 9)

report --final
status=$?
cat "$OUT/summary.md"
echo
echo "files under $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $status
