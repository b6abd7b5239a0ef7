"""Compiles `_paged_attn_kernel` for sm_90a (H100/H200) without a GPU: Triton's NVIDIA backend
and its bundled ptxas run on any machine. Run as a script (TRITON_INTERPRET unset: under the
interpreter `triton.jit` gives functions that cannot be compiled); prints one JSON line per
case: {"case": ..., "ok": bool, "error": str}.

Each case is (name, q dtype, kv dtype, head_dim, group, max_query_len, window, softcap, sinks,
num_splits, fresh_new[, pdl[, merge_last[, one_block]]]); the constexprs come from
`kernel_constexprs`, as in a launch, with pointers and strides marked 16-divisible as Triton
specialises them at launch. A case with `pdl` (swaserve/ops/pdl.py) must also show the PDL
instructions in its PTX. Split cases merge in the kernel (`merge_last`, SWASERVE_ATTN_MERGE=1;
default on here, with splits, so that the opt-in variant stays compiled): their PTX must hold
the barrier and the gpu-scope acq_rel atomic the merge's ordering rests on.
"""

from __future__ import annotations

import json
import os
import sys

import torch

CASES = [
    ("prefill fp8 fresh D32 G4", torch.bfloat16, "fp8", 32, 4, 1000, 0, 0.0, False, 1, True),
    ("prefill fp8 fresh D128 G4", torch.bfloat16, "fp8", 128, 4, 1000, 0, 0.0, False, 1, True),
    ("prefill fp8 fresh D256 G4 window softcap", torch.bfloat16, "fp8", 256, 4, 1000, 512,
     30.0, False, 1, True),
    ("mixed fp8 fresh D64 G8 window sinks", torch.bfloat16, "fp8", 64, 8, 8, 128, 0.0, True, 1,
     True),
    ("decode fp8 D128 G4 16 splits", torch.bfloat16, "fp8", 128, 4, 1, 0, 0.0, False, 16, False),
    # the decode launch of a mixed fp8 batch: the decode tile with the fresh-K/V paths
    ("mixed-decode fp8 fresh D128 G4 2 splits", torch.bfloat16, "fp8", 128, 4, 1, 0, 0.0, False,
     2, True),
    ("mixed-decode fp8 fresh D32 G4", torch.bfloat16, "fp8", 32, 4, 1, 0, 0.0, False, 1, True),
    ("prefill bf16 D128 G4", torch.bfloat16, torch.bfloat16, 128, 4, 1000, 0, 0.0, False, 1,
     False),
    # a bf16 cache's chunks read their own K/V fresh too (TritonBackend.forward)
    ("prefill bf16 fresh D128 G4", torch.bfloat16, torch.bfloat16, 128, 4, 1000, 0, 0.0, False,
     1, True),
    ("prefill bf16 fresh D256 G4 window softcap", torch.bfloat16, torch.bfloat16, 256, 4, 1000,
     512, 30.0, False, 1, True),
    ("mixed bf16 fresh D64 G8 window sinks", torch.bfloat16, torch.bfloat16, 64, 8, 8, 128, 0.0,
     True, 1, True),
    # head_dim 8 (the tiny DFlash test drafter): tl.dot needs K >= 16 on the GPU
    ("verify f32 fresh D8 G2", torch.float32, torch.float32, 8, 2, 8, 0, 0.0, False, 1, True),
    # batch-1 decode with programmatic dependent launch (a decode graph's launch)
    ("decode bf16 D128 G4 64 splits pdl", torch.bfloat16, torch.bfloat16, 128, 4, 1, 0, 0.0,
     False, 64, False, True),
    # the separate merge (`_reduce_splits`), the default
    ("decode bf16 D128 G4 64 splits pdl separate merge", torch.bfloat16, torch.bfloat16, 128, 4,
     1, 0, 0.0, False, 64, False, True, False),
    ("decode bf16 D256 G2 window sinks 8 splits", torch.bfloat16, torch.bfloat16, 256, 2, 1,
     1024, 0.0, True, 8, False),
    # Gemma 4's full layers: 512-dim heads, 8 query heads a KV head (31B), its own tiles
    ("prefill bf16 fresh D512 G8", torch.bfloat16, torch.bfloat16, 512, 8, 1000, 0, 0.0, False,
     1, True),
    ("mixed-decode bf16 fresh D512 G8", torch.bfloat16, torch.bfloat16, 512, 8, 1, 0, 0.0,
     False, 1, True),
    ("decode bf16 D512 G8 8 splits pdl", torch.bfloat16, torch.bfloat16, 512, 8, 1, 0, 0.0,
     False, 8, False, True),
    ("prefill fp8 fresh D512 G8", torch.bfloat16, "fp8", 512, 8, 1000, 0, 0.0, False, 1, True),
    ("mixed-decode fp8 fresh D512 G8", torch.bfloat16, "fp8", 512, 8, 1, 0, 0.0, False, 1,
     True),
    # a mixed CUDA graph's two launches: the decodes one program row per request (ONE_BLOCK),
    # a short chunk over a long context splitting its keys
    ("mixed-decode bf16 D128 G4 8 splits pdl one block", torch.bfloat16, torch.bfloat16, 128,
     4, 1, 0, 0.0, False, 8, False, True, False, True),
    ("mixed-chunk bf16 D128 G2 4 splits pdl", torch.bfloat16, torch.bfloat16, 128, 2, 192, 0,
     0.0, False, 4, False, True, False),
    ("prefill bf16 fresh D256 G2 window", torch.bfloat16, torch.bfloat16, 256, 2, 1000, 1024,
     0.0, False, 1, True),
]
# Shared memory a block may use on sm_90 (H100/H200: 227 KiB): a kernel past it compiles but
# fails at launch ("out of resources")
SM90_MAX_SHARED = 232448

