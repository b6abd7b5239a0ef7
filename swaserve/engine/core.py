"""EngineCore: scheduler + model, one `step()` at a time. It knows token ids, never text
(tokenizing and stop strings live with the output processor, in the caller's process)."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from swaserve.attention import backend_class
from swaserve.config import GRAPH_MAX_BS, EngineConfig
from swaserve.engine.forward_batch import DeviceTokens
from swaserve.engine.gc_heap import freeze_startup_heap
from swaserve.engine.limits import (
    ContextLimit,
    check_model_len,
    check_priority,
    check_prompt,
    check_satisfiable,
    check_token_ids,
    check_vocab_ids,
    fit_context,
    truncate_prompt,
)
from swaserve.engine.model_runner import ModelRunner
from swaserve.engine.request import PLACEHOLDER, Request, RequestStatus
from swaserve.engine.scheduler import ScheduledBatch, Scheduler
from swaserve.engine.speculation import Speculation, Verified, record
from swaserve.memory.groups import model_layout
from swaserve.memory.kv_pool import KVPool
from swaserve.memory.manager import MemoryManager, page_bytes
from swaserve.memory.radix_cache import build_prefix_cache
from swaserve.models.blocks import drafter_layers, layer_windows, pool_row_shape
from swaserve.outputs import EngineCoreOutput, Logprob
from swaserve.sampling.generation_defaults import generation_defaults
from swaserve.sampling.logprobs import compute_logprobs
from swaserve.sampling.params import SamplingParams
from swaserve.sampling.reasoning_gate import ReasoningGate
from swaserve.sampling.sampler import Sampler, SamplerOutput, SamplingRow, row_argmax
from swaserve.sampling.structured import Grammars
from swaserve.speculative.dflash_proposer import DFlashProposer
from swaserve.speculative.dflash_setup import build_proposer, dflash_setup
from swaserve.speculative.metrics import SpecStats
from swaserve.weights.loader import build_model, load_hf_config

if TYPE_CHECKING:
    from swaserve.distributed.expert_parallel import ExpertParallel
    from swaserve.distributed.parallel_state import TPGroup

log = logging.getLogger(__name__)

# DFlash drafter graphs up to this many requests: larger batches rarely draft (the gate turns
# drafting off where it does not pay) and draft eagerly when they do.
DRAFT_GRAPH_MAX_BS = 64
_PROMPT_LOGPROB_ROWS = 256  # rows of [rows, vocab] logits computed at a time
PIECEWISE_DEFAULT_MAX_TOKENS = 2048  # see EngineCore._piecewise_max_tokens
MIXED_DEFAULT_MAX_TOKENS = 256  # see engine/mixed_graph.py
# Mixed graphs up to this many requests: a step of more runs piecewise (each of its requests
# adds attention programs to every launch of the graph, padding ones included)
MIXED_GRAPH_MAX_SEQS = 64


@dataclass
class _Launched:
    """A step whose forward and sampling are enqueued; its tokens are not read back yet."""

    samplers: list[Request]  # requests that sample in this step, row i -> samplers[i]
    slots: list[int]  # output index of each sampler's placeholder
    sampled: SamplerOutput | None
    host: torch.Tensor | None  # token ids, filled by a non-blocking copy
    # (logprobs, ranks, topk_ids, topk_logprobs) on the host, copied with the ids; None when no
    # row asked for logprobs (topk_* None when no row asked for alternatives)
    host_lps: tuple[torch.Tensor | None, ...] | None
    event: Any  # torch.cuda.Event recorded after those copies; None on CPU
    verified: Verified | None = None  # speculation: what to commit, already on the host


def _needs_history(p: SamplingParams) -> bool:
    """Penalties, grammars and bad words of several tokens read the values of earlier output
    tokens (placeholders have none)."""
    return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0 or p.structured_outputs is not None
            or any(len(w) > 1 for w in p.bad_words_token_ids or ()))


def _plain_greedy(p: SamplingParams) -> bool:
    """The request's token is always the raw logits' argmax, with no logprobs: what the
    sampler would do for its row (no row need be built)."""
    return (p.greedy and p.logprobs is None and p.min_tokens == 0 and not p.edits_logits
            and not _needs_history(p))


def _tokenizer(folder: Path, name: str | None) -> Any:
    """The model's tokenizer, loaded where a core first needs it (structured outputs)."""
    from swaserve.engine.engine import load_tokenizer  # engine.py imports this module

    return load_tokenizer(folder, name)


def _seeded_sampling(p: SamplingParams) -> bool:
    """A seeded random request: it drafts at every step (engine/speculation.py)."""
    return p.seed is not None and not p.greedy


