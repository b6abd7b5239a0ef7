#!/usr/bin/env bash
# The server's dependencies for the GPU machine (CPython 3.12, x86_64, no package index there;
# it lacks fastapi, uvicorn, pydantic and pyzmq), at the versions of this checkout's .venv.
#
#   here:    bash scripts/server_wheels_for_device.sh pack          -> .devcarry/srv/ (~10 MB)
#   device:  carry [".devcarry/srv"], then
#            eval "$(bash scripts/server_wheels_for_device.sh install /root/srvpy)"
#
# `install` puts only the wheels whose module the device's python3 cannot import into a
# folder of their own and prints the `export PYTHONPATH=...` that adds it (nothing installed
# on the device is changed or shadowed). benchmarks/serve_vs_offline.py then runs there.
set -euo pipefail
cd "$(dirname "$0")/.."
# wheel name = import name, one per line
MODULES="fastapi=fastapi starlette=starlette annotated-doc=annotated_doc pydantic=pydantic
pydantic_core=pydantic_core annotated-types=annotated_types typing-inspection=typing_inspection
uvicorn=uvicorn h11=h11 httptools=httptools click=click pyzmq=zmq prometheus_client=prometheus_client anyio=anyio
sniffio=sniffio httpx=httpx httpcore=httpcore idna=idna certifi=certifi Jinja2=jinja2
MarkupSafe=markupsafe typing_extensions=typing_extensions opentelemetry-api=opentelemetry"
case "${1:-}" in
pack)
    py=${PYTHON:-.venv/bin/python}
    grep -qx "/.devcarry/" .git/info/exclude 2>/dev/null || echo "/.devcarry/" >>.git/info/exclude
    rm -rf .devcarry/srv && mkdir -p .devcarry/srv
    pins=()
    for pair in $MODULES; do
        name=${pair%%=*}
        version=$("$py" -c "import importlib.metadata as m; print(m.version('$name'))")
        pins+=("$name==$version")
    done
    "$py" -m pip download -q --no-deps -d .devcarry/srv --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any --only-binary=:all: "${pins[@]}"
    (cd .devcarry/srv && sha256sum ./*.whl >SHA256SUMS)
    du -sh .devcarry/srv
    ;;
install)
    target=${2:?usage: server_wheels_for_device.sh install DIR}
    src=$PWD/.devcarry/srv
    (cd "$src" && sha256sum -c --quiet SHA256SUMS) >&2
    mkdir -p "$target"
    missing=()
    for pair in $MODULES; do
        name=${pair%%=*} module=${pair##*=}
        python3 -c "import $module" 2>/dev/null && continue
        missing+=("$(ls "$src"/*.whl | grep -i "/$(echo "$name" | tr '-' '_')-" | head -1)")
    done
    if ((${#missing[@]})); then
        python3 -m pip install -q --no-index --no-deps --disable-pip-version-check \
            --target "$target" "${missing[@]}" >&2
        printf 'installed %s\n' "${missing[@]##*/}" >&2
    fi
    check="import fastapi, uvicorn, httptools, pydantic, zmq, httpx, prometheus_client, jinja2, opentelemetry"
    if ! PYTHONPATH=$target python3 -c "$check" 2>/dev/null; then
        # pydantic wants a newer typing_extensions than the device's: this one goes first
        python3 -m pip install -q --no-index --no-deps --disable-pip-version-check \
            --target "$target" --upgrade "$src"/typing_extensions-*.whl >&2
        PYTHONPATH=$target python3 -c "$check" >&2
    fi
    echo "export PYTHONPATH=$PWD:$target\${PYTHONPATH:+:\$PYTHONPATH}"
    ;;
*)
    sed -n '2,11p' "$0"
    exit 2
    ;;
esac
