# The environment of a normlab job on a compute node; sourced by every sbatch script of this folder.
# Compute nodes are often offline: everything is prepared on the login node (README, "on a cluster").
cd "${SLURM_SUBMIT_DIR:-.}"                        # the checkout the job was submitted from
source "${NORMLAB_VENV:-.venv}/bin/activate"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1      # never wait on the hub from a compute node
export WANDB_MODE="${WANDB_MODE:-offline}"         # upload later: wandb sync checkpoints/*/*/wandb/offline-run-*
export HF_HOME="${HF_HOME:-$PWD/.cache/huggingface}"
export MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296
export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"
