#!/usr/bin/env bash
# Set up .venv (if needed), check the machine, and run the main job on its embedded default.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup_env.sh

export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
.venv/bin/areal-npu doctor
# Until the RL loop lands, the main job is the rollout smoke run: a tiny Qwen3.5 + MTP model
# served by vLLM with MTP speculative decoding, checked against a transformers forward pass.
exec .venv/bin/python scripts/smoke_rollout.py "$@"
