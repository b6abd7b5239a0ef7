#!/usr/bin/env bash
# Every GPU benchmark of the project in priority order, each under its own time limit, logs
# and JSON under $OUT (default ./bench_out); a cut-off run keeps what the earlier ones wrote.
# The default steps take ~30 min: more than one device call (10 min each), so pick with STEPS;
# gemv, serve_vs_offline, greedy_agreement, pd_transfer, kv_bound_*, ahead_* and stress_cuda run
# only when named. E.g.
#   STEPS="engine_decode offline_vs_hf" bash benchmarks/run_gpu.sh
#   STEPS="window_vs_full fp8_vs_bf16 fp8_gemma270m" bash benchmarks/run_gpu.sh g.gguf
# Usage (repo root): [STEPS="..."] bash benchmarks/run_gpu.sh [gemma-3-270m.gguf]
set -u
OUT=${OUT:-bench_out}
export OUT PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
mkdir -p "$OUT"
STEPS=${STEPS:-engine_decode offline_vs_hf attention fp8_sweep window_vs_full fp8_vs_bf16 fp8_gemma270m step_profile fused_moe spec_dflash gpu_tests}
step() {  # step NAME SECONDS CMD...
    local name=$1 limit=$2
    shift 2
    case " $STEPS " in *" $name "*) ;; *) return ;; esac
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "$name: rc=$? in $((SECONDS - t0)) s"
}
step engine_decode 240 python3 benchmarks/engine_decode.py
step offline_vs_hf 420 python3 benchmarks/offline_vs_hf.py 1000 32
step attention 120 python3 benchmarks/attention_kernels.py
step fp8_sweep 150 python3 benchmarks/fp8_attention_sweep.py
step window_vs_full 240 python3 benchmarks/window_vs_full.py
step fp8_vs_bf16 180 python3 benchmarks/fp8_vs_bf16.py
if [ $# -ge 1 ]; then
    step fp8_gemma270m 300 python3 benchmarks/fp8_gemma270m.py "$1" --prompts 64
fi
step step_profile 240 python3 benchmarks/step_profile.py
step fused_moe 150 python3 benchmarks/fused_moe.py
step gemv 300 python3 benchmarks/gemv_bench.py --rows 1 2 4 8 16
# the KV-bound prefill cap (--kv-bound-step-tokens, opt-in) on the Gemma-3-27B runs it is built
# for, off against two caps (H200: the 27B and 20 GiB of KV do not fit an H100); named only
step kv_bound_decode 560 python3 benchmarks/vs_vllm.py --workloads hybrid-decode --engines \
    swaserve swaserve@kv_bound_step_tokens=192 swaserve@kv_bound_step_tokens=256
step kv_bound_prefill 560 python3 benchmarks/vs_vllm.py --workloads hybrid-prefill --engines \
    swaserve swaserve@kv_bound_step_tokens=192 swaserve@kv_bound_step_tokens=256
# prefill ahead (--prefill-ahead-tokens, opt-in) against off and the cap: it parks prompts in
# the prefix cache's host tier, which the hybrid workloads turn off for the peer's sake (the
# prompts share nothing, so the cache brings nothing else); 40 GiB of pinned host memory
AHEAD="disable_prefix_cache=False,host_cache_gb=40,prefill_ahead_tokens"
step ahead_decode 580 python3 benchmarks/vs_vllm.py --workloads hybrid-decode --engines \
    swaserve swaserve@kv_bound_step_tokens=192 "swaserve@$AHEAD=128"
step ahead_prefill 580 python3 benchmarks/vs_vllm.py --workloads hybrid-prefill --engines \
    swaserve "swaserve@$AHEAD=192" "swaserve@$AHEAD=128"
# the server's dependencies: `bash scripts/server_wheels_for_device.sh pack` here, carry
# .devcarry/srv, then eval "$(bash scripts/server_wheels_for_device.sh install /root/srvpy)"
# SVO_ARGS: its flags, e.g. "--rows offline serve --stream-intervals 1 4"
# shellcheck disable=SC2086  # word splitting of SVO_ARGS is intended
step serve_vs_offline 600 python3 benchmarks/serve_vs_offline.py ${SVO_ARGS:-}
# NIXL importable: `bash scripts/nixl_for_device.sh pack` here, carry .devcarry/nixl, then
# eval "$(bash scripts/nixl_for_device.sh install /root/nixl)"
step pd_transfer 300 python3 benchmarks/pd_transfer.py
# with the built-in models importable (their GGUF parts joined on the device)
step greedy_agreement 300 python3 benchmarks/greedy_agreement.py smollm2-135m-instruct
# DFlash on the built-in model needs a trained drafter: DRAFTER=DIR (swaserve train-drafter)
if [ -n "${DRAFTER:-}" ]; then
    step spec_dflash 300 python3 benchmarks/spec_dflash.py --drafter "$DRAFTER"
fi
# tests/gpu/test_dflash_cuda.py needs the dflash reference (pure Python, 25 kB): carry its
# folder and put it on PYTHONPATH (PYTHONPATH=$PWD/.dev/pylib:...), or it skips.
# -u: a step killed at its limit still leaves what pytest printed so far in its log
step gpu_tests 300 python3 -u -m pytest -q -rf tests/gpu --ignore=tests/gpu/test_stress_cuda.py
# the CUDA stress sweeps alone (named only), each workload's time live in the log
step stress_cuda 580 python3 -u -m pytest -v -rf --log-cli-level=INFO tests/gpu/test_stress_cuda.py
shopt -s nullglob
for f in "$OUT"/*.log; do
    echo "== $f"
    tail -n 15 "$f"
done
