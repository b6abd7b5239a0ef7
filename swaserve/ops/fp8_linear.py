"""FP8 weights (`--quantization fp8`, vLLM's flag): the decoder layers' projections quantised
at load to float8 e4m3 with one scale per output channel, their inputs to e4m3 per token at
run time, and the product through `torch._scaled_mm` (FP8 tensor cores on sm89+; on the CPU,
where it serves the tests, a float32 product of the codes):

    s_w[n] = max_k |W[n, k]| / 448          W8[n, k] = e4m3(W[n, k] / s_w[n])   (at load)
    s_x[m] = max_k |x[m, k]| / 448          x8[m, k] = e4m3(x[m, k] / s_x[m])   (each call)
    y[m, n] = s_x[m] s_w[n] sum_k x8[m, k] W8[n, k]  [+ bias[n]]                (fp32 sums)

(448: e4m3's largest finite value; values are clamped to it before the cast, which rounds to
nearest even.) This is compressed-tensors' FP8_DYNAMIC scheme, and what vLLM's online fp8
quantisation does on Hopper with per-token activation scales. Weight memory halves against
bf16, and the GEMMs run at FP8 rate.

What stays in the model's dtype: embeddings and the head (as vLLM), norms, the attention and
its KV (`--kv-cache-dtype fp8` is separate), MoE experts (not quantised yet), and a projection
whose shape the FP8 GEMM cannot take (output or input features not a multiple of 16).
Steps small enough for the decode GEMV (`LlamaDecoderLayer.forward_gemv`: at most 2 tokens on
wide models, 8 on narrow ones) read the codes and scales there with their inputs unquantised
(weights-only fp8, ops/gemv.py `weight_scale`): half the bytes of bf16 and the GEMV's fused
norms, activation and residual adds. So such steps differ from larger ones by the inputs'
quantisation (more exact, not the same numbers). The weights are quantised after the whole
model loaded in its dtype: the bf16 copy must fit once (vLLM quantises per layer).

Tensor parallelism: the planner has cut the projections before they are quantised here (an
FP8 checkpoint's codes and row scales are cut as they load: swaserve/weights/fp8_checkpoint.py);
a row-parallel one (`RowParallelLinear`) keeps its group, adds the bias on rank 0 alone and
all-reduces unless told not to (`reduce`, as Cohere2's parallel block does).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from torch import nn

from swaserve.attention.kernels.paged_attention import _round_to_e4m3

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
_MIN_SCALE = 1e-12  # an all-zero row or channel keeps a finite scale (its values are all 0)
ALIGN = 16  # `_scaled_mm` needs both GEMM extents of the weight in multiples of 16


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows, float32 scales [rows, 1]) of a 2-D tensor, one scale per row: the row's
    largest magnitude maps to 448. Used for weights (rows: output channels) and for
    activations (rows: tokens) alike. On CUDA one Triton launch (`_quant_rows_kernel`, the same
    values bit for bit), else torch ops."""
    if x.is_cuda:
        return quantize_rows_triton(x)
    return quantize_rows_torch(x)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` in one launch of `_quant_rows_kernel` (any device Triton runs on)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quant_rows_kernel[(rows,)](x, q, scale, x.stride(0), q.stride(0), K=k,
                                    BLOCK=min(1024, triton.next_power_of_2(k)))  # fmt: skip
    return q, scale


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` in torch ops (the reference the kernel is tested against)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_MIN_SCALE)
    # divided by a 0-dim tensor, not a Python number: CUDA torch multiplies by the reciprocal
    # of a host scalar (one rounding more), the kernel and the CPU divide correctly rounded
    scale = amax / amax.new_tensor(FP8_MAX)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


