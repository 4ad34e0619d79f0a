#!/usr/bin/env bash
# Set up .venv (if needed) and run the whole test suite this machine can run, plus the linters.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup_env.sh

export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
echo "[test] ruff"
.venv/bin/ruff check .
echo "[test] pytest"
exec .venv/bin/pytest "$@"
