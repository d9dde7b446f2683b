#!/usr/bin/env bash
# GPU validation for a machine with one NVIDIA GPU (H100 / H200) and torch with CUDA, but no vLLM,
# no bitsandbytes and no network: the GPU-marked tests and a trainer throughput benchmark on a
# random-initialised Qwen3-0.6B-shaped model (shapes from transformers' config; nothing downloaded).
#
#   OUT=/some/dir bash scripts/gpu_validate.sh        (run from the repository root)
#
# Writes to $OUT (default outputs/gpu_validate): env.txt (GPU, versions, missing packages),
# pytest_gpu.log, trainer_bench.log and trainer_cuda.json.
#
# Python packages grpo needs that the machine lacks can travel as wheels in .whl/ (pip download
# --no-deps --only-binary=:all: for that machine's Python); they are installed to /tmp/site. The
# repository is imported as `grpo` through a link (/tmp/grpo-import/grpo -> src), no pip install.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/outputs/gpu_validate}"
PYTHON="${PYTHON:-python3}"
QWEN_DIR="${QWEN_DIR:-/tmp/qwen3-0.6b-random}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
mkdir -p /tmp/grpo-import
ln -sfn "$REPO/src" /tmp/grpo-import/grpo
export PYTHONPATH="/tmp/grpo-import${PYTHONPATH:+:$PYTHONPATH}"

{
  echo "date: $(date -u +%FT%TZ)"
  echo "grpo git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  "$PYTHON" - <<'EOF'
import importlib, platform
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NONE")
needed = ["transformers", "peft", "safetensors", "pydantic", "msgspec", "zmq", "yaml", "typer", "httpx",
          "rich", "numpy", "pytest", "vllm", "bitsandbytes"]
missing = []
for name in needed:
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')}")
    except ImportError:
        missing.append(name)
print("missing:", " ".join(missing) or "none")
EOF
} 2>&1 | tee "$OUT/env.txt"

"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "no CUDA device visible to $PYTHON: nothing to validate" | tee -a "$OUT/env.txt"
  exit 1
}

# 1. GPU-marked tests. Test modules that cannot even be imported here (vLLM, bitsandbytes are
#    absent by design) are reported as collection errors and do not stop the GPU tests.
"$PYTHON" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors tests \
  2>&1 | tee "$OUT/pytest_gpu.log"
tests_rc=${PIPESTATUS[0]}

# 2. Trainer throughput on a Qwen3-0.6B-shaped model with random weights.
"$PYTHON" - "$QWEN_DIR" <<'EOF'
import sys
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

# Qwen3-0.6B's published shape: 28 layers, hidden 1024, MLP 3072, 16 query / 8 KV heads of 128.
config = Qwen3Config(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    bos_token_id=151643, eos_token_id=151645,
)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained(sys.argv[1])
print("built", sys.argv[1], sum(p.numel() for p in model.parameters()) / 1e6, "M parameters")
EOF
"$PYTHON" benchmarks/trainer_bench.py --model "$QWEN_DIR" --rows 8 --row-tokens 2048 --steps 3 \
  2>&1 | tee "$OUT/trainer_bench.log"
bench_rc=${PIPESTATUS[0]}
cp benchmarks/results/trainer_cuda.json "$OUT/" 2>/dev/null || echo "no trainer_cuda.json written"

echo "pytest -m gpu exit code: $tests_rc; trainer bench exit code: $bench_rc" | tee -a "$OUT/env.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
