#!/usr/bin/env bash
# Qwen3.6-27B, 64K-token code-agent RL on Ascend A2 nodes (8 NPUs of 64 GB each), from the
# areal-npu a2 image. On every node, inside the container (scripts/run_container.sh):
#
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node 0> MODEL_PATH=/models/Qwen3.6-27B TASKS=/data/tasks.jsonl \
#     bash recipes/code_agent_64k/qwen3_6_27b_a2.sh [--dry-run [--json]] [key=value ...]
#
# --dry-run runs anywhere (no NPU, no checkpoint needed) and prints the plan; --help lists the
# variables. Starting the job itself is not built yet (multi-rank launch): the script says so.
set -euo pipefail

CHIP=A2
DEVICES_PER_NODE=8
DEFAULT_NNODES=4
RECIPE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/qwen3_6_27b_a2.yaml"
# shellcheck source=recipes/code_agent_64k/_launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/_launch.sh"
