#!/usr/bin/env bash
# Installs swaserve (scripts/setup.sh) and generates with the built-in default model.
# Usage: scripts/generate.sh "prompt text" [more swaserve generate flags]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
prompt=${1:-"What is the capital of France?"}
shift || true
exec .venv/bin/swaserve generate --prompt "$prompt" "$@"
