#!/usr/bin/env bash
# Qwen3.6-27B, 64K-token code-agent RL on Ascend A2 nodes (8 NPUs of 64 GB each), from the
# areal-npu a2 image. On every node, inside the container (scripts/run_container.sh):
#
#   NNODES=8 NODE_RANK=<0..7> MASTER_ADDR=<node 0> MODEL_PATH=/models/Qwen3.6-27B TASKS=/data/tasks.jsonl \
#     bash recipes/code_agent_64k/qwen3_6_27b_a2.sh [--dry-run [--json]] [key=value ...]
#
# Real SWE tasks: TASKS is a SWE-bench / R2E-Gym format task file; ENV_BACKEND (default auto) picks
# where episodes run: podman / docker / apptainer use each instance's image name as it is, bwrap uses
# the images under IMAGES (task.image_root, e.g. /shared/images, filled once with
# `skopeo copy docker://IMAGE oci:/shared/images/NAME:latest`; unpacked rootless on first use). The
# run refuses, before it allocates anything, a task whose image that backend cannot use here
# (docs/howto/code_agent_64k.md, "Real SWE tasks on an A3 cluster"; check the set first with
# `areal-npu tasks validate $TASKS --backend B --image-root $IMAGES`).
#
# The agent loop is mini-swe-agent v2 through the OpenAI-compatible gateway (HARNESS=shell: the
# built-in loop; HARNESS=package.module:function: your own harness, docs/howto/code_agent.md "Agent harnesses").
#
# --dry-run runs anywhere (no NPU, no checkpoint needed) and prints the plan; --help lists the
# variables. Without --dry-run it starts the job on Ray (LAUNCHER=ray, the default; the ray extra,
# which the images install): node 0 starts the Ray head and, once all NNODES nodes have joined, the
# Ray launcher (areal_npu/launch/ray_launch.py); the other nodes start Ray workers that join it.
# LAUNCHER=torchrun stops with exit code 3 (a multi-node torchrun launch is not built). The Ray
# launch has run on a one-node CPU Ray cluster only, never on NPU nodes.
set -euo pipefail

CHIP=A2
DEVICES_PER_NODE=8
DEFAULT_NNODES=8
RECIPE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/qwen3_6_27b_a2.yaml"
# shellcheck source=recipes/code_agent_64k/_launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/_launch.sh"
