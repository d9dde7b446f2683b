"""Write a trained policy as a model people can use: merged HF weights, or the LoRA adapter alone.

The policy folder is one of the run's published versions (`broadcasts/step_{v}/`, picked by
grpo.transport.weights.filesystem.find_policy): a PEFT adapter (LoRA runs) or an HF model folder
(full weights, both backends; Megatron's are HF-named with the base's config.json). The noisy
RMSNorm copies a QeRL run publishes beside them (noisy_norms.safetensors) are exploration noise for
the inference servers, not part of the policy, and are left out.

Merged: the base model (LoRA) or the published full weights are loaded in float32, the adapter is
folded in there with PEFT's merge_and_unload (one rounding to the output dtype at the end, rather
than a bf16 add per layer), and the model is written with safetensors, the base's tokenizer and
generation config, and `use_cache` back on (the trainer turns it off). The output dtype is the one
the base is stored in unless the caller names another. Everything is built in a temporary sibling
of the output folder and renamed into place, so a reader never sees half an export.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from grpo.utils.atomic import fsync_dir, fsync_tree
from grpo.utils.errors import UserError

PolicyKind = Literal["adapter", "full"]
DTYPES = ("bfloat16", "float16", "float32")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def policy_kind(folder: Path) -> PolicyKind:
    """What a published policy folder holds: a PEFT adapter or full HF weights."""
    if (folder / "adapter_config.json").exists():
        return "adapter"
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        return "full"
    raise UserError(
        f"{folder} holds neither a LoRA adapter (adapter_config.json) nor HF weights (config.json + "
        "safetensors); export another step with --step"
    )


def stored_dtype(model_path: Path) -> str:
    """The floating dtype `model_path`'s weights are stored in: config.json's, else the first
    floating tensor's in its safetensors files."""
    config = json.loads((model_path / "config.json").read_text())
    named = config.get("dtype") or config.get("torch_dtype")
    if named in DTYPES:
        return str(named)
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
    for file in sorted(model_path.glob("*.safetensors")):
        for entry in _safetensors_header(file).values():
            if isinstance(entry, dict) and entry.get("dtype") in names:
                return names[entry["dtype"]]
    return "float32"


def _safetensors_header(file: Path) -> dict[str, object]:
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header: dict[str, object] = json.loads(f.read(length))
    return header


def check_mergeable_base(base: Path) -> None:
    """A quantized checkpoint cannot take an adapter folded into its weights here."""
    config = json.loads((base / "config.json").read_text())
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method", "?")
        raise UserError(
            f"base model {base} is quantized ({method}); a LoRA adapter folds only into 16/32-bit weights: "
            "pass --base a bf16 copy of the model, or export the adapter alone with --adapter-only"
        )


def prepare_output(out: Path, force: bool, source: Path) -> None:
    """Refuse an output that holds something, unless `force` (it is then replaced at the end), and
    one that is or holds `source` (the run directory: --force would delete it)."""
    if source.resolve().is_relative_to(out.resolve()):
        raise UserError(f"output {out} is or holds the run directory {source}; choose a folder outside it")
    if out.exists() and not out.is_dir():
        raise UserError(f"output {out} is a file; choose a folder path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"output folder {out} is not empty; choose another or pass --force to replace it")


def portable_model_name(name: str) -> str:
    """How an export names its base model: a hub id as written, a local folder by its folder name.

    The trainer records the base as the absolute folder it loaded, which says nothing to whoever
    downloads the export and tells them about the machine it came from."""
    local = Path(name).expanduser()
    if local.exists() or name.startswith(("/", "./", "../", "~")):
        return local.resolve().name
    return name


def write_adapter(policy_dir: Path, out: Path, base_name: str | None = None) -> None:
    """The PEFT adapter folder alone (adapter_config.json + adapter_model.safetensors) as `out`,
    its recorded base model named by `base_name` (default: the recorded one's portable name)."""

    def build(staged: Path) -> None:
        for name in ADAPTER_FILES:
            shutil.copy2(policy_dir / name, staged / name)
        config_path = staged / "adapter_config.json"
        config = json.loads(config_path.read_text())
        recorded = config.get("base_model_name_or_path")
        if base_name is not None or recorded:
            config["base_model_name_or_path"] = portable_model_name(base_name or recorded)
            config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    _write_atomically(out, build)


def write_merged(policy_dir: Path, kind: PolicyKind, base: Path, out: Path, dtype: str) -> None:
    """Merged HF model in `dtype` as `out`: the adapter folded into `base`, or the full weights;
    with `base`'s tokenizer and generation config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    assert dtype in DTYPES, dtype
    if kind == "adapter":
        from peft import PeftModel

        check_mergeable_base(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model = PeftModel.from_pretrained(model, policy_dir).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    model.to(getattr(torch, dtype))
    model.config.use_cache = True
    if (base / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(base)

    def build(staged: Path) -> None:
        model.save_pretrained(staged, safe_serialization=True)
        tokenizer.save_pretrained(staged)

    _write_atomically(out, build)


def _write_atomically(out: Path, build: Callable[[Path], None]) -> None:
    """`build(staged)` fills a temporary sibling of `out`, which then replaces `out`."""
    out = out.absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        build(staged)
        fsync_tree(staged)
        old = None
        if out.exists():
            # prepare_output allowed it: empty, or --force. Moved aside first: os.replace onto a
            # non-empty folder fails, and a kill between the moves leaves the old export intact.
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
        os.replace(staged, out)
        fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise


def push_to_hub(folder: Path, repo: str, public: bool = False) -> str:
    """Upload `folder` to the hub model repo `repo` (created private unless `public`; an existing
    repo keeps its visibility); returns one line to print. Offline (HF_HUB_OFFLINE=1) it is skipped;
    a hub that cannot be reached or refuses is a UserError naming what to check."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        return f"skipped --push-to-hub {repo}: HF_HUB_OFFLINE is set (the export is in {folder})"
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    api = HfApi()
    try:
        api.create_repo(repo, repo_type="model", exist_ok=True, private=not public)
        commit = api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="model")
    except (HfHubHTTPError, LocalTokenNotFoundError, httpx2.HTTPError, OSError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(
            f"push to {repo} failed ({reason}); the export is in {folder}: check the network and your "
            f"token (HF_TOKEN or `hf auth login`), then upload it with `hf upload {repo} {folder}`"
        ) from exc
    visibility = "public" if public else "private unless it existed before"
    return f"pushed {folder} to {commit.repo_url} ({visibility})"
