#!/bin/bash
# make gpu-check: what only a GPU can show, in at most about 8 minutes on one GPU, written under
# docs/results/<gpu>/ (docs/benchmark.md, "The GPU check"). Run it first whenever a GPU is at hand:
#   make gpu-check                        (or: sbatch --gres=gpu:1 --time=15 slurm/gpu_check.sh)
# Each stage gets what is left of the budget (GPU_CHECK_SECONDS, 480) and writes its own table; a stage that runs
# out of time is cut, its progress kept in gpu-check.log, and the next stages are skipped.
#SBATCH --job-name=normlab-gpu-check
#SBATCH --gres=gpu:1
#SBATCH --time=00:15:00
#SBATCH --output=%x-%j.log
set -uo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
PYTHON="${PYTHON:-.venv/bin/python}"
budget="${GPU_CHECK_SECONDS:-480}"
export PYTHONUNBUFFERED=1 MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296
# the GPU's kind in lower case, e.g. h100, h200, a100: the results' folder
# (GPU_CHECK_ON_CPU=1: the same stages on the CPU, as tests/test_gpu_check.py runs them)
gpu=$("$PYTHON" -c "import os, torch
if os.environ.get('GPU_CHECK_ON_CPU') == '1': print('cpu')
elif torch.cuda.is_available(): print(torch.cuda.get_device_name(0).split()[1].lower())" 2>/dev/null)
if [ -z "$gpu" ]; then
    echo "gpu_check.sh: no GPU that torch can use here: run it on a GPU node" >&2
    exit 2
fi
out="${GPU_CHECK_OUT:-docs/results/$gpu}"
mkdir -p "$out"
log="$out/gpu-check.log"
started=$SECONDS
device=$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name(0) if '$gpu' != 'cpu' else 'cpu')")
echo "gpu-check on $device, $(git rev-parse --short HEAD 2>/dev/null || echo 'no git'), $(date -u +%FT%TZ);" \
     "budget ${budget} s" | tee "$log"

# stage NAME BENCH-ARGS...: normlab-bench with what is left of the budget; its table in $out/NAME.md
stage() {
    local name=$1; shift
    local left=$((budget - (SECONDS - started)))
    if ((left < 30)); then
        echo "== $name: skipped (the budget of ${budget} s is spent)" | tee -a "$log"
        return
    fi
    echo "== $name: normlab-bench $* (at most ${left} s)" | tee -a "$log"
    timeout --signal=INT --kill-after=15 "$left" "$PYTHON" -c "from normlab.bench import main; main()" \
        "$@" "out=$out/$name.md" 2>&1 | tee -a "$log"
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - started)) s in all" | tee -a "$log"
}

# Most wanted first: every paper preset through the real pipeline (MFU, peak memory against the plan), the 410m
# step with each norm and where its time goes, each speed setting's gain, 16-bit losses against float32, each
# preset's whole step on this one GPU (data.batch_size=auto), and last the 1b step with each norm.
stage preflight sections=preflight
stage step-410m sections=[step,profile] step_model=410m repeats=2 profile_steps=2
stage gains sections=[gains] step_model=410m repeats=2
stage precision sections=[precision] step_model=160m precision_steps=20
stage preflight-auto sections=preflight preflight_batch=auto
stage step-1b sections=[step] step_model=1b repeats=2
echo "gpu-check: $((SECONDS - started)) s; results in $out" | tee -a "$log"
