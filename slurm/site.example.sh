# A site's set-up for normlab jobs, sourced by slurm/env.sh on the compute node before the checkout's .venv is
# activated. Copy it, keep what your site needs, and submit with it:
#   cp slurm/site.example.sh ~/normlab-site.sh
#   NORMLAB_SITE_ENV=~/normlab-site.sh sbatch slurm/paper_70m.sbatch norm=layernorm seed=0
# (export NORMLAB_SITE_ENV in ~/.bashrc to set it once; sbatch passes the submitting shell's environment on).
module load python/3.11 cuda/12.4                  # the Python that made .venv, the CUDA of your torch build
# source ~/miniconda3/etc/profile.d/conda.sh && conda activate normlab   # instead of modules, where conda is used
# export NORMLAB_VENV=/scratch/$USER/normlab-venv  # a venv outside the checkout
# export HF_HOME=/scratch/$USER/hf                 # a cache on a shared file system
# export NCCL_SOCKET_IFNAME=ib0                    # the network interface NCCL should use across nodes
