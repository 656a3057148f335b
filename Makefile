# Set-up and the two README commands: `make demo` and `make test`; `make gpu-check` on a GPU node.
# TORCH pins the build pip installs first; on these CPU machines 2.13.0 is the local CPU wheel.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
# glibc allocator settings that cut system time on CPU training, for the test processes too (normlab-train and
# normlab-bench set the same themselves: runtime.keep_freed_memory; see docs/configuration.md).
export MALLOC_MMAP_THRESHOLD_ ?= 4294967296
export MALLOC_TRIM_THRESHOLD_ ?= 4294967296

.PHONY: install demo test gpu-check clean-demo

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test]" "$(TORCH)"
	touch $@

data/embedded/meta.json: $(VENV)/.installed
	$(BIN)/normlab-prepare data=embedded

demo: data/embedded/meta.json
	$(BIN)/normlab-train -m experiment=demo
	$(BIN)/normlab-ablate -m probe.tokens=8192 \
		model_path=checkpoints/demo/tiny-layernorm-seed0,checkpoints/demo/tiny-rmsnorm-seed0
	$(BIN)/normlab-report runs=checkpoints/demo learning_check=unigram

test: $(VENV)/.installed
	bash slurm/local_cluster.sh || echo "warning: no one-node Slurm cluster (needs root and apt-get): tests/test_slurm.py cannot run"
	$(BIN)/pytest -n 3 --dist loadfile --no-loadscope-reorder

# On a GPU node (about 8 minutes on one GPU): the measurements only a GPU can give, under docs/results/<gpu>/
gpu-check: $(VENV)/.installed
	PYTHON=$(BIN)/python bash slurm/gpu_check.sh

clean-demo:
	rm -rf checkpoints/demo
