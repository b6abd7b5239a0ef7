"""Starting a DFlash drafter beside its target, the same on every tensor-parallel rank: which
checkpoint (`dflash_setup`, before the pool's layout exists: the drafter's layers join it), and
the proposer over the built pool (`build_proposer`: the drafter, or this rank's shard of it, and
FP8 scales for its pool layers).

With tensor parallelism rank 0 (engine/core.py) and every worker (distributed/worker.py) call
both in the same order, so the collectives inside (the FP8 calibration's target forward and
the agreement on its scales) pair up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from swaserve.memory.groups import GroupLayout
from swaserve.memory.kv_pool import KVPool
from swaserve.speculative.dflash_config import DFlashConfig, load_dflash_config
from swaserve.speculative.dflash_model import load_dflash_drafter
from swaserve.speculative.dflash_proposer import DFlashProposer
from swaserve.weights.builtin import ALIASES, builtin_drafter

if TYPE_CHECKING:
    from swaserve.config import EngineConfig
    from swaserve.distributed.launch import TensorParallel
    from swaserve.distributed.parallel_state import TPGroup
    from swaserve.distributed.step_wire import StepWire


@dataclass(frozen=True)
class DFlashSetup:
    path: str  # the drafter's checkpoint folder
    cfg: DFlashConfig


def dflash_setup(config: EngineConfig, hf_config: Any) -> DFlashSetup | None:
    """The drafter of --speculative-algorithm dflash (None for any other algorithm): the
    --speculative-draft-model folder, or the one shipped for a built-in alias. ValueError when
    there is none, or when its K/V shape differs from the target's (its layers share the
    target's pool; under tensor parallelism both split their KV heads the same way)."""
    if config.speculative_algorithm != "dflash":
        return None
    shipped = builtin_drafter(config.model)
    path = config.speculative_draft_model or (str(shipped) if shipped else None)
    if path is None:
        have = ", ".join(a for a in ALIASES if builtin_drafter(a)) or "none"
        raise ValueError(
            "--speculative-algorithm dflash needs --speculative-draft-model PATH (a DFlash "
            f"checkpoint folder) for {config.model}; a drafter ships for the built-in {have}"
        )
    # the drafter's layers take their own K/V shape in the target's pool (GroupLayout.kv_shapes)
    return DFlashSetup(path, load_dflash_config(path, hf_config))


def build_proposer(
    setup: DFlashSetup,
    target: nn.Module,
    layout: GroupLayout,
    kv: KVPool,
    config: EngineConfig,
    tp: TPGroup | None = None,
    parallel: TensorParallel | None = None,
    wire: StepWire | None = None,
) -> DFlashProposer:
    """The proposer over the target and its pool `kv`, with its pool layers' FP8 scales set
    (calibrated like the target's when no --kv-cache-scale is given). `tp` (size > 1): this
    rank's shard (distributed/dflash_tp.py); `parallel` and `wire`: rank 0's, which announces
    every drafter forward to the workers."""
    hf = target.config
    device, dtype = kv.pages.device, config.torch_dtype()
    drafter = load_dflash_drafter(setup.path, hf, device, dtype, tp)
    if device.type == "cuda" and not config.disable_fused_ops and (tp is None or tp.size == 1):
        from swaserve.ops import enable_fused_ops

        # The target's kernels for the drafter's norms, rotary and gate/up + activation: as
        # eager torch code each RMSNorm is ~7 kernels and each rotary ~10, and the context
        # store runs them on every target forward, drafting or not (benchmarks/RESULTS.md
        # stop 31). Tensor-parallel shards keep the eager code.
        enable_fused_ops(drafter)
    args = (drafter, target, layout, int(hf.num_hidden_layers), config.page_size)
    if tp is None or tp.size == 1:
        proposer = DFlashProposer(*args)
    else:
        from swaserve.distributed.dflash_tp import TPDFlashProposer

        proposer = TPDFlashProposer(*args, tp, parallel, wire)
    if kv.is_fp8 and config.kv_cache_scale is None:
        _calibrate(proposer, target, kv, config, tp)
    return proposer


def _calibrate(
    proposer: DFlashProposer, target: nn.Module, kv: KVPool, config: EngineConfig,
    tp: TPGroup | None,
) -> None:
    """The drafter's pool layers' FP8 scales, calibrated on its context K/V of the target
    calibration pass's tokens (engine/kv_calibration.py); with tensor parallelism each rank
    saw its heads: the largest over the ranks."""
    from swaserve.engine.kv_calibration import calibrate_drafter_kv_scales

    hf = target.config
    kv_heads, head_dim = kv.pages.shape[-2:]
    found = calibrate_drafter_kv_scales(
        target, proposer, config.page_size, kv_heads, head_dim, config.torch_dtype(),
        kv.pages.device, int(hf.vocab_size), config.seed,
    )
    layers = proposer.pool_layer_ids
    scales = [found[i][0] for i in layers] + [found[i][1] for i in layers]
    if tp is not None and tp.size > 1:
        scales = tp.agree(scales, "max")
    ks, vs = list(kv.k_scales), list(kv.v_scales)
    for j, layer_id in enumerate(layers):
        ks[layer_id], vs[layer_id] = scales[j], scales[len(layers) + j]
    kv.set_scales(ks, vs)

