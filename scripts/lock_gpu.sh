#!/usr/bin/env bash
# Renew constraints/gpu.txt (`make lock-gpu`): the versions a GPU machine installs, resolved from
# this machine for linux x86_64 + the CUDA wheels on PyPI, whatever this machine is.
#
# uv resolves pyproject.toml's `gpu`, `dev`, `megatron`, `verifiers` and `openenv` extras once per Python a GPU machine may
# run (scripts/setup.sh takes python3.11, else python3: 3.12 on the lent GPU machines). A package
# pinned the same for both gets one line; one that differs gets a line per Python with a
# `python_version` marker, which pip honours in a constraints file. uv lives in a throwaway venv
# (LOCK_VENV), never in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHONS=(3.11 3.12)
PLATFORM=x86_64-manylinux_2_28
LOCK_VENV="${LOCK_VENV:-/tmp/grpo-lock-venv}"
OUT=constraints/gpu.txt

[[ -x "$LOCK_VENV/bin/uv" ]] || { python3 -m venv "$LOCK_VENV" && "$LOCK_VENV/bin/pip" install -q uv; }
export UV_PYTHON_DOWNLOADS=never

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
resolved=()
for version in "${PYTHONS[@]}"; do
  resolved+=("$tmp/$version.txt")
  "$LOCK_VENV/bin/uv" pip compile --quiet pyproject.toml --extra gpu --extra dev --extra megatron --extra verifiers --extra openenv \
    --python-platform "$PLATFORM" --python-version "$version" --no-header --no-annotate \
    -o "$tmp/$version.txt"
done

python3 - "$OUT" "$PLATFORM" "${resolved[@]}" <<'EOF'
import sys
from pathlib import Path

out, platform, *files = sys.argv[1:]
pins = {}  # name -> {python version: "name==version"}
for file in files:
    version = Path(file).stem
    for line in Path(file).read_text().splitlines():
        if line and not line.startswith("#"):
            pins.setdefault(line.split("==")[0].lower(), {})[version] = line
versions = [Path(f).stem for f in files]
lines = [
    "# Versions a GPU machine installs (scripts/setup.sh when nvidia-smi works): vllm, the torch it pins",
    f"# and every dependency, for linux x86_64 ({platform}) with PyPI's CUDA wheels, Python "
    + " and ".join(versions) + ".",
    "# Regenerate with `make lock-gpu` (scripts/lock_gpu.sh; resolves from any machine). Not yet installed",
    "# on a GPU machine as a whole: the lent GPU machines have no network.",
]
for name in sorted(pins):
    by_version = pins[name]
    if len(set(by_version.values())) == 1 and len(by_version) == len(versions):
        lines.append(next(iter(by_version.values())))
    else:
        lines += [f'{pin} ; python_version == "{v}"' for v, pin in sorted(by_version.items())]
Path(out).write_text("\n".join(lines) + "\n")
print(f"{out}: {len(pins)} packages")
EOF
