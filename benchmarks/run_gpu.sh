#!/usr/bin/env bash
# The GPU benchmarks and the sync check in one command, on a fresh CUDA machine with this
# repository checked out and no network:
#
#     bash benchmarks/run_gpu.sh            # about 8 minutes at most (GPU_BUDGET_S, default 470 s)
#
# 1. installs the comparison tools from .whl/*.whl if that folder exists (made beforehand, where
#    PyPI is reachable, by benchmarks/fetch_wheels.sh: BackPACK, which gradlens' convolution
#    kernels need too, cockpit, Opacus), then gradlens itself (pip install -e . without
#    dependencies or build isolation; falls back to PYTHONPATH=. when that fails);
# 2. prints the versions of python, torch, CUDA, the GPU and each optional tool;
# 3. runs benchmarks/sync_check.py (CUDA sync debug mode around tracked micro-steps), then
#    bench_instruments.py, bench_dots.py and bench_transformer.py with --device cuda and
#    --steps $STEPS (default 10), each under a time limit cut to what is left of the budget.
# A missing optional tool makes its rows print "failed: ..." and the run goes on.
#
# Output: one file per part in $OUT if set (else /tmp/gradlens-gpu-results), all shown on
# stdout as well: versions.txt, install.txt, sync_check.txt, bench_instruments.txt,
# bench_dots.txt, bench_transformer.txt, summary.txt (seven files).
# Settings (environment): PYTHON (default python3), STEPS (10), GPU_BUDGET_S (470), DEVICE (cuda;
# "cpu" runs the same sequence on the CPU, slowly), SKIP_INSTALL=1 (no pip: PYTHONPATH=. instead).

set -u
cd "$(dirname "$0")/.."
RESULTS="${OUT:-/tmp/gradlens-gpu-results}"
mkdir -p "$RESULTS"
PY="${PYTHON:-python3}"
STEPS="${STEPS:-10}"
BUDGET="${GPU_BUDGET_S:-470}"
DEVICE="${DEVICE:-cuda}"
export PYTHONUNBUFFERED=1
SECONDS=0
: > "$RESULTS/summary.txt"

note() { echo "$*" | tee -a "$RESULTS/summary.txt"; }

# run NAME LIMIT_S COMMAND...: output to $RESULTS/NAME.txt and stdout, limit cut to the budget left
run() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - SECONDS - 5))
    if [ "$left" -lt 20 ]; then
        note "$name: skipped, ${left}s of the ${BUDGET}s budget left"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (limit ${limit}s): $*"
    timeout -k 5 "$limit" "$@" > >(tee "$RESULTS/$name.txt") 2>&1
    local rc=$?
    sleep 0.2  # let tee flush
    case $rc in
        0) note "$name: ok (${SECONDS}s elapsed)" ;;
        124|137) note "$name: STOPPED at its ${limit}s limit (${SECONDS}s elapsed); partial output in $name.txt" ;;
        *) note "$name: exit status $rc (${SECONDS}s elapsed); see $name.txt" ;;
    esac
}

{
    if compgen -G ".whl/*.whl" > /dev/null; then
        echo "installing the carried wheels: $(ls .whl)"
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/gradlens-site .whl/*.whl; then
            export PYTHONPATH="/tmp/gradlens-site${PYTHONPATH:+:$PYTHONPATH}"
        else
            echo "installing the wheels failed: the comparison tools' rows will say failed"
        fi
    else
        echo "no .whl/ folder: BackPACK, cockpit and Opacus only if already installed (benchmarks/fetch_wheels.sh)"
    fi
    if [ "${SKIP_INSTALL:-0}" = 1 ]; then
        echo "SKIP_INSTALL=1: using PYTHONPATH=$PWD"
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    elif timeout 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e .; then
        echo "pip install -e . (no deps, no build isolation): ok"
    else
        echo "pip install -e . failed: using PYTHONPATH=$PWD"
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
} > "$RESULTS/install.txt" 2>&1
cat "$RESULTS/install.txt"
# the exports inside { } above run in this shell (a group, not a subshell): PYTHONPATH holds them
export PYTHONPATH="${PYTHONPATH:-}"

run versions 60 "$PY" - <<'EOF'
import importlib, platform, subprocess
import torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version()}, CUDA available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
import importlib.metadata as md
import warnings
warnings.filterwarnings("ignore")
for mod, dist in (("gradlens", "gradlens"), ("backpack", "backpack-for-pytorch"), ("cockpit", "cockpit-for-pytorch"),
                  ("opacus", "opacus"), ("numpy", "numpy")):
    try:
        m = importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001
        print(f"{mod}: not importable ({type(e).__name__}: {e})")
        continue
    try:
        v = md.version(dist)
    except md.PackageNotFoundError:
        v = getattr(m, "__version__", "?")
    print(f"{mod} {v} ({m.__file__})")
try:
    print(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout.strip())
except Exception as e:  # noqa: BLE001
    print(f"nvidia-smi: {e}")
EOF

if [ "$DEVICE" != cpu ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    note "torch sees no CUDA device: nothing to run with --device $DEVICE (versions.txt)"
    exit 1
fi
cd benchmarks
run sync_check 90 "$PY" sync_check.py --device "$DEVICE"
run bench_instruments 150 "$PY" bench_instruments.py --device "$DEVICE" --steps "$STEPS"
run bench_dots 90 "$PY" bench_dots.py --device "$DEVICE" --steps "$STEPS"
run bench_transformer 120 "$PY" bench_transformer.py --device "$DEVICE" --steps "$STEPS"
note "total ${SECONDS}s; files in $RESULTS"