@triton.jit
def _quant_rows_kernel(X, Q, S, stride_x, stride_q, K: tl.constexpr, BLOCK: tl.constexpr):
    """One program a row: its largest magnitude (first pass), then the row scaled, clamped and
    rounded to e4m3 (second pass). The rounding is `_round_to_e4m3`'s (nearest, ties to even,
    as torch's cast), so the final cast is exact here and under the interpreter alike."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in tl.range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), 1e-12), 448.0)
    tl.store(S + row, scale)
    for k0 in tl.range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        # div_rn: correctly rounded, as torch's (plain `/` may lower to an approximate divide)
        q = _round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0))
        tl.store(Q + row * stride_q + k, q.to(Q.dtype.element_ty), mask=k < K)


class Fp8Linear(nn.Module):
    """y = x W^T [+ b] with W stored as e4m3 and a float32 scale per output channel (see the
    module doc). `weight` is the [out, in] e4m3 tensor, `weight_scale` [1, out] (the layout
    `_scaled_mm`'s scale_b takes); `out_dtype` is the model's activation dtype. Built from
    a weight to quantise, or from e4m3 codes and their row scales [out, 1] (`weight_scale`:
    an FP8 checkpoint's, swaserve/weights/fp8_checkpoint.py), kept as they are."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
        tp: object | None = None,
        reduce: bool = False,
        weight_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if weight_scale is None:
            q, scale = quantize_rows(weight)
        else:
            assert weight.dtype == FP8 and weight_scale.numel() == weight.shape[0]
            q, scale = weight.detach(), weight_scale.detach().float()
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale.reshape(1, -1).contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.out_dtype = out_dtype
        self.out_features, self.in_features = weight.shape
        # row-parallel (input features split over the ranks): partial sums, reduced here
        # unless `reduce` is switched off by a caller that reduces a sum of several
        self.tp = tp
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:  # an idle rank's empty step
            return x.new_empty(*lead, self.out_features)
        xq, xs = quantize_rows(x2)
        if x2.is_cuda:
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale,
                                 out_dtype=self.out_dtype)  # fmt: skip
        else:
            # CPU: torch 2.11's `_scaled_mm` takes per-tensor scales only. The e4m3 codes as
            # float32 (exact), their products exact (4 + 4 significant bits), summed in float32,
            # then scaled: the same product, the weight widened per call (the CPU serves tests)
            y = (torch.mm(xq.float(), self.weight.float().t()) * xs * self.weight_scale).to(
                self.out_dtype
            )
        rank0 = self.tp is None or self.tp.rank == 0  # a replicated bias is added once
        if self.bias is not None and rank0:
            y = y + self.bias
        if self.tp is not None and self.reduce:
            y = self.tp.all_reduce(y)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3"


def _quantizable(linears: list[nn.Module]) -> bool:
    return all(
        type(m).__name__ in ("Linear", "RowParallelLinear")
        and m.weight.shape[0] % ALIGN == 0 and m.weight.shape[1] % ALIGN == 0
        for m in linears
    )  # fmt: skip


def _fp8_of(linears: list[nn.Module], dtype: torch.dtype) -> Fp8Linear:
    """One Fp8Linear computing `linears`' outputs concatenated (rows in order); linears that
    hold an FP8 checkpoint's codes and row scales (`weight_scale`) keep them."""
    weight = torch.cat([m.weight.detach() for m in linears])
    scale = None
    if weight.dtype == FP8:  # concatenated rows keep their own scales: exact
        scale = torch.cat([m.weight_scale.detach().reshape(-1) for m in linears])
    biases = [m.bias for m in linears]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    first = linears[0]
    tp = getattr(first, "tp", None) if type(first).__name__ == "RowParallelLinear" else None
    return Fp8Linear(weight, bias, dtype, tp=tp, reduce=getattr(first, "reduce", False),
                     weight_scale=scale)  # fmt: skip


def check_supported(device: torch.device, dtype: torch.dtype) -> None:
    """ValueError naming the problem where FP8 GEMMs cannot run: a CUDA device before sm89
    (Ada), or a CUDA model dtype other than bfloat16 (the row-scaled FP8 GEMM writes bf16)."""
    if device.type != "cuda":
        log.warning("--quantization fp8 on %s: the products widen the e4m3 codes to float32 on "
                    "every call (a path for tests), several times slower than the model's "
                    "dtype; FP8 pays on CUDA sm89+", device.type)  # fmt: skip
        return
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise ValueError(
            f"--quantization fp8 needs FP8 tensor cores (sm89+: Ada, Hopper, Blackwell); "
            f"this GPU is sm{cap[0]}{cap[1]}"
        )
    if dtype != torch.bfloat16:
        raise ValueError(f"--quantization fp8 on CUDA runs with --dtype bfloat16, not {dtype}")


def _prequantised(linears: list[nn.Module]) -> bool:
    return all(m.weight.dtype == FP8 for m in linears)


@torch.no_grad()
def quantize_model_fp8(model: nn.Module, dtype: torch.dtype, prequantised_only: bool = False
                       ) -> int:  # fmt: skip
    """Replace the projections of every `Attention` (q|k|v merged into `qkv_proj`, o_proj) and
    every dense `GatedMLP` (gate|up merged into `gate_up_proj`, down_proj) by Fp8Linear;
    returns how many were replaced. Call once, after the weights loaded and before the fused
    ops or CPU packing (which leave quantised modules as they are). Blocks loaded from an FP8
    checkpoint (e4m3 weights and `weight_scale`) keep their codes; `prequantised_only`
    replaces those blocks alone (the loader's call: the others stay in `dtype`)."""
    from swaserve.models.blocks import Attention, GatedMLP

    done = skipped = 0
    for module in list(model.modules()):
        if isinstance(module, Attention) and module.qkv_proj is None:
            qkv = [module.q_proj, module.k_proj, module.v_proj]
            if prequantised_only and not _prequantised([*qkv, module.o_proj]):
                continue
            if _quantizable([*qkv, module.o_proj]):
                module.qkv_proj = _fp8_of(qkv, dtype)
                for name in ("q_proj", "k_proj", "v_proj"):
                    delattr(module, name)
                module.o_proj = _fp8_of([module.o_proj], dtype)
                done += 2
            else:
                skipped += 1
        elif isinstance(module, GatedMLP) and module.gate_up_proj is None:
            gate_up = [module.gate_proj, module.up_proj]
            if prequantised_only and not _prequantised([*gate_up, module.down_proj]):
                continue
            if _quantizable([*gate_up, module.down_proj]):
                module.gate_up_proj = _fp8_of(gate_up, dtype)
                del module.gate_proj, module.up_proj
                module.down_proj = _fp8_of([module.down_proj], dtype)
                done += 2
            else:
                skipped += 1
    if skipped:
        log.warning("fp8: %d attention/MLP blocks kept in %s (a projection's features are not "
                    "multiples of %d)", skipped, dtype, ALIGN)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the bf16 copies' blocks go back before the pool is sized
    return done
