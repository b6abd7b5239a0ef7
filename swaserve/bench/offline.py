"""`swaserve bench offline`: batch-1 decode time per token and throughput on random prompts
with input and output lengths uniform in given ranges (greedy, ignore_eos), plus the
bandwidth roofline of batch-1 decode when on CUDA (weight bytes over measured copy bandwidth).
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from swaserve.sampling.params import SamplingParams


def random_workload(
    vocab: int, num_prompts: int, input_range: tuple[int, int], output_range: tuple[int, int],
    seed: int = 0,
) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_prompts):
        n = rng.randint(*input_range)
        prompts.append([rng.randrange(100, vocab - 100) for _ in range(n)])
        outs.append(rng.randint(*output_range))
    return prompts, outs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 2 * 1024**3) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    _sync(device)
    t = time.perf_counter()
    reps = 20
    for _ in range(reps):
        y.copy_(x)
    _sync(device)
    return reps * 2 * nbytes / (time.perf_counter() - t)


def generate_timed(
    engine: Any, prompts: list[list[int]], max_tokens: list[int], progress: bool = False
) -> float:
    """Seconds to generate (greedy, ignore_eos); `progress` shows a bar on stderr."""
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    _sync(engine.core.device)
    t = time.perf_counter()
    engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=progress)
    _sync(engine.core.device)
    return time.perf_counter() - t


def local_cores(core: Any) -> list[Any]:
    """The EngineCores in this process behind an Engine's core: itself, a data-parallel
    core's replicas (`-dp D` without expert parallelism), or an expert-parallel core's rank 0
    (its other ranks are processes of their own)."""
    if hasattr(core, "replicas"):
        return list(core.replicas)
    if hasattr(core, "local"):
        return [core.local]
    return [core]


def run_tracked(engine: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """All prompts at once, greedy, ignore_eos: wall time, throughput and the schedulers' peaks
    (requests running, requests past their prompt) and preemptions during the run, summed over
    the cores in this process (`local_cores`: under expert parallelism, rank 0's only)."""
    core = engine.core
    scheds = [c.scheduler for c in local_cores(core)]
    peak = {"running": 0, "decoding": 0}
    step = core.step

    def tracked() -> Any:
        out = step()
        running = [r for s in scheds for r in s.running]
        peak["running"] = max(peak["running"], len(running))
        peak["decoding"] = max(
            peak["decoding"], sum(r.num_computed_tokens >= r.num_prompt_tokens for r in running)
        )
        return out

    pre0 = sum(s.num_preemptions for s in scheds)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    core.step = tracked
    try:
        _sync(core.device)
        t = time.perf_counter()
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        _sync(core.device)
        wall = time.perf_counter() - t
    finally:
        core.step = step
    n_out = sum(len(o.token_ids) for o in outs)
    n_in = sum(map(len, prompts))
    return {
        "wall_s": wall,
        "output_tokens": n_out,
        "output_tok_s": n_out / wall,
        "total_tok_s": (n_out + n_in) / wall,
        "peak_running": peak["running"],
        "peak_decoding": peak["decoding"],
        "preemptions": sum(s.num_preemptions for s in scheds) - pre0,
        "tracked_cores": len(scheds),
    }


def run_offline_bench(
    engine: Any,
    num_prompts: int,
    input_range: tuple[int, int] = (100, 1024),
    output_range: tuple[int, int] = (100, 1024),
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """The benchmark; `progress` shows a bar on stderr over the workload's requests."""
    vocab = engine.core.hf_config.vocab_size
    dev = engine.core.device
    prompt = [[(1000 + i) % vocab for i in range(128)]]
    generate_timed(engine, prompt, [8])  # warm-up: kernels compile, graphs exist
    t1 = generate_timed(engine, prompt, [1])
    t65 = generate_timed(engine, prompt, [65])
    per_token = (t65 - t1) / 64
    prompts, outs = random_workload(vocab, num_prompts, input_range, output_range, seed)
    elapsed = generate_timed(engine, prompts, outs, progress)
    result = {
        "num_prompts": num_prompts,
        "batch1_decode_ms_per_token": per_token * 1e3,
        "elapsed_s": elapsed,
        "output_tokens_per_s": sum(outs) / elapsed,
        "total_tokens_per_s": (sum(outs) + sum(map(len, prompts))) / elapsed,
        "requests_per_s": num_prompts / elapsed,
    }
    if dev.type == "cuda":
        # one GPU's weights (rank 0's shard under -tp or expert parallelism): its roofline
        model = local_cores(engine.core)[0].model
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        bw = copy_bandwidth(dev)
        roof = weight_bytes / bw
        result.update(
            copy_bandwidth_gbs=bw / 1e9,
            weight_bytes=weight_bytes,
            batch1_roofline_ms=roof * 1e3,
            batch1_efficiency=roof / per_token,
        )
    return result
