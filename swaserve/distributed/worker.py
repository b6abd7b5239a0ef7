"""A tensor-parallel worker: ranks 1..T-1, each its own process (spawned by launch.py).

Start-up mirrors EngineCore's (engine/core.py) for the parts every rank holds, with the same
collectives in the same order: join the groups, build this rank's shard of the model, profile
memory on CUDA, agree on the page count (the smallest pool), allocate the KV pool of its own
heads, calibrate FP8 scales (the largest over the ranks). Then `serve_steps` mirrors rank 0's
messages (step_wire.py) until STOP or until rank 0 is gone (the next wait fails).
No scheduler, memory manager, prefix cache or sampler here: rank 0 decides, the workers run.
With a DFlash drafter a worker holds its shard too, its layers in the pool after the target's,
and runs every drafter forward and context K/V store rank 0 announces (dflash_tp.py). With
offload tiers a worker holds its own (same slots, its shard of each page) and replays rank
0's page movements on them (`tier_mover`).
Inside a rank of DP attention + expert parallelism the worker also holds experts of its own and
joins its tensor-parallel index's expert-parallel group (ep_tp.py) before building its shard.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path

import torch

from swaserve.config import EngineConfig
from swaserve.distributed.dflash_tp import TPDFlashProposer
from swaserve.distributed.expert_parallel import ExpertParallel
from swaserve.distributed.launch import RankFailure
from swaserve.distributed.parallel_state import TPGroup, open_store
from swaserve.distributed.step_wire import (
    CONTEXT,
    COPY,
    DRAFT,
    FORWARD,
    LANDED,
    LOGITS,
    MOE,
    MOVES,
    STOP,
    StepWire,
)
from swaserve.engine.gc_heap import freeze_startup_heap
from swaserve.engine.model_runner import ModelRunner
from swaserve.memory.host_cache import PageMover, config_tiers

log = logging.getLogger("swaserve.worker")


def worker_main(rank: int, spec_json: str) -> None:
    """Process entry: `spec_json` holds the resolved config, the model folder and the
    rendezvous address (JSON, as every start-up message in swaserve)."""
    from swaserve.distributed.launch import ready_key, worker_device

    spec = json.loads(spec_json)
    logging.basicConfig(
        level=spec.get("log_level", "INFO"),
        format=f"%(asctime)s %(levelname)s [tp{rank}] %(name)s: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the ranks stop
    config = EngineConfig(**spec["config"])
    device = worker_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # rank 0's share of the cores (its replica's, under data parallelism)
        torch.set_num_threads(spec["threads"])
    store = open_store(spec["host"], spec["port"], config.tensor_parallel_size, False)
    store.set(ready_key(rank), "1")
    tp = TPGroup.create(store, rank, config.tensor_parallel_size, spec["host"], device)
    ep = None
    try:
        if spec.get("expert_parallel"):  # this rank's experts, and their group (ep_tp.py)
            from swaserve.distributed.ep_tp import join_as_worker

            ep = join_as_worker(spec["expert_parallel"], tp, device)
        runner, proposer, mover = build_shard(config, Path(spec["folder"]), tp, ep)
        try:
            serve_steps(
                runner,
                StepWire(
                    tp, int(runner.model.config.hidden_size), next(runner.model.parameters()).dtype
                ),
                ep,
                proposer,
                mover,
            )
        finally:
            for tier in mover.tiers if mover is not None else ():
                tier.close()
    except RuntimeError as e:
        # gloo's word for a vanished rank 0 (a dead expert-parallel peer is a RankFailure)
        if "Connection closed by peer" in str(e) and not isinstance(e, RankFailure):
            log.info("rank 0 is gone; tensor-parallel rank %d exits", rank)
            sys.exit(0)
        raise
    finally:
        if ep is not None:
            ep.group.shutdown()
        tp.shutdown()


def build_shard(
    config: EngineConfig, folder: Path, tp: TPGroup, ep: ExpertParallel | None = None
) -> tuple[ModelRunner, TPDFlashProposer | None, PageMover | None]:
    """This rank's model shard and KV pool, built as EngineCore builds rank 0's (`ep`: with
    experts of its own, in its expert-parallel group), its offload tiers if any
    (`tier_mover`), and its DFlash drafter shard if any (its layers in the pool after the
    target's; the runner keeps its target_layer_ids)."""
    from swaserve.attention import backend_class
    from swaserve.engine.core import agree_kv_scales, kv_budget_bytes
    from swaserve.engine.limits import check_model_len
    from swaserve.memory.groups import model_layout
    from swaserve.memory.kv_pool import KVPool
    from swaserve.memory.manager import page_bytes
    from swaserve.models.blocks import drafter_layers, layer_windows, pool_row_shape
    from swaserve.speculative.dflash_setup import build_proposer, dflash_setup
    from swaserve.weights.fp8_checkpoint import resolve_quantization
    from swaserve.weights.loader import build_model, load_hf_config

    device, dtype = tp.device, config.torch_dtype()
    hf = load_hf_config(folder)
    max_model_len = check_model_len(config.max_model_len, int(hf.max_position_embeddings))
    model = build_model(hf, folder, dtype, device, config.load_format == "dummy", config.seed, tp,
                        ep=None if ep is None else ep.experts_place)  # fmt: skip
    dflash = dflash_setup(config, hf)  # its config only (its K sizes the decode workspace)
    if ep is not None:  # before the start-up forwards: their MoE layers join the exchange
        from swaserve.distributed.ep_tp import attach_worker

        attach_worker(ep, model, tp, config, dflash.cfg if dflash is not None else None)
    # As rank 0's EngineCore._start: online quantisation, unless the weights came from an FP8
    # checkpoint (build_model made its projections Fp8Linear from the file's codes already; the
    # blocks the file keeps in bf16 must stay so, as on rank 0). Asked with no flag: rank 0 has
    # resolved `config.quantization` to "fp8" already, which a compressed-tensors checkpoint
    # would call a conflict.
    _, fp8_checkpoint = resolve_quantization(None, folder, config.load_format == "dummy")
    if config.quantization == "fp8" and not fp8_checkpoint:
        from swaserve.ops.fp8_linear import quantize_model_fp8

        quantize_model_fp8(model, dtype)
    if device.type == "cuda" and not config.disable_fused_ops:
        from swaserve.ops import enable_fused_ops

        enable_fused_ops(model)
    layout = model_layout(model, layer_windows(hf), config.disable_hybrid_kv_cache,
                          *drafter_layers(dflash.cfg if dflash else None, hf, tp))
    kv_heads, head_dim = pool_row_shape(hf, layout, tp.size)
    kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8_e4m3" else dtype
    per_page = page_bytes(layout, config.page_size, kv_heads, head_dim, kv_dtype.itemsize)
    backend = backend_class(config.backend_name())(layout, config.page_size, device)
    budget = kv_budget_bytes(
        config,
        model,
        backend,
        layout,
        (kv_heads, head_dim),
        kv_dtype,
        max_model_len,
        int(hf.vocab_size),
        device,
        piecewise=False,
    )
    num_pages = int(tp.agree([max(2, int(budget // per_page))], "min")[0])
    kv = KVPool(layout, num_pages, config.page_size, kv_heads, head_dim, kv_dtype, device)
    if kv.is_fp8:
        n = len(layout.layer_to_slot)  # the target's layers, then a drafter's
        if config.kv_cache_scale is not None:
            kv.set_scales([config.kv_cache_scale] * n, [config.kv_cache_scale] * n)
        else:
            from swaserve.engine.kv_calibration import calibrate_kv_scales

            ks, vs = calibrate_kv_scales(
                model,
                layout,
                config.page_size,
                kv_heads,
                head_dim,
                dtype,
                device,
                hf.vocab_size,
                config.seed,
            )
            kv.set_scales(*agree_kv_scales(tp, ks, vs))
    log.info(
        "tensor-parallel rank %d of %d: %d KV pages, %d KV heads",
        tp.rank,
        tp.size,
        num_pages,
        kv_heads,
    )
    runner = ModelRunner(model, kv, backend, device)
    # In rank 0's order (EngineCore): the prefix cache's tiers, whose page counts agree, then
    # the drafter, whose FP8 scales agree; two collectives of one kind, so the order matters.
    mover = tier_mover(config, runner, tp)
    if dflash is None:
        return runner, None, mover
    proposer = build_proposer(dflash, model, layout, kv, config, tp)
    runner.keep = dflash.cfg.target_layer_ids
    return runner, proposer, mover


def tier_mover(config: EngineConfig, runner: ModelRunner, tp: TPGroup) -> PageMover | None:
    """This rank's offload tiers and the mover that replays rank 0's flushes on them; None
    without tiers. Built where rank 0 builds its tiers in its start-up (build_prefix_cache,
    after the KV pool, before the drafter), as their page counts agree (a collective)."""
    if config.disable_prefix_cache:
        return None
    tiers = config_tiers(config, runner.kv, tp)
    return PageMover(runner.kv, tiers) if tiers else None


def serve_steps(
    runner: ModelRunner,
    wire: StepWire,
    ep: ExpertParallel | None = None,
    proposer: TPDFlashProposer | None = None,
    mover: PageMover | None = None,
) -> None:
    """Mirror rank 0's messages (step_wire.py) until STOP."""
    freeze_startup_heap("tensor-parallel worker")
    fb = None  # the last FORWARD's batch: a CONTEXT stores the drafter's K/V of its tokens
    with torch.inference_mode():
        while True:
            msg = wire.recv()
            if msg.op == FORWARD:
                fb = runner.build(msg.input_ids, msg.inputs)
                runner.forward(fb)
                if ep is not None:
                    ep.end_step()
            elif msg.op == DRAFT:
                proposer.serve_draft(msg.head, msg.tables, msg.width, runner.kv)
            elif msg.op == CONTEXT:
                proposer.store_context_of_batch(fb, runner.kept, runner.kv)
            elif msg.op == MOE:  # an expert-parallel step: its sizes, then this rank's forward
                ep.begin_step(msg.sizes, msg.fixed)
                if not msg.sizes[ep.rank]:  # or, without tokens here, the idle forward now
                    ep.idle_forward()
                    ep.end_step()
            elif msg.op == LOGITS:
                wire.tp.gather(runner.model.compute_logits(msg.hidden).float().contiguous())
            elif msg.op == COPY:
                runner.kv.copy_pages(msg.src, msg.dst)
            elif msg.op == MOVES:
                mover.replay(msg.flush, msg.moves)
            elif msg.op == LANDED:
                mover.follow(msg.flush)
            elif msg.op == STOP:
                return