def _check_pdl(kernel, pdl: bool) -> None:
    """A PDL variant waits on the kernel before it (griddepcontrol.wait); no other does."""
    if ("griddepcontrol.wait" in kernel.asm["ptx"]) != pdl:
        raise AssertionError(f"griddepcontrol.wait {'missing from' if pdl else 'in'} the PTX")


def compile_case(case: tuple) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from swaserve.attention.kernels import paged_attention as pa

    _, q_dtype, kv, d, group, qlen, window, softcap, sinks, splits, fresh = case[:11]
    pdl = len(case) > 11 and case[11]
    merge = case[12] if len(case) > 12 else splits > 1
    one_block = len(case) > 13 and case[13]
    kv_dtype = pa.FP8 if kv == "fp8" else kv
    cfg = pa.attention_config(d, group, qlen, kv_dtype)
    consts = pa.kernel_constexprs(
        q_dtype, kv_dtype, d, group, 16, cfg, window=window, softcap=softcap, use_sinks=sinks,
        num_splits=splits, fresh_new=fresh, interpret=False, fp8_cvt=True, pdl=pdl,
        merge_last=merge, one_block=one_block,
    )
    tq = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[q_dtype]
    tkv = "fp8e4nv" if kv == "fp8" else tq
    ptrs = {"k_cache_ptr": tkv, "v_cache_ptr": tkv, "block_table_ptr": "i32", "qsl_ptr": "i32",
            "seq_lens_ptr": "i32", "sinks_ptr": "fp32", "part_acc_ptr": "fp32",
            "part_ml_ptr": "fp32", "part_n_ptr": "i32", "counter_ptr": "i32",
            "split_cap_ptr": "i32"}
    fn = pa._paged_attn_kernel
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + ptrs.get(name, tq)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in fn.do_not_specialize:  # as launched: no "% 16" hint
            sig[name] = "i32"
        elif name.startswith("stride_"):
            sig[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    _check_pdl(kernel, pdl)
    if kernel.metadata.shared > SM90_MAX_SHARED:
        raise AssertionError(f"{kernel.metadata.shared} bytes of shared memory (sm_90: at most "
                             f"{SM90_MAX_SHARED})")
    ptx = kernel.asm["ptx"]
    in_kernel = "atom.global.gpu.acq_rel.add" in ptx or "atom.acq_rel.gpu.global.add" in ptx
    if in_kernel != (merge and splits > 1) or (in_kernel and "bar.sync" not in ptx):
        raise AssertionError(f"in-kernel split merge: atomic in PTX {in_kernel}, wanted {merge}")


# The split merge (`_reduce_splits`): one variant for every split count (a runtime loop bound).
REDUCE_CASES = [
    ("reduce splits D128 bf16", torch.bfloat16, 128, False),
    ("reduce splits D64 sinks fp32", torch.float32, 64, True),
    ("reduce splits D128 bf16 pdl", torch.bfloat16, 128, False, True),
]


def compile_reduce(case: tuple) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from swaserve.attention.kernels import paged_attention as pa

    _, out_dtype, d, sinks = case[:4]
    pdl = len(case) > 4 and case[4]
    fn = pa._reduce_splits
    tout = {torch.bfloat16: "bf16", torch.float32: "fp32"}[out_dtype]
    consts = dict(NUM_HEADS=32, HEAD_DIM=d, D_PAD=d, BLOCK_S=pa.REDUCE_BLOCK_S, USE_SINKS=sinks,
                  USE_PDL=pdl)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + (tout if name == "out_ptr" else "fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    _check_pdl(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}),
               pdl)


# The decode GEMV (swaserve/ops/gemv.py), default tiles: (name, dtype, rows, N, K, norm, bias,
# residual[, pdl[, rope[, e4m3 weights]]]); rope: the q/k/v GEMV finishing the attention prologue
# (RopeStore) into a "model" or "fp8" cache, Llama-8B's heads (32 q, 8 kv, D 128); e4m3 weights:
# `--quantization fp8`'s codes with a scale per row (`weight_scale`)
GEMV_CASES = [
    ("gemv bf16 norm", torch.bfloat16, 1, 6144, 4096, True, False, False),
    ("gemv bf16 norm wide", torch.bfloat16, 2, 28672, 4096, True, False, False),
    ("gemv bf16 head", torch.bfloat16, 1, 128256, 4096, False, False, False),
    ("gemv bf16 residual bias odd K 2 rows", torch.bfloat16, 2, 4096, 4100, False, True, True),
    ("gemv fp32 norm residual", torch.float32, 1, 4096, 14336, True, False, True),
    ("gemv bf16 silu residual", torch.bfloat16, 1, 4096, 14336, "silu", False, True),
    ("gemv bf16 silu residual 2 rows", torch.bfloat16, 2, 4096, 14336, "silu", False, True),
    # past MAX_ROWS (gemv.ROW_TILES): tensor-core tiles (GemvConfig.use_dot) for q/k/v, o and
    # gate/up, the elementwise one for down
    ("gemv dot bf16 norm 8 rows", torch.bfloat16, 8, 6144, 4096, True, False, False),
    ("gemv dot bf16 norm wide 8 rows", torch.bfloat16, 8, 28672, 4096, True, False, False),
    ("gemv dot bf16 residual 8 rows", torch.bfloat16, 8, 4096, 4096, False, False, True),
    ("gemv bf16 silu residual 16 rows", torch.bfloat16, 16, 4096, 14336, "silu", False,
     True),
    ("gemv bf16 norm pdl", torch.bfloat16, 1, 6144, 4096, True, False, False, True),
    ("gemv bf16 silu residual pdl", torch.bfloat16, 1, 4096, 14336, "silu", False, True, True),
    ("gemv bf16 norm rope store pdl", torch.bfloat16, 1, 6144, 4096, True, False, False, True,
     "model"),
    ("gemv bf16 norm rope store fp8 2 rows", torch.bfloat16, 2, 6144, 4096, True, False, False,
     False, "fp8"),
    ("gemv dot bf16 norm rope store 8 rows", torch.bfloat16, 8, 6144, 4096, True, False, False,
     False, "model"),
    ("gemv e4m3 weights norm rope store pdl", torch.bfloat16, 1, 6144, 4096, True, False, False,
     True, "model", True),
    ("gemv e4m3 weights silu residual 2 rows", torch.bfloat16, 2, 4096, 14336, "silu", False,
     True, False, None, True),
    ("gemv e4m3 weights head", torch.bfloat16, 1, 128256, 4096, False, False, False, False, None,
     True),
    ("gemv dot e4m3 weights norm 8 rows", torch.bfloat16, 8, 6144, 4096, True, False, False,
     False, None, True),
    ("gemv dot e4m3 weights residual 8 rows", torch.bfloat16, 8, 4096, 4096, False, False, True,
     False, None, True),
]


def compile_gemv(case: tuple) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from swaserve.ops import gemv as g
    from swaserve.ops.activation import ACT_IDS

    _, dtype, m, n, k, norm, bias, res = case[:8]
    pdl = len(case) > 8 and case[8]
    rope = case[9] if len(case) > 9 else None
    wfp8 = len(case) > 10 and case[10]
    act = norm if isinstance(norm, str) else None  # an activation name in the norm column
    norm = norm is True
    if m > g.MAX_ROWS:  # the engine's tile past MAX_ROWS rows for this projection
        proj = "down" if act else "gate_up" if norm and n >= 16384 else "qkv" if norm else "o"
        cfg = g.row_config(m, proj)
    else:
        cfg = g.default_config(m, n, k, norm, act is not None)
    t = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    consts = dict(
        K=k, HAS_BIAS=bias, HAS_RES=res, HAS_NORM=norm, NUM_STAGES=cfg.num_stages,
        ACT=-1 if act is None else ACT_IDS[act], USE_DOT=cfg.use_dot, INTERPRET=False,
        BLOCK_M=max(16, triton.next_power_of_2(m)) if cfg.use_dot else triton.next_power_of_2(m),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_PDL=pdl, HAS_WSCALE=wfp8,
    )
    if rope:
        assert g.rope_store_fits(128, 64, cfg.block_n), cfg
        consts.update(ROPE=True, Q_DIM=32 * 128, KV_DIM=8 * 128, HEAD_D=128, PAGE_SIZE=16,
                      FP8=rope == "fp8")  # fmt: skip
    cache_t = "fp8e4nv" if rope == "fp8" else t
    ptrs = {"POS": "i64", "INV_FREQ": "fp32", "SLOTS": "i64", "K_CACHE": cache_t,
            "V_CACHE": cache_t, "WS": "fp32"}  # fmt: skip
    if wfp8:
        ptrs["W"] = "fp8e4nv"
    fn = g._gemv_kernel
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("X", "W", "B", "R", "G", "Y") or name in ptrs:
            sig[name] = "*" + ptrs.get(name, t)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("eps", "g_offset", "rot_scale", "k_scale", "v_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg.num_warps})
    _check_pdl(kernel, pdl)


# The rotary kernel (swaserve/ops/rotary.py): (name, dtype, q heads, kv heads, half). Zero q
# heads is the DFlash drafter's context keys turned alone (one masked q lane); smollm2's
# drafter (3 KV heads, D 64) and the tiny test drafter (float32, D 8).
ROTARY_CASES = [
    ("rotary bf16 keys alone D64", torch.bfloat16, 0, 3, 32),
    ("rotary fp32 keys alone D8", torch.float32, 0, 2, 4),
    ("rotary bf16 q and k D64", torch.bfloat16, 9, 3, 32),
]


def compile_rotary(case: tuple) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from swaserve.ops import rotary as r

    _, dtype, hq, hk, half = case
    t = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    consts = dict(zip(("BLOCK_HQ", "BLOCK_HK", "BLOCK_HALF"), r.rotary_blocks(hq, hk, half),
                      strict=True))  # as apply_rotary launches it
    ptrs = {"Q": t, "K": t, "POS": "i64", "INV_FREQ": "fp32"}
    fn = r._rotary_kernel
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = "*" + ptrs[name]
        else:
            sig[name] = "fp32" if name == "SCALE" else "i32"
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "unset TRITON_INTERPRET"
    names = sys.argv[1:]
    for case, compile_one in [(c, compile_case) for c in CASES] + [
        (c, compile_reduce) for c in REDUCE_CASES
    ] + [(c, compile_gemv) for c in GEMV_CASES] + [(c, compile_rotary) for c in ROTARY_CASES]:
        if names and case[0] not in names:
            continue
        try:
            compile_one(case)
            res = {"case": case[0], "ok": True, "error": ""}
        except Exception as e:  # noqa: BLE001 - reported per case
            res = {"case": case[0], "ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
        print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
