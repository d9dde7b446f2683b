# The two commands a new user needs: `make demo` and `make test`. Both install what is missing
# into .venv/ first (scripts/setup.sh; fast when already done).
SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup lock lock-gpu demo test test-fast lint typecheck docs bench gpu-validate clean

setup:
	@bash scripts/setup.sh

# Renew constraints/cpu.txt: a fresh .venv resolved within pyproject.toml's ranges, then frozen.
lock:
	rm -rf $(VENV)
	GRPO_UNLOCKED=1 bash scripts/setup.sh
	{ sed -n 1,2p constraints/cpu.txt; $(BIN)/python -m pip freeze --exclude-editable --disable-pip-version-check | grep -v '^#'; } > constraints/cpu.txt.new
	mv constraints/cpu.txt.new constraints/cpu.txt

# Renew constraints/gpu.txt (what setup installs when nvidia-smi works): resolved by uv for linux
# x86_64 + PyPI's CUDA wheels, Python 3.11 and 3.12, from any machine (no GPU needed).
lock-gpu:
	bash scripts/lock_gpu.sh

# A fresh run each time: grpo refuses to start a new run over an earlier one in the same output_dir.
demo: setup
	rm -rf outputs/demo
	$(BIN)/grpo --train configs/demo/train.yaml --infer configs/demo/infer.yaml --orch configs/demo/orch.yaml
	$(BIN)/grpo-report outputs/demo

lint: setup
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/ruff format --check src tests benchmarks scripts

# mypy checks the package under its import name (grpo -> src/ through a link), so calls between grpo
# modules are checked against their real signatures rather than read as untyped imports.
typecheck: setup
	@mkdir -p .mypy_pkg && ln -sfn ../src .mypy_pkg/grpo
	MYPYPATH=.mypy_pkg $(BIN)/mypy -p grpo

# The docs site (mkdocs.yml) into outputs/site/. --strict fails on a broken link or anchor and on a page
# missing from the nav; MkDocs' -q would hide those warnings from --strict, so only its INFO lines go.
docs: setup
	@set -o pipefail; NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict 2>&1 | { grep -v '^INFO' || true; }

# Two pytest-xdist workers, each taking a whole module at a time (all of tests/inference/ as one unit:
# its modules share one vLLM server; tests/suite_scheduling.py): most of the suite waits on process
# starts and imports, so two workers keep both cores busy. Modules marked serial run after, alone.
# PYTEST_WORKERS=0 runs everything in one process.
PYTEST_WORKERS ?= 2
test: setup lint typecheck docs
	$(BIN)/pytest -q --timeout=900 --durations=30 -m "not serial" \
	  $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder)
	$(BIN)/pytest -q --timeout=900 --durations=10 -m serial

test-fast: setup
	$(BIN)/pytest -q -m "not slow and not vllm" --timeout=300

# The bench extra (TRL, the peer measured side by side) on top of setup's packages; already-installed
# packages stay as setup pinned them.
bench: setup
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[bench]" 2>&1 \
	  | { grep -v "is ignored: it is neither a file nor a directory" || true; }
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf outputs .pytest_cache .mypy_cache .ruff_cache

# The acceptance run on a GPU machine (~25 min, no vLLM or network needed): every gpu-marked test,
# trainer tokens/s, MFU and peak memory against the plan, grpo doctor; outputs/gpu_validate/summary.json.
gpu-validate:
	bash scripts/gpu_validate.sh
