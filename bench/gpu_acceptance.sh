#!/usr/bin/env bash
# The GPU acceptance check: every GPU check of crossbow_graph in one run of ≤ 5 minutes on one GPU.
#   OUT=/some/empty/dir bash bench/gpu_acceptance.sh           (from the repository root, on a GPU)
#   bash bench/gpu_acceptance.sh --smoke                       (the same sections on the CPU, ~1 min)
# Sections (bench/gpu_acceptance.py has the details), each under its own time limit; every one runs
# whatever the others did, and the exit status is 1 at the end if any failed:
#   1. the gpu-marked tests (pytest -m gpu)      4. CUDA fits against the CPU reference, Triton vs torch
#   2. SMA kernel bandwidth, data out of L2       5. NCCL with one rank (torchrun)
#   3. race probes: CUDA sanitizer, delayed streams compared bitwise
#   6. throughput: plain PyTorch at b and 4b against per_replica and fused (m = 4 at b)
# Writes under $OUT (a temporary folder when unset): summary.md (every section's status, key
# numbers and tables), results.md (the tables), results.json, pytest.xml, acceptance.log.
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
    #             env tests bandwidth races reference nccl throughput
    LIMITS=(      30  60    30        60    40        40   30)  # 290 s in all
else
    MODE=gpu SMOKE_FLAG=
    unset TRITON_INTERPRET
    export TRITON_DEFAULT_FP_FUSION=1
    LIMITS=(      15  70    40        55    25        35   50)  # 290 s in all
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

# section NAME LIMIT_S COMMAND...: runs COMMAND under `timeout`, its output appended to the log,
# records "<exit status> <seconds>" for the report, then rewrites the summary.
section() {
    local name=$1 limit=$2 t0 rc ms
    shift 2
    printf '\n===== %s (limit %s s): %s\n' "$name" "$limit" "$*" >>"$LOG"
    t0=$(date +%s%N)
    timeout -k 5 "$limit" "$@" >>"$LOG" 2>&1
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
section tests "${LIMITS[1]}" "$PY" -m pytest tests -m gpu -q -p no:cacheprovider \
    --junitxml="$OUT/pytest.xml" -o junit_family=xunit1
section bandwidth "${LIMITS[2]}" $(acc bandwidth 2)
section races "${LIMITS[3]}" $EXACT $(acc races 3)
section reference "${LIMITS[4]}" $EXACT $(acc reference 4)
section nccl "${LIMITS[5]}" $(acc nccl 5)
section throughput "${LIMITS[6]}" $(acc throughput 6)

report --final
status=$?
cat "$OUT/summary.md"
echo
echo "files under $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $status
