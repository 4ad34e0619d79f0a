#!/usr/bin/env bash
# Set up .venv (if needed) and run the whole test suite this machine can run, plus the linters, then
# the model tests again with the lowest supported transformers, then the rollout tests again on
# vLLM 0.23 (the images' version). Extra arguments go to the first pytest run, e.g.
# `bash scripts/test.sh -m "not slow"`. AREAL_FULL=1 also runs the `full`-marked tests: six long
# end-to-end runs whose parts other tests cover, left out of CI's 90 minutes (~12 min on 2 cores).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# vLLM 0.23's virtualenv (the last leg, below) installs in the background meanwhile: downloads and
# unpacking, ~5 min on a new machine that would otherwise wait at the end. Its own session, so that
# stopping early (a failing leg, Ctrl-C) stops its pip too.
vllm023_pid=""
vllm023_log="$root/.venv-vllm023.setup.log"
if [ "${AREAL_SKIP_VLLM023:-0}" != 1 ]; then
  setsid bash scripts/setup_vllm023.sh >"$vllm023_log" 2>&1 &
  vllm023_pid=$!
  trap 'if [ -n "$vllm023_pid" ]; then kill -- "-$vllm023_pid" 2>/dev/null || true; fi' EXIT
fi

bash scripts/setup_env.sh

export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
echo "[test] ruff"
.venv/bin/ruff check .
echo "[test] pytest"
.venv/bin/pytest --durations=30 "$@"

# The other end of the supported transformers range: the model and packing-patch tests again with
# pyproject's lower bound installed beside .venv (first on PYTHONPATH). Under a minute on 2 cores,
# plus ~10 s to install once. AREAL_SKIP_TF_MIN=1 skips it for quick local runs.
run_tf_min=1
if [ "${AREAL_SKIP_TF_MIN:-0}" = 1 ]; then
  echo "[test] lowest transformers: skipped (AREAL_SKIP_TF_MIN=1)"
  run_tf_min=0
fi
if [ "$run_tf_min" = 1 ]; then
  tf_min="$(sed -n 's/^ *"transformers>=\([0-9.]*\).*/\1/p' pyproject.toml)"
  # That release's own pins, which its import-time check enforces (.venv has newer ones).
  tf_min_deps=("huggingface-hub>=1.5,<2" "tokenizers>=0.22,<=0.23.0")
  tf_min_site="$root/.venv-tf-min/site"
  tf_min_stamp="$root/.venv-tf-min/.stamp-$(echo "$tf_min ${tf_min_deps[*]}" | sha256sum | cut -c1-16)"
  if [ ! -f "$tf_min_stamp" ]; then
    echo "[test] installing transformers==$tf_min into $tf_min_site"
    rm -rf "$root/.venv-tf-min"
    .venv/bin/pip install --quiet --disable-pip-version-check --no-deps --target "$tf_min_site" \
      "transformers==$tf_min" "${tf_min_deps[@]}"
    touch "$tf_min_stamp"
  fi
  echo "[test] pytest tests/model with transformers $tf_min"
  PYTHONPATH="$tf_min_site" AREAL_EXPECT_TRANSFORMERS="$tf_min" \
    .venv/bin/pytest -q -p no:cacheprovider -m "not vllm" tests/model tests/compat/test_transformers.py
fi

# vLLM 0.23.0, the version the Ascend images carry, in its own virtualenv (scripts/setup_vllm023.sh,
# started at the top: ~4.5 min and ~6.2 GB the first time, a stamp check afterwards). By default the
# tests that depend on the version: the feature map and the options it refuses, the compat hooks
# (the CPU sampler, the Gated DeltaNet state), the engine server's routes, the in-place reload's
# sequence against 0.23's layer-wise helpers (test_inplace_reload.py; with vLLM 0.23's own Eagle3
# model as vLLM-Ascend builds it: test_eagle3_ascend.py) and the weight transports,
# doctor, and the engines' behaviour (log-probs against transformers, lossless speculation, the
# policy + drafter update). AREAL_VLLM023=all adds the rest of the engine tests (gloo broadcast into
# live engines, the secret, engines SIGKILLed mid-batch and mid-sync, vllm-cpu serving the hybrid):
# ~5 min more, which CI's 90 minutes do not hold beside the main suite.
# AREAL_SKIP_VLLM023=1 skips the leg for quick local runs; CI runs it.
if [ "${AREAL_SKIP_VLLM023:-0}" = 1 ]; then
  echo "[test] vLLM 0.23: skipped (AREAL_SKIP_VLLM023=1)"
  exit 0
fi
vllm023_ok=0
wait "$vllm023_pid" || vllm023_ok=$?
vllm023_pid=""
cat "$vllm023_log"
if [ "$vllm023_ok" != 0 ]; then
  echo "[test] setting up vLLM 0.23 failed (exit $vllm023_ok): $vllm023_log" >&2
  exit 1
fi
v023_tests=(
  tests/compat/vllm/test_features.py tests/rollout/test_vllm_features.py tests/rollout/test_config.py
  tests/rollout/test_server_routes.py tests/rollout/test_inplace_reload.py tests/rollout/test_eagle3_ascend.py
  tests/rollout/test_transports.py tests/compat/vllm/test_cpu_sampling.py tests/compat/vllm/test_v023_cpu_sampling.py
  tests/compat/vllm/test_v023_gdn_state.py tests/test_cli.py::test_doctor_json_carries_the_vllm_version_and_feature_flags
)
v023_select=(-k "not killed")
if [ "${AREAL_VLLM023:-}" = all ]; then
  v023_tests+=(tests/rollout/test_weight_sync_engine.py tests/compat/vllm/test_cpu.py)
  v023_select=()
fi
echo "[test] pytest rollout tests on vLLM 0.23"
.venv-vllm023/bin/pytest -q -p no:cacheprovider -m "not megatron and not distributed" "${v023_select[@]}" \
  tests/rollout/test_engine.py "${v023_tests[@]}"
