#!/usr/bin/env bash
# NIXL for the GPU machine (CPython 3.12, x86_64, no package index there): the nixl-cu13 wheel
# (~56 MiB, UCX 1.23 inside) in two parts of at most 30 MiB, one folder each, since a device
# call carries at most 64 MiB with the working tree.
#
#   here:    bash scripts/nixl_for_device.sh pack        -> .devcarry/nixl0, .devcarry/nixl1
#   device:  call 1, carry [".devcarry/nixl0"]: mkdir -p /root/nixl && cp .devcarry/nixl0/* /root/nixl/
#            call 2 (within the machine's warm time), carry [".devcarry/nixl1"]:
#            cp .devcarry/nixl1/* /root/nixl/ && eval "$(bash scripts/nixl_for_device.sh install /root/nixl)"
#
# `install DIR` joins the parts, checks the wheel's SHA-256, installs it into DIR/site (nothing
# installed on the device is changed) and prints the `export PYTHONPATH=...` that adds it.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL=nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl
MAX_PART=$((30 * 1024 * 1024))
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
    rm -rf .devcarry/nixl0 .devcarry/nixl1 && mkdir -p .devcarry/nixl0 .devcarry/nixl1
    (cd "$tmp" && split -n 2 -d -a 1 "$WHEEL" "$WHEEL.part" && sha256sum "$WHEEL" >SHA256SUMS)
    for i in 0 1; do
        part="$tmp/$WHEEL.part$i"
        if [ "$(stat -c %s "$part")" -gt "$MAX_PART" ]; then
            echo "part $i is over 30 MiB" >&2
            exit 1
        fi
        mv "$part" ".devcarry/nixl$i/"
        cp "$tmp/SHA256SUMS" ".devcarry/nixl$i/"
    done
    du -sh .devcarry/nixl0 .devcarry/nixl1
    ;;
install)
    dir=$(cd "${2:?usage: nixl_for_device.sh install DIR}" && pwd)
    cat "$dir/$WHEEL.part0" "$dir/$WHEEL.part1" >"$dir/$WHEEL"
    (cd "$dir" && sha256sum -c --quiet SHA256SUMS) >&2
    python3 -m pip install -q --no-index --no-deps --disable-pip-version-check \
        --target "$dir/site" --upgrade "$dir/$WHEEL" >&2
    PYTHONPATH=$dir/site${PYTHONPATH:+:$PYTHONPATH} python3 -c "import nixl_cu13" >&2
    echo "installed $WHEEL into $dir/site" >&2
    echo "export PYTHONPATH=$PWD:$dir/site\${PYTHONPATH:+:\$PYTHONPATH}"
    ;;
*)
    sed -n '2,12p' "$0"
    exit 2
    ;;
esac
