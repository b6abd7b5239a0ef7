#!/usr/bin/env bash
# NIXL for the GPU machine (CPython 3.12, x86_64, no package index there): the nixl-cu13 wheel
# (~56 MiB, UCX 1.23 inside) trimmed to ~27 MiB, one carry beside the working tree (a device
# call carries at most 64 MiB). The trim drops what swaserve never loads: the nixl_ep
# extension modules (built for torch 2.12-2.14, ~27 MiB) and UCX's perftest library.
#
#   here:    bash scripts/nixl_for_device.sh pack          -> .devcarry/nixl/ (one folder)
#   device:  carry [".devcarry/nixl"], then eval "$(bash scripts/nixl_for_device.sh install /root/nixl)"
#
# `install DIR` checks the archive's SHA-256, unpacks it into DIR/site (nothing installed on the
# device is changed) and prints the `export PYTHONPATH=...` that adds it. Used on the H200 on
# 2026-12-02 (tests/gpu/test_disagg_cuda.py and benchmarks/pd_transfer.py ran from it).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL=nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl
TRIMMED=nixl_cu13-1.5.1-cp312-trimmed.zip
case "${1:-}" in
pack)
    py=${PYTHON:-.venv/bin/python}
    [ -x "$py" ] || py=python3
    # .devcarry/ stays out of git (a worktree shares the main checkout's info/exclude)
    exclude="$(git rev-parse --git-common-dir)/info/exclude"
    grep -qx "/.devcarry/" "$exclude" 2>/dev/null || echo "/.devcarry/" >>"$exclude"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "$py" -m pip download -q --no-deps -d "$tmp" --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --only-binary=:all: nixl-cu13==1.5.1
    [ -f "$tmp/$WHEEL" ] || { echo "pip did not fetch $WHEEL" >&2; exit 1; }
    rm -rf .devcarry/nixl && mkdir -p .devcarry/nixl
    "$py" - "$tmp/$WHEEL" ".devcarry/nixl/$TRIMMED" <<'EOF'
import sys
import zipfile

src, dst = zipfile.ZipFile(sys.argv[1]), zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED)
for info in src.infolist():
    name = info.filename
    if (name.startswith("nixl_ep_cu13/") and name.endswith(".so")) or "perftest" in name:
        continue
    dst.writestr(info, src.read(name))
dst.close()
EOF
    (cd .devcarry/nixl && sha256sum "$TRIMMED" >SHA256SUMS)
    du -sh .devcarry/nixl
    ;;
install)
    dir=${2:?usage: nixl_for_device.sh install DIR}
    mkdir -p "$dir/site"
    src=$PWD/.devcarry/nixl
    (cd "$src" && sha256sum -c --quiet SHA256SUMS) >&2
    (cd "$dir/site" && python3 -m zipfile -e "$src/$TRIMMED" .)
    PYTHONPATH=$dir/site${PYTHONPATH:+:$PYTHONPATH} python3 -c "import nixl_cu13" >&2
    echo "unpacked $TRIMMED into $dir/site" >&2
    echo "export PYTHONPATH=$PWD:$(cd "$dir/site" && pwd)\${PYTHONPATH:+:\$PYTHONPATH}"
    ;;
*)
    sed -n '2,12p' "$0"
    exit 2
    ;;
esac