def eos_token_ids(folder: Path, hf_config: Any) -> frozenset[int]:
    ids: set[int] = set()
    for src in (folder / "generation_config.json", folder / "config.json"):
        if src.exists():
            e = json.loads(src.read_text()).get("eos_token_id")
            ids.update(e if isinstance(e, list) else [e] if e is not None else [])
    e = getattr(hf_config, "eos_token_id", None)
    ids.update(e if isinstance(e, list) else [e] if e is not None else [])
    return frozenset(ids)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        folder: Path,
        server: bool = False,
        ep: ExpertParallel | None = None,
    ) -> None:
        """`server`: the OpenAI server's core (its device defaults favour latency). `ep`: this
        core is one data-parallel rank of an expert-parallel group (already joined; `config`
        is the rank's own, data_parallel_size 1): it holds its share of the experts and steps
        in lockstep with the other ranks (swaserve/distributed/expert_parallel.py)."""
        self.parallel = None  # TensorParallel (swaserve/distributed/launch.py) when T > 1
        self.ep = ep
        # A PD prefill instance's side (swaserve/disaggregation/prefill_side.py): `_finish`
        # lets it hold a computed sample's pages until they are sent.
        self.disagg: Any = None
        if config.disaggregation_mode and not server:
            raise ValueError("--disaggregation-mode is for `swaserve serve` only")
        if config.data_parallel_size > 1:  # one replica: the server or the Engine holds D
            raise ValueError(
                f"--data-parallel-size {config.data_parallel_size}: an EngineCore is one "
                "replica (the Engine and `swaserve serve` run D of them)"
            )
        try:
            self._start(config, folder, server)
        except BaseException as e:
            if self.parallel is None:
                raise
            # The workers are somewhere in their start-up: stop them; a start-up collective
            # that failed because a worker died is that worker's failure.
            failure = self.parallel.explain() if isinstance(e, RuntimeError) else None
            self.parallel.shutdown(graceful=False)
            if failure is None:
                raise
            raise failure from e

    def _start(self, config: EngineConfig, folder: Path, server: bool) -> None:
        self.device = config.torch_device()
        self.config = config = config.with_device_defaults(self.device, server)
        self.dtype = config.torch_dtype()
        # An FP8 checkpoint sets --quantization fp8 itself (swaserve/weights/fp8_checkpoint.py);
        # an unread quant_method or a conflicting flag fails here, before anything loads.
        from swaserve.weights.fp8_checkpoint import resolve_quantization

        quantization, self.fp8_checkpoint = resolve_quantization(
            config.quantization, folder, config.load_format == "dummy"
        )
        if quantization != config.quantization:
            self.config = config = dataclasses.replace(config, quantization=quantization)
        self.hf_config = load_hf_config(folder)
        hf = self.hf_config
        # Before the weights load: a bad --max-model-len fails in a second, not after minutes.
        self.max_model_len = check_model_len(
            config.max_model_len, int(hf.max_position_embeddings)
        )
        if config.quantization == "fp8":  # before minutes of loading: the GPU and dtype fit
            from swaserve.ops.fp8_linear import check_supported

            check_supported(self.device, self.dtype)
        # DFlash: its checkpoint now (its layers join the pool's layout after the target's)
        self.dflash = dflash_setup(config, hf)
        self.dflash_config = self.dflash.cfg if self.dflash is not None else None
        self.draft_model_path = self.dflash.path if self.dflash is not None else None
        # Tensor parallelism: the other ranks start now and build their shards beside this one;
        # swaserve/distributed/worker.py mirrors every collective of the start-up below (memory
        # profile, page count, FP8 calibration, the drafter's), in this order.
        tp = self._start_parallel(folder)
        ep = self.ep
        self.model = build_model(
            hf, folder, self.dtype, self.device, config.load_format == "dummy", config.seed, tp,
            ep=None if ep is None else ep.experts_place,
        )
        if ep is not None:
            ep.attach(self.model, tp)
        # the projections as FP8 (TP shards cut already); an FP8 checkpoint's are already
        if config.quantization == "fp8" and not self.fp8_checkpoint:
            from swaserve.ops.fp8_linear import quantize_model_fp8

            quantize_model_fp8(self.model, self.dtype)
        greedy_head = None
        if self.device.type == "cuda" and not config.disable_fused_ops:
            from swaserve.ops import enable_fused_ops

            enable_fused_ops(self.model)  # before profiling, calibration and graph capture
        elif (self.device.type == "cpu" and not config.disable_fused_ops and tp is None
              and ep is None):
            from swaserve.ops.cpu_pack import pack_cpu_weights

            # float32 GEMMs through oneDNN on weights packed in place of the dense ones; before
            # the KV pool, so the one moment two copies of the vocabulary table exist stays
            # below the engine's steady resident memory
            pack_cpu_weights(self.model)
            from swaserve.ops.greedy_head import greedy_head_for

            # plain greedy steps: the head's argmax through a bfloat16 screen, exactly
            greedy_head = greedy_head_for(self.model)
        self.eos_token_ids = eos_token_ids(folder, hf)
        # the model's generation_config: its max_new_tokens caps a request without max_tokens
        self.default_max_tokens = generation_defaults(
            folder, config.generation_config, config.override_generation_config
        ).get("max_tokens")
        self.grammars = Grammars(functools.partial(_tokenizer, folder, config.tokenizer),
                                 int(hf.vocab_size), sorted(self.eos_token_ids))
        self.layout = model_layout(self.model, layer_windows(hf), config.disable_hybrid_kv_cache,
                                   *drafter_layers(self.dflash_config, hf, tp))  # fmt: skip
        # this rank's KV heads under TP: its pool is sized for them
        kv_heads, head_dim = pool_row_shape(hf, self.layout, 1 if tp is None else tp.size)
        kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8_e4m3" else self.dtype
        bytes_per_page = page_bytes(
            self.layout, config.page_size, kv_heads, head_dim, kv_dtype.itemsize
        )
        backend = backend_class(config.backend_name())(self.layout, config.page_size, self.device)
        num_pages = max(2, int(self._kv_bytes(backend, (kv_heads, head_dim), kv_dtype)
                               // bytes_per_page))
        if tp is not None:  # page ids mean the same on every rank: the smallest pool
            num_pages = int(tp.agree([num_pages], "min")[0])
        self.memory = MemoryManager(
            self.layout, config.page_size, num_pages, watermark_pages=len(self.layout.groups)
        )
        # Before the KV tensors, calibration and graph capture (its tables are sized by
        # max_model_len): the context is at most what the pool holds for one request.
        self._fit_context_to_pool(num_pages)
        self.kv = KVPool(
            self.layout, num_pages, config.page_size, kv_heads, head_dim, kv_dtype, self.device
        )
        if self.kv.is_fp8:
            self._set_fp8_scales(kv_heads, head_dim)
        # With T > 1 each worker builds its tiers here too (worker.py): their page counts agree.
        self.cache = build_prefix_cache(config, self.memory, self.kv, tp)
        self.scheduler = Scheduler(
            self.memory, config.max_num_seqs, config.max_num_batched_tokens, self.cache,
            config.schedule_conservativeness, config.scheduling_policy,
            config.kv_bound_step_tokens, config.prefill_ahead_tokens,
        )
        if self.parallel is None:
            self.runner = ModelRunner(self.model, self.kv, backend, self.device)
            self.runner.greedy_head = greedy_head
        else:
            from swaserve.distributed.tp_runner import TPModelRunner

            self.runner = TPModelRunner(self.model, self.kv, backend, self.device, self.parallel)
            if self.cache is not None:  # copy-on-write copies and tier moves: on every rank
                mover = self.cache.mover
                mover.mirror = self.runner.mirror_copies
                mover.mirror_moves = self.runner.mirror_moves
                mover.mirror_landed = self.runner.mirror_landed
            if self.ep is not None:  # each agreed step's sizes: to the workers (ep_tp.py)
                self.ep.announce = self.runner.announce_moe_step
        # --seed makes unseeded sampling reproducible run to run (seeded requests use their own)
        self.sampler = Sampler(eos_token_ids=sorted(self.eos_token_ids), seed=config.seed)
        # Speculative decoding (off by default); steps that draft run without overlap (see
        # engine/speculation.py).
        self.spec = None
        if config.speculative_algorithm:
            self.spec = Speculation(config, self.sampler, self.max_model_len, self.memory,
                                    self.kv, self._dflash_proposer())
            self.scheduler.speculative = True
            # DFlash drafts stay on the device in one process (tensor-parallel workers and
            # expert-parallel ranks take a step's token ids from the host)
            self.spec.on_device = self.parallel is None and self.ep is None
        if self.ep is not None:
            self._start_decode_workspace()
        # A PD prefill instance reads a sample's generator right after its one draw: no overlap.
        self.overlap = (not config.disable_overlap_schedule
                        and config.disaggregation_mode != "prefill")
        if self.dflash_config is not None:  # every path hands the drafter these outputs
            self.runner.keep = self.dflash_config.target_layer_ids
        if config.cuda_graph_max_bs > 0 and self.device.type == "cuda":
            if self.parallel is not None:
                log.warning("no CUDA graphs with --tensor-parallel-size > 1 yet (the workers do "
                            "not replay graphs in step with rank 0): running eager")
            elif self.ep is not None:
                log.warning("no CUDA graphs with --enable-expert-parallel yet (decode-only "
                            "steps exchange fixed-shape buffers, but the experts' kernel and "
                            "idle ranks' MoE-only forwards are not captured): running eager")
            else:
                try:
                    self._capture_graphs(backend)
                except torch.OutOfMemoryError as e:
                    from swaserve.engine.memory_profile import graph_memory_error

                    weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
                    total = torch.cuda.get_device_properties(self.device).total_memory
                    raise graph_memory_error(
                        weights, num_pages * bytes_per_page, total, config,
                        self._mixed_max_tokens(), self._piecewise_max_tokens(),
                    ) from e  # fmt: skip
        self._warm_up_kernels(backend)
        self.requests: dict[str, Request] = {}
        self._inflight: _Launched | None = None
        self._num_history_requests = 0  # live requests whose sampling reads token values
        self._num_seeded_sampling = 0  # live seeded sampling requests: they always draft
        self._num_not_plain = 0  # live requests whose token is not plainly the argmax
        self._pinned: list[torch.Tensor | None] = [None, None]  # alternating host buffers
        self._pinned_turn = 0
        log.info(  # pages_total as memory_stats() counts it: without the NULL page
            "KV pool: %d pages of %d tokens (%.2f GB), groups %s",
            self.memory.pool.capacity,
            config.page_size,
            num_pages * bytes_per_page / 1e9,
            [(g.kind, g.window, len(g.layers)) for g in self.layout.groups],
        )
        freeze_startup_heap("engine core")  # last: full collections then skip all of it

    def _start_decode_workspace(self) -> None:
        """Expert parallelism: the fixed-shape MoE workspace of decode-only steps and the
        scheduler's cap that keeps every such step within it (distributed/decode_workspace.py).
        Every rank runs this with the same config: the same N everywhere (and with -tp its
        workers, from the same config and drafter: ep_tp.attach_worker)."""
        from swaserve.distributed.decode_workspace import decode_cap
        from swaserve.engine.speculation import num_draft_tokens

        drafts = num_draft_tokens(self.config, self.dflash_config)  # the K of self.spec
        cap = decode_cap(self.config, drafts)
        if cap == 0:
            log.info("MoE decode workspace: off (every step exchanges variable-size buffers)")
            return
        if cap < drafts + 1:
            raise ValueError(
                f"--moe-decode-max-tokens-per-rank {cap} is below one verify step's {drafts + 1} "
                f"tokens (--speculative-num-draft-tokens {drafts} + 1): give at least "
                f"{drafts + 1}, or 0 for no decode workspace"
            )
        self.scheduler.decode_cap = cap
        nbytes = self.ep.enable_decode_workspace(cap)
        log.info("MoE decode workspace: %d tokens per rank x %d ranks, %.2f MB",
                 cap, self.ep.size, nbytes / 1e6)

    def _start_parallel(self, folder: Path) -> TPGroup | None:
        """Tensor parallelism (T > 1): check that the model splits, then start the other ranks
        and join their group (this process is rank 0). None with one process."""
        size = self.config.tensor_parallel_size
        if size == 1:
            return None
        from swaserve.distributed.launch import start_tensor_parallel
        from swaserve.distributed.layers import check_shardable

        if self.config.node_rank > 0:
            raise ValueError(
                f"--node-rank {self.config.node_rank} runs only tensor-parallel workers: start "
                "that node with `swaserve serve --node-rank ...`; node 0 runs the engine"
            )
        ep = self.ep
        check_shardable(self.hf_config, size, experts=ep is None)  # EP: experts stay whole
        if self.dflash_config is not None:
            from swaserve.distributed.layers import check_drafter_shardable

            check_drafter_shardable(self.dflash_config, size)
        if self.device.type == "cuda":  # rank r on cuda:K+r (K: 0, or a replica's first GPU)
            first, count = self.device.index or 0, torch.cuda.device_count()
            if first + size // self.config.nnodes > count:
                raise ValueError(
                    f"--device {self.config.device} with --tensor-parallel-size {size}: rank r "
                    f"uses cuda:{first}+r, beyond this machine's {count} GPUs"
                )
        self.parallel = start_tensor_parallel(
            self.config, folder, expert_parallel=None if ep is None else ep.place
        )
        if ep is not None:
            # a failed collective, of the expert-parallel world or of this rank's group, is
            # named by one watch: the other ranks' processes first, then this rank's workers
            self.parallel.peer_watches = ep.watches
            ep.explain = self.parallel.explain
        return self.parallel.tp

    def check_ranks(self) -> None:
        """RankFailure (swaserve/distributed/launch.py) when a tensor-parallel rank died;
        nothing to check with one process."""
        if self.parallel is not None:
            self.parallel.check()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (also done when the core is collected or the
        process exits); the core cannot step afterwards. Nothing to do with one process."""
        if self.parallel is not None:
            self.parallel.shutdown()

    def _dflash_proposer(self) -> DFlashProposer | None:
        """The drafter over the built pool; with tensor parallelism rank 0's shard, which
        announces each drafter forward to the workers (distributed/dflash_tp.py)."""
        if self.dflash is None:
            return None
        if self.parallel is None:
            return build_proposer(self.dflash, self.model, self.layout, self.kv, self.config)
        return build_proposer(self.dflash, self.model, self.layout, self.kv, self.config,
                              self.parallel.tp, self.parallel, self.runner.wire)

    def _fit_context_to_pool(self, num_pages: int) -> None:
        """Cap max_model_len to the most tokens one request can hold in the pool (vLLM does
        the same), with a warning; an explicit --max-model-len that does not fit, or a pool
        that holds fewer than 2 tokens, is a ValueError naming the flags."""
        c = self.config
        on_gpu = self.device.type == "cuda" and c.kv_cache_gb is None
        flags = "--gpu-memory-utilization or --kv-cache-gb" if on_gpu else "--kv-cache-gb"
        n = num_pages - 1
        pool = f"{n} page{'s' if n != 1 else ''} of {c.page_size} tokens"
        from swaserve.engine.speculation import num_draft_tokens

        # with speculation, room for a whole verify chunk too (a seeded request's: scheduler)
        drafts = num_draft_tokens(c, self.dflash_config)
        limit = fit_context(self.max_model_len, c.max_model_len is not None,
                            self.memory.max_request_tokens(drafts), pool, flags)
        if limit.by_kv_pool:
            log.warning(
                "max_model_len capped from %d to %d tokens: that is all the KV pool (%s) "
                "holds for one request; raise %s for the model's full context",
                self.max_model_len, limit.tokens, pool, flags,
            )
        self.max_model_len = limit.tokens
        self.context_by_kv_pool = limit.by_kv_pool

    def _set_fp8_scales(self, kv_heads: int, head_dim: int) -> None:
        """Every pool layer's scales; a DFlash drafter's layers are calibrated once the
        drafter is loaded (_dflash_proposer)."""
        n = len(self.layout.layer_to_slot)  # the target's layers, then a drafter's
        if self.config.kv_cache_scale is not None:
            self.kv.set_scales([self.config.kv_cache_scale] * n, [self.config.kv_cache_scale] * n)
            return
        from swaserve.engine.kv_calibration import calibrate_kv_scales

        ks, vs = calibrate_kv_scales(
            self.model, self.layout, self.config.page_size, kv_heads, head_dim, self.dtype,
            self.device, self.hf_config.vocab_size, self.config.seed,
        )
        if self.parallel is not None:  # each rank saw its heads: the largest over all of them
            ks, vs = agree_kv_scales(self.parallel.tp, ks, vs)
        self.kv.set_scales(ks, vs)
        t = self.hf_config.num_hidden_layers  # the target's (a drafter's come later)
        log.info("fp8 KV scales calibrated: k %.3g..%.3g, v %.3g..%.3g",
                 min(ks[:t]), max(ks[:t]), min(vs[:t]), max(vs[:t]))

    def _capture_graphs(self, backend: Any) -> None:
        from swaserve.attention.triton_backend import TritonBackend
        from swaserve.engine.cuda_graph import DecodeGraphs

        if not isinstance(backend, TritonBackend):
            log.warning("CUDA graphs need the triton attention backend; running eager")
            return
        hf = self.hf_config
        # the largest layer's (static buffers); each group's own K/V shape is read from the
        # pool where it matters (cuda_graph.SplitRule)
        shape = (hf.num_attention_heads, *self.kv.max_layer_shape())
        keep = self.runner.keep
        after = self.spec.dflash.store_context_in_graph if self.dflash_config else None
        graphs = DecodeGraphs(
            self.model, backend, self.kv, self.config.cuda_graph_max_bs, self.max_model_len, shape,
            keep_layers=keep, after=after,
        )
        graphs.capture()
        self.runner.graphs = graphs
        mixed_tokens = self._mixed_max_tokens()
        if mixed_tokens:
            from swaserve.engine.mixed_graph import MixedGraphs

            mixed = MixedGraphs(
                self.model, backend, self.kv, mixed_tokens,
                min(self.config.max_num_seqs, MIXED_GRAPH_MAX_SEQS), self.max_model_len,
                shape,
            )  # fmt: skip
            mixed.capture()
            self.runner.mixed = mixed
        max_tokens = self._piecewise_max_tokens()
        if max_tokens:
            from swaserve.engine.piecewise_graph import PiecewiseGraphs

            pieces = PiecewiseGraphs(self.model, backend, self.kv, max_tokens, shape, keep)
            pieces.capture()
            self.runner.piecewise = pieces
        if self.spec is not None and self.spec.k > 0:
            # at most GRAPH_MAX_BS requests: each graph holds [bs * (K + 1), vocab] logits
            verify = DecodeGraphs(
                self.model, backend, self.kv, min(self.config.cuda_graph_max_bs, GRAPH_MAX_BS),
                self.max_model_len,
                shape, tokens_per_request=self.spec.k + 1, keep_layers=keep, after=after,
            )
            verify.capture()
            self.runner.verify_graphs = verify
        if self.dflash_config is not None:
            self.spec.dflash.capture_graphs(min(self.config.cuda_graph_max_bs, DRAFT_GRAPH_MAX_BS),
                                            self.max_model_len, self.kv)

    def _warm_up_kernels(self, backend: Any) -> None:
        """Compile the attention variants of prefill, mixed and eager decode steps now
        (swaserve/attention/warmup.py), after the graphs compiled theirs. Single-process GPU
        engines only: TP and EP ranks run their steps in lock step with workers that would
        need the same warm-up (they compile on first use, as before)."""
        from swaserve.attention.triton_backend import TritonBackend

        if (self.device.type != "cuda" or not isinstance(backend, TritonBackend)
                or self.parallel is not None or self.ep is not None):
            return
        from swaserve.attention.warmup import warm_up_attention

        warm_up_attention(self.model, backend, self.kv, self.device)

    def _piecewise_max_tokens(self) -> int:
        """Tokens of the largest step with piecewise graphs (0: none), at most the token
        budget. The default stops at 2,048: above it an 8B model's step is GPU-bound (its
        eager launches, ~25 ms, hide behind ~30+ ms of GEMMs), and each bucket costs ~1 s of
        capture at start."""
        c = self.config
        if (self.device.type != "cuda" or c.cuda_graph_max_bs == 0 or c.tensor_parallel_size > 1
                or self.ep is not None):
            return 0
        if c.piecewise_cuda_graph_max_tokens is not None:
            return min(c.max_num_batched_tokens, c.piecewise_cuda_graph_max_tokens)
        return min(c.max_num_batched_tokens, PIECEWISE_DEFAULT_MAX_TOKENS)

    def _mixed_max_tokens(self) -> int:
        """Tokens of the largest step run as a mixed CUDA graph (0: none): where piecewise
        graphs may run (the same conditions), at most the token budget."""
        c = self.config
        if (self.device.type != "cuda" or c.cuda_graph_max_bs == 0 or c.tensor_parallel_size > 1
                or self.ep is not None):
            return 0
        limit = c.mixed_cuda_graph_max_tokens
        if limit is None:
            limit = MIXED_DEFAULT_MAX_TOKENS
        return min(c.max_num_batched_tokens, limit)

    def _kv_bytes(self, backend: Any, kv_shape: tuple[int, int], kv_dtype: torch.dtype) -> float:
        return kv_budget_bytes(
            self.config, self.model, backend, self.layout, kv_shape, kv_dtype, self.max_model_len,
            int(self.hf_config.vocab_size), self.device, self._piecewise_max_tokens() > 0,
        )

    # ---- requests -------------------------------------------------------------------------

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Validate a request (its prompt against the context, the token ids its params name,
        its grammar, compiled here and cached); returns the max_tokens to use."""
        check_vocab_ids(params, self.hf_config.vocab_size)
        check_priority(params, self.config.scheduling_policy)
        check_satisfiable(params, self.eos_token_ids)
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)
        limit = ContextLimit(self.max_model_len, self.context_by_kv_pool)
        max_tokens = check_prompt(limit, num_prompt_tokens, params)
        if params.max_tokens is None and self.default_max_tokens is not None:
            max_tokens = min(max_tokens, self.default_max_tokens)
        return max_tokens

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if params.bad_words and params.bad_words_token_ids is None:
            raise ValueError("bad_words reach the engine core as token ids: resolve them with "
                             "the tokenizer first (sampling/bad_words.py resolve_bad_words)")
        prompt_token_ids = truncate_prompt(prompt_token_ids, params, self.max_model_len)
        check_token_ids(prompt_token_ids, self.hf_config.vocab_size)
        max_tokens = self.resolve_max_tokens(len(prompt_token_ids), params)
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids,
            generator=gen,
        )
        if params.structured_outputs is not None:  # compiled by resolve_max_tokens: cached
            matcher = self.grammars.matcher(params.structured_outputs)
            if params.reasoning_markers is None:
                req.grammar = matcher
            else:
                req.reasoning_gate = ReasoningGate(params.reasoning_markers,
                                                   params.reasoning_started)
                req.reasoning_gate.attach(req, matcher)
        self.requests[request_id] = req
        self._num_history_requests += _needs_history(params)
        self._num_seeded_sampling += _seeded_sampling(params)
        self._num_not_plain += not _plain_greedy(params)
        self.scheduler.add(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            req = self.scheduler.abort(rid)
            if req is not None:
                self._forget(req)

    def _forget(self, req: Request) -> None:
        if self.requests.pop(req.request_id, None) is not None:
            self._num_history_requests -= _needs_history(req.params)
            self._num_seeded_sampling -= _seeded_sampling(req.params)
            self._num_not_plain -= not _plain_greedy(req.params)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (device pages and offload tiers), as vLLM's: False, and
        nothing dropped, while a request runs or waits.

        A step still in flight whose requests have all finished or been aborted since it was
        launched (the overlap schedule; an abort for a stop string just before the reset) is
        read back first: every token it sampled is discarded (`_resolve` skips finished
        requests), so nothing comes out, and the reset does not fail for a step nobody waits
        on. No collective is involved (the read-back is this rank's own), so an
        expert-parallel rank may do it alone, between two of its lockstep `step`s."""
        if self.scheduler.has_unfinished():
            return False
        if self._inflight is not None:
            self._resolve()  # its requests all finished: what it sampled goes to no one
        if self.cache is not None:
            self.cache.reset()
        return True

    def has_unfinished(self) -> bool:
        """Requests queued or running, or a launched step whose tokens are not out yet."""
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ---- the step -------------------------------------------------------------------------
    #
    # Overlap schedule (on unless --disable-overlap-schedule): step N+1 is scheduled and
    # launched before step N's sampled tokens are read back, so the host's work for N+1 runs
    # while the device computes N. Until read back, a sampled token is a PLACEHOLDER in
    # `output_token_ids` (so token counts, page allocation and the scheduler see it) and its
    # value lives only on the device: the next step's input ids take it from there
    # (`DeviceTokens`). Invariants:
    #   - only the latest launched step is in flight; its placeholders are the last output
    #     token of each request that sampled in it;
    #   - every computed position holds a real token id by the time `retire()` hands pages
    #     to the prefix cache (the in-flight step's placeholders are never computed yet);
    #   - a request that finishes or is aborted while a later step is in flight drops its
    #     trailing placeholders; that step's token for it is discarded.
    # Penalties read the token values of the history, so while any live request uses one the
    # in-flight step is read back before scheduling (no overlap for those steps).

    def step(self) -> list[EngineCoreOutput]:
        """One step. Under expert parallelism every rank calls it the same number of times
        (with nothing to do too): each call makes the step's agreement (`_agree`)."""
        outputs: list[EngineCoreOutput] = []
        t0 = time.perf_counter()
        drafting = self.spec is not None and self.spec.decide(len(self.scheduler.running),
                                                              self._num_seeded_sampling > 0)
        if self._inflight is not None and (self._num_history_requests or drafting):
            outputs += self._resolve()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self._num_history_requests > 0)
        batch = self.scheduler.schedule()
        if self.cache is not None:
            self.cache.move_pages()  # host loads/stores, then copy-on-write: before any forward
        outputs += [self._aborted(r) for r in batch.rejected]
        launched = self._launch(batch) if self._agree(batch) else None
        if self.ep is not None:
            self.ep.end_step()
        outputs += self._resolve()
        self._inflight = launched
        if launched is not None and (not self.overlap or launched.verified is not None):
            outputs += self._resolve()  # a verify step is read back at once (speculation.py)
        if batch:
            self.scheduler.retire()
        if self.spec is not None and launched is not None:
            # with overlap the call's wall time is the pipeline's time per step
            self.spec.record_step(batch.num_new_tokens, launched.verified,
                                  time.perf_counter() - t0)
        return outputs

    def _agree(self, batch: ScheduledBatch) -> bool:
        """Whether this step runs this rank's batch. Under expert parallelism every rank first
        agrees on the step (one collective), and a rank without a batch runs an idle forward
        when another rank has one, so that every MoE layer's exchange has all ranks."""
        if self.ep is None:
            return bool(batch)
        # decode-only: every chunk is a request's last token plus its drafts (a verify counts
        # its K + 1 tokens); with every rank so and none above the cap, the step's MoE layers
        # take the fixed-shape path
        decode_only = all(r.num_computed_tokens == r.num_tokens - 1 for r in batch.requests)
        if self.ep.agree_step(sum(batch.num_new_tokens), decode_only) and not batch:
            self.ep.idle_forward()
        return bool(batch)

    def _launch(self, batch: ScheduledBatch) -> _Launched:
        """Enqueue forward + sampling of one batch; nothing here waits for the device."""
        samplers, rows = self._sampling_rows(batch)
        for req in samplers:  # structured outputs: every earlier token was read back (history)
            if req.grammar is not None:
                req.token_bitmask = self.grammars.bitmasks(req.grammar, req.draft_token_ids)
                if req.reasoning_gate is not None:
                    req.reasoning_gate.allow_open(req, req.token_bitmask)
            elif req.token_bitmask is not None:  # its reasoning began: the grammar is held
                req.token_bitmask = None
        fill = self._device_tokens(batch)
        if self.spec is not None and self.spec.device_drafts is not None:
            # a step that drafts read the one in flight back first: never both
            assert fill is None, "device drafts beside tokens in flight"
            fill = self.spec.draft_fill(batch.requests, batch.num_new_tokens)
        verifying = self.spec is not None and any(r.draft_token_ids for r in samplers)
        # CPU: plain greedy tokens without logits (ops/greedy_head.py): every live request
        # plain greedy (as the `row_argmax` shortcut below) and no drafts to verify
        screened = (self.runner.greedy_head is not None and not self._num_not_plain
                    and not verifying)
        greedy_ids = None
        logits = self.runner.decode_logits(batch, self.memory, fill)
        if logits is None and self.spec is not None:
            logits = self.runner.verify_logits(batch, self.memory, fill)
        if logits is None and not verifying and not screened and not any(
            r.params.prompt_logprobs is not None for r in batch.requests
        ):
            logits = self.runner.mixed_logits(batch, self.memory, rows, fill)
        if logits is None:
            fb = self.runner.prepare(batch, self.memory, fill)
            hidden = self.runner.forward(fb)
            if samplers:
                # Not torch.tensor(rows, device=...): that copy blocks the host until the step
                # in flight is done, which would undo the overlap.
                idx = torch.tensor(rows).to(self.device, non_blocking=True)
                if screened:
                    greedy_ids = self.runner.greedy_head.tokens(hidden[idx])
                else:
                    logits = self.runner.logits(hidden[idx])
            self._prompt_logprobs(batch, hidden)
        # DFlash: the drafter's context K/V of the tokens just computed (a graph stored them)
        if self.runner.keep and not self.runner.context_stored:
            self.spec.dflash.store_context(
                [r.num_computed_tokens for r in batch.requests], list(batch.num_new_tokens),
                [self.memory.page_table(r.request_id) for r in batch.requests],
                self.runner.kept, self.kv,
            )
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
        if not samplers:
            return _Launched(samplers, [], None, None, None, None)
        # a step without drafts samples as plain decoding does (same tokens, less host work)
        if verifying:
            verified = self.spec.sample(logits, samplers)
            return _Launched(samplers, [], None, None, None, None, verified)
        if greedy_ids is not None:
            sampled = SamplerOutput(token_ids=greedy_ids)
        elif self._num_not_plain:
            sampled = self.sampler(logits, [self._row(r) for r in samplers])
        else:  # the sampler's own shortcut, without a row per request (host time per step)
            sampled = SamplerOutput(token_ids=row_argmax(logits))
        slots = []
        for req in samplers:
            slots.append(len(req.output_token_ids))
            req.output_token_ids.append(PLACEHOLDER)
        host, host_lps, event = self._copy_to_host(sampled)
        return _Launched(samplers, slots, sampled, host, host_lps, event)

    def _copy_to_host(
        self, sampled: SamplerOutput
    ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...] | None, Any]:
        """The one device-to-host copy of a step, into pinned memory, with an event to wait on
        (the tensors themselves on CPU): the token ids, and the logprobs when asked for, so
        that reading them back does not wait for the next step already enqueued."""
        ids = sampled.token_ids
        lps = None
        if sampled.logprobs is not None:
            lps = (sampled.logprobs, sampled.ranks, sampled.topk_ids, sampled.topk_logprobs)
        if ids.device.type != "cuda":
            return ids, lps, None
        if lps is not None:
            lps = tuple(None if t is None else _to_pinned(t) for t in lps)
        self._pinned_turn ^= 1
        buf = self._pinned[self._pinned_turn]
        if buf is None or buf.numel() < ids.numel():
            buf = torch.empty(max(ids.numel(), 256), dtype=ids.dtype, pin_memory=True)
            self._pinned[self._pinned_turn] = buf
        host = buf[: ids.numel()]
        host.copy_(ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, lps, event

    def _device_tokens(self, batch: ScheduledBatch) -> DeviceTokens | None:
        """Input positions whose token is a placeholder of the in-flight step."""
        inflight = self._inflight
        if inflight is None or inflight.sampled is None:
            return None
        row_of = {id(r): i for i, r in enumerate(inflight.samplers)}
        dst, src, offset = [], [], 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            offset += n
            i = row_of.get(id(req))
            # Only the last token can be pending, and only if this chunk reaches it.
            if i is not None and req.num_computed_tokens + n == inflight.slots[i] + 1 + len(
                req.prompt_token_ids
            ):
                dst.append(offset - 1)
                src.append(i)
        if not dst:
            return None
        return DeviceTokens(dst, src, inflight.sampled.token_ids)

    def _resolve(self) -> list[EngineCoreOutput]:
        """Read the in-flight step's tokens back and finish its requests' bookkeeping."""
        launched, self._inflight = self._inflight, None
        if launched is not None and launched.verified is not None:
            v = launched.verified
            return [
                self._commit(req, v.token_ids[i], v.num_drafts[i], v.logprobs[i] if v.logprobs
                             else None)
                for i, req in enumerate(launched.samplers)
            ]
        if launched is None or launched.sampled is None:
            return []
        if launched.event is not None:
            launched.event.synchronize()
        tokens = launched.host.tolist()
        lps = _logprob_list(*launched.host_lps, tokens) if launched.host_lps else None
        outputs = []
        for i, req in enumerate(launched.samplers):
            if req.status is RequestStatus.FINISHED:
                continue  # finished or aborted while this step was in flight
            out = self._accept_token(req, launched.slots[i], tokens[i], lps[i] if lps else None)
            # A step without drafts leaves the counters as they were: the caller keeps the
            # last ones it got, so they go out only with a request's first token (a request
            # that never verifies still reports zero counters) and its last (not per step:
            # the server serialises every output)
            if self.spec is not None and (launched.slots[i] == 0 or out.finish_reason):
                out.spec = (req.spec or SpecStats()).to_dict()
            outputs.append(out)
        return outputs

    def has_in_flight(self) -> bool:
        return self._inflight is not None

    def _sampling_rows(self, batch: ScheduledBatch) -> tuple[list[Request], list[int]]:
        """Requests whose new tokens reach the end of their known tokens (and drafts) sample
        one more: one row, or with K drafts the K + 1 verify rows [last, d_1..d_K]."""
        reqs, rows, offset = [], [], 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            offset += n
            if req.num_computed_tokens + n == req.num_tokens_with_drafts:
                reqs.append(req)
                rows.extend(range(offset - len(req.draft_token_ids) - 1, offset))
        return reqs, rows

    @staticmethod
    def _row(req: Request) -> SamplingRow:
        mask = None if req.token_bitmask is None else req.token_bitmask[0]
        return SamplingRow(req.params, req.generator, req.prompt_token_ids, req.output_token_ids,
                           mask)

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        offset = 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start, k = req.num_computed_tokens, req.params.prompt_logprobs
            if k is not None and not req.prompt_logprobs_sent and start < req.num_prompt_tokens:
                if req.prompt_logprobs is None or start == 0:
                    req.prompt_logprobs = [None]
                # Position p predicts prompt token p + 1.
                end = min(start + n, req.num_prompt_tokens - 1)
                for s in range(start, end, _PROMPT_LOGPROB_ROWS):
                    e = min(end, s + _PROMPT_LOGPROB_ROWS)
                    logits = self.runner.logits(hidden[offset + s - start : offset + e - start])
                    ids = req.prompt_token_ids[s + 1 : e + 1]
                    target = torch.tensor(ids, device=self.device)
                    req.prompt_logprobs += _logprob_list(*compute_logprobs(logits, target, k), ids)
            offset += n

    def _accept_token(
        self, req: Request, slot: int, token: int, lp: Logprob | None
    ) -> EngineCoreOutput:
        """Token `token` replaces the placeholder at output index `slot`; stop checks."""
        req.output_token_ids[slot] = token
        p = req.params
        out = EngineCoreOutput(req.request_id, [token], num_cached_tokens=req.num_cached_tokens)
        if p.logprobs is not None and lp is not None:
            lp.top = lp.top[: p.logprobs]
            out.new_logprobs = [lp]
        if not req.prompt_logprobs_sent:
            req.prompt_logprobs_sent = True
            out.prompt_logprobs = req.prompt_logprobs
        n_out = slot + 1
        out.finish_reason, out.stop_reason = self._stop_rule(req, token, n_out)
        if out.finish_reason is not None:
            del req.output_token_ids[n_out:]  # placeholders of a step still in flight
            self._finish(req)
        return out

    def _stop_rule(self, req: Request, token: int, n_out: int) -> tuple[str | None, int | None]:
        """(finish_reason, stop_reason) once `token` is output number n_out. Every path that
        outputs a token passes here once per token, in order: it also advances the request's
        grammar, whose completion ends the request."""
        p = req.params
        gated = req.reasoning_gate is not None and req.reasoning_gate.on_token(req, token, n_out)
        if not gated and req.grammar is not None and Grammars.advance(req.grammar, token):
            if token in p.stop_token_ids:
                return "stop", token
            return "stop", None
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                return "stop", None
            if token in p.stop_token_ids:
                return "stop", token
        if n_out >= req.max_tokens or req.num_prompt_tokens + n_out >= self.max_model_len:
            return "length", None
        return None, None

    def _commit(
        self, req: Request, tokens: list[int], num_drafts: int, lps: list | None
    ) -> EngineCoreOutput:
        """Speculation: output the verified tokens up to the first that finishes the request.
        `_launch` advanced num_computed_tokens past every verify row; only the rows of tokens
        now committed before the last one hold live K/V (the rest is overwritten later)."""
        record(req, num_drafts, len(tokens) - 1)
        base = req.num_computed_tokens - num_drafts - 1
        req.draft_token_ids = []
        p = req.params
        out = EngineCoreOutput(req.request_id, [], num_cached_tokens=req.num_cached_tokens)
        if p.logprobs is not None and lps is not None:
            out.new_logprobs = []
        for i, token in enumerate(tokens):
            req.output_token_ids.append(token)
            out.new_token_ids.append(token)
            if out.new_logprobs is not None:
                chosen, rank, top_ids, top_lps = lps[i]
                top = list(zip(top_ids, top_lps))[: p.logprobs]
                out.new_logprobs.append(Logprob(token, chosen, int(rank), top))
            out.finish_reason, out.stop_reason = self._stop_rule(
                req, token, len(req.output_token_ids)
            )
            if out.finish_reason is not None:
                break
        req.num_computed_tokens = base + len(out.new_token_ids)
        if not req.prompt_logprobs_sent:
            req.prompt_logprobs_sent = True
            out.prompt_logprobs = req.prompt_logprobs
        # The counters so far, with every output: a stop string found by the output
        # processor ends the request without another output from here.
        out.spec = (req.spec or SpecStats()).to_dict()
        if out.finish_reason is not None:
            self._finish(req)
        return out

    def _finish(self, req: Request) -> None:
        if self.disagg is not None and self.disagg.hold(req):
            return  # a PD prefill instance: its pages stay until they are sent
        if req.status is RequestStatus.RUNNING:
            self.scheduler.finish(req)
        else:  # preempted while its last step was in flight: it waits in the queue
            self.scheduler.abort(req.request_id)
        self._forget(req)

    def _aborted(self, req: Request) -> EngineCoreOutput:
        self._forget(req)
        out = EngineCoreOutput(req.request_id, [], finish_reason="abort")
        if self.spec is not None:
            out.spec = (req.spec or SpecStats()).to_dict()
        return out

    def memory_stats(self) -> dict:
        stats = self.memory.stats()
        if self.cache is not None:
            stats.update(self.cache.stats())
        else:
            stats.update(dict.fromkeys(("cache_pages", "host_pages", "cache_hit_tokens",
                                        "evictions", "host_loads", "host_load_waits"), 0))
        if self.ep is not None:  # the MoE exchange's decode workspace and its paths' steps
            stats["moe_workspace_bytes"] = self.ep.workspace_bytes
            stats.update(self.ep.counts)
        return stats


def kv_budget_bytes(
    config: EngineConfig,
    model: Any,
    backend: Any,
    layout: Any,
    kv_shape: tuple[int, int],
    kv_dtype: torch.dtype,
    max_model_len: int,
    vocab_size: int,
    device: torch.device,
    piecewise: bool,
) -> float:
    """Bytes for this rank's KV pool: --kv-cache-gb, else 2 GiB on CPU, else what the memory
    profile leaves (a forward: with tensor parallelism every rank profiles at once)."""
    if config.kv_cache_gb is not None:
        return config.kv_cache_gb * 2**30
    if device.type != "cuda":
        return 2 * 2**30
    from swaserve.engine.memory_profile import profile_kv_bytes

    c = config
    return profile_kv_bytes(
        model, backend, layout, c.page_size, kv_shape, kv_dtype,
        min(c.max_num_batched_tokens, max_model_len), c.max_num_seqs, vocab_size,
        c.gpu_memory_utilization, device, piecewise=piecewise,
    ).kv_bytes


def agree_kv_scales(tp: TPGroup, ks: list[float], vs: list[float]) -> tuple[list, list]:
    """FP8 scales calibrated on each rank's heads -> the largest per layer over the ranks, as
    one process calibrating every head would get."""
    n = len(ks)
    both = tp.agree(list(ks) + list(vs), "max")
    return both[:n], both[n:]


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    """A non-blocking copy of device tensor t into pinned host memory (done once the stream
    reaches it)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _logprob_list(
    chosen: torch.Tensor,
    ranks: torch.Tensor,
    top_ids: torch.Tensor | None,
    top_lps: torch.Tensor | None,
    tokens: list[int],
) -> list[Logprob]:
    """Logprob tensors -> Logprob objects. The sampled step's come from the host copies made
    with its tokens; prompt logprobs are read from the device (their step waits anyway)."""
    chosen_l, ranks_l = chosen.tolist(), ranks.tolist()
    ids_l = top_ids.tolist() if top_ids is not None else [[] for _ in chosen_l]
    lps_l = top_lps.tolist() if top_lps is not None else [[] for _ in chosen_l]
    return [
        Logprob(
            token_id=tokens[i],
            logprob=chosen_l[i],
            rank=int(ranks_l[i]),
            top=list(zip(ids_l[i], lps_l[i])),
        )
        for i in range(len(chosen_l))
    ]
