#!/usr/bin/env bash
# Installs what the tests need (scripts/setup.sh) and runs the suite without the tests marked
# `slow` (multi-process, stress); `scripts/test.sh -m slow` runs those (a later -m wins), and
# .ci/run runs both.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1 TOKENIZERS_PARALLELISM=false
# One intra-op thread per process: the suite runs server processes beside the test process on
# 2 cores, where spinning OpenMP threads made small ops ~10x slower (measured: Gemma 3 270M,
# 16 greedy tokens, 1.5 s with one thread vs 17 s with two under contention).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Test files run in parallel, each whole on one worker (--dist loadfile: a file's session
# fixtures, models and servers, load once per worker; its tests keep their order). Two workers
# on the 2-core CI machine (13 min serial, 7.5 min parallel); SWASERVE_TEST_WORKERS=0 runs
# serially, e.g. to debug.
workers=${SWASERVE_TEST_WORKERS:-$(.venv/bin/python -c "import os; print(min(4, os.cpu_count() or 1))")}
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile \
    -m "not slow" "$@" tests
