#!/usr/bin/env bash
# What only a CUDA machine can show, in one go: the `cuda`-marked tests, the rest of the suite that
# needs no vLLM, and the packed-attention and log-prob benchmarks on the GPU. Uses the machine's own
# torch (no venv): install areal-npu into it first (`pip install --no-deps -e .`). Results and logs go
# to $OUT (default /tmp/cuda-check). Each part has its own time limit so that one slow part cannot
# starve the others; the exit code is the cuda tests'.
set -uo pipefail
out="${OUT:-/tmp/cuda-check}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
"$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/gpu.txt"

echo "== benchmarks"
timeout 150 "$py" scripts/bench_attention.py --json "$out/attention_cuda.json" 2>"$out/attention.err"
timeout 240 "$py" scripts/bench_logprobs.py --device cuda --dtype bfloat16 --hidden 2048 --chunk-size 2048 \
  --seq-lens 8192,65536 --vocabs 152064 --reps 5 --naive-max-gb 100 --json "$out/logprobs_cuda.json" \
  2>"$out/logprobs.err"

echo "== cuda tests"
timeout 150 "$py" -P -m pytest -m cuda -q -p no:cacheprovider tests 2>&1 | tee "$out/pytest_cuda.log"
rc=${PIPESTATUS[0]}

echo "== the suite without vLLM"
timeout "${SUITE_TIMEOUT:-300}" "$py" -P -m pytest -m "not vllm and not cuda" -q -p no:cacheprovider \
  --timeout 120 tests 2>&1 | tee "$out/pytest_suite.log" | tail -25
exit "$rc"
