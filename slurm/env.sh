# The environment of a normlab job on a compute node; sourced by every sbatch script of this folder.
# Compute nodes are often offline: everything is prepared on the login node (docs/data.md, "on a cluster").
cd "${SLURM_SUBMIT_DIR:-.}"                        # the checkout the job was submitted from
if [ -n "${NORMLAB_SITE_ENV:-}" ]; then            # the site's own set-up (modules, conda): slurm/site.example.sh
    if [ ! -f "$NORMLAB_SITE_ENV" ] || [ ! -r "$NORMLAB_SITE_ENV" ]; then
        echo "slurm/env.sh: no readable file $(realpath -m -- "$NORMLAB_SITE_ENV") (NORMLAB_SITE_ENV):" \
             "fix the path or unset NORMLAB_SITE_ENV" >&2
        exit 2
    fi
    source "$NORMLAB_SITE_ENV"
fi
source "${NORMLAB_VENV:-.venv}/bin/activate"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1      # never wait on the hub from a compute node
export WANDB_MODE="${WANDB_MODE:-offline}"         # upload later: wandb sync checkpoints/*/*/wandb/offline-run-*
export HF_HOME="${HF_HOME:-$PWD/.cache/huggingface}"
export MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296
export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"
