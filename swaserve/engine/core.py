"""EngineCore: scheduler + model, one `step()` at a time. It knows token ids, never text
(tokenizing and stop strings live with the output processor, in the caller's process)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from swaserve.attention import backend_class
from swaserve.config import EngineConfig
from swaserve.engine.limits import check_prompt, check_token_ids
from swaserve.engine.model_runner import ModelRunner
from swaserve.engine.request import Request
from swaserve.engine.scheduler import ScheduledBatch, Scheduler
from swaserve.memory.groups import build_layout
from swaserve.memory.kv_pool import KVPool
from swaserve.memory.manager import MemoryManager, page_bytes
from swaserve.memory.radix_cache import build_prefix_cache
from swaserve.models.blocks import head_dim_of, layer_windows
from swaserve.outputs import EngineCoreOutput, Logprob
from swaserve.sampling.logprobs import compute_logprobs
from swaserve.sampling.params import SamplingParams
from swaserve.sampling.sampler import Sampler, SamplerOutput, SamplingRow
from swaserve.weights.loader import build_model, load_hf_config

log = logging.getLogger(__name__)
_PROMPT_LOGPROB_ROWS = 256  # rows of [rows, vocab] logits computed at a time


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
    def __init__(self, config: EngineConfig, folder: Path) -> None:
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        self.hf_config = load_hf_config(folder)
        hf = self.hf_config
        self.model = build_model(
            hf, folder, self.dtype, self.device, config.load_format == "dummy", config.seed
        )
        self.max_model_len = config.max_model_len or int(hf.max_position_embeddings)
        self.eos_token_ids = eos_token_ids(folder, hf)
        self.layout = build_layout(layer_windows(hf), all_full=config.disable_hybrid_kv_cache)
        kv_heads, head_dim = hf.num_key_value_heads, head_dim_of(hf)
        kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8_e4m3" else self.dtype
        bytes_per_page = page_bytes(
            self.layout, config.page_size, kv_heads, head_dim, kv_dtype.itemsize
        )
        num_pages = max(2, int(self._kv_bytes() // bytes_per_page))
        self.kv = KVPool(
            self.layout, num_pages, config.page_size, kv_heads, head_dim, kv_dtype, self.device
        )
        if self.kv.is_fp8:
            self._set_fp8_scales(kv_heads, head_dim)
        self.memory = MemoryManager(
            self.layout, config.page_size, num_pages, watermark_pages=len(self.layout.groups)
        )
        self.cache = build_prefix_cache(config, self.memory, self.kv)
        self.scheduler = Scheduler(
            self.memory, config.max_num_seqs, config.max_num_batched_tokens, self.cache
        )
        backend = backend_class(config.backend_name())(self.layout, config.page_size, self.device)
        self.runner = ModelRunner(self.model, self.kv, backend, self.device)
        if config.cuda_graph_max_bs > 0 and self.device.type == "cuda":
            self._capture_graphs(backend)
        # --seed makes unseeded sampling reproducible run to run (seeded requests use their own)
        self.sampler = Sampler(eos_token_ids=sorted(self.eos_token_ids), seed=config.seed)
        self.requests: dict[str, Request] = {}
        log.info(
            "KV pool: %d pages of %d tokens (%.2f GB), groups %s",
            num_pages,
            config.page_size,
            num_pages * bytes_per_page / 1e9,
            [(g.kind, g.window, len(g.layers)) for g in self.layout.groups],
        )

    def _set_fp8_scales(self, kv_heads: int, head_dim: int) -> None:
        n = self.hf_config.num_hidden_layers
        if self.config.kv_cache_scale is not None:
            self.kv.set_scales([self.config.kv_cache_scale] * n, [self.config.kv_cache_scale] * n)
            return
        from swaserve.engine.kv_calibration import calibrate_kv_scales

        ks, vs = calibrate_kv_scales(
            self.model, self.layout, self.config.page_size, kv_heads, head_dim, self.dtype,
            self.device, self.hf_config.vocab_size, self.config.seed,
        )
        self.kv.set_scales(ks, vs)
        log.info("fp8 KV scales calibrated: k %.3g..%.3g, v %.3g..%.3g",
                 min(ks), max(ks), min(vs), max(vs))

    def _capture_graphs(self, backend: Any) -> None:
        from swaserve.attention.triton_backend import TritonBackend
        from swaserve.engine.cuda_graph import DecodeGraphs

        if not isinstance(backend, TritonBackend):
            log.warning("CUDA graphs need the triton attention backend; running eager")
            return
        hf = self.hf_config
        shape = (hf.num_attention_heads, hf.num_key_value_heads, head_dim_of(hf))
        graphs = DecodeGraphs(
            self.model, backend, self.kv, self.config.cuda_graph_max_bs, self.max_model_len, shape
        )
        graphs.capture()
        self.runner.graphs = graphs

    def _kv_bytes(self) -> float:
        if self.config.kv_cache_gb is not None:
            return self.config.kv_cache_gb * 2**30
        if self.device.type != "cuda":
            return 2 * 2**30
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        # Leave room for activations of one full step (a rough bound until the profiling
        # pass of the GPU issue replaces it).
        act = 64 * self.config.max_num_batched_tokens * self.hf_config.hidden_size * 4
        return max(0.0, total * self.config.gpu_memory_utilization - used - act)

    # ---- requests -------------------------------------------------------------------------

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Validate a prompt against the context; returns the max_tokens to use."""
        return check_prompt(self.max_model_len, num_prompt_tokens, params)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
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
        self.requests[request_id] = req
        self.scheduler.add(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self.scheduler.abort(rid) is not None:
                self.requests.pop(rid, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        batch = self.scheduler.schedule()
        if self.cache is not None:
            self.cache.move_pages()  # host loads/stores, then copy-on-write: before any forward
        outputs = [self._aborted(r) for r in batch.rejected]
        if not batch:
            return outputs
        samplers, rows = self._sampling_rows(batch)
        logits = self.runner.decode_logits(batch, self.memory)
        if logits is None:
            fb = self.runner.prepare(batch, self.memory)
            hidden = self.runner.forward(fb)
            if samplers:
                logits = self.runner.logits(hidden[torch.tensor(rows, device=self.device)])
            self._prompt_logprobs(batch, hidden)
        sampled = self.sampler(logits, [self._row(r) for r in samplers]) if samplers else None
        return outputs + self._postprocess(batch, samplers, sampled)

    def _sampling_rows(self, batch: ScheduledBatch) -> tuple[list[Request], list[int]]:
        """Requests whose new tokens reach the end of their known tokens sample one more."""
        reqs, rows, offset = [], [], 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            offset += n
            if req.num_computed_tokens + n == req.num_tokens:
                reqs.append(req)
                rows.append(offset - 1)
        return reqs, rows

    @staticmethod
    def _row(req: Request) -> SamplingRow:
        return SamplingRow(req.params, req.generator, req.prompt_token_ids, req.output_token_ids)

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

    def _postprocess(
        self, batch: ScheduledBatch, samplers: list[Request], sampled: SamplerOutput | None
    ) -> list[EngineCoreOutput]:
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
        outputs: list[EngineCoreOutput] = []
        if sampled is not None:
            # The one device-to-host copy of the step (plus logprobs when asked for).
            tokens = sampled.token_ids.tolist()
            lps = None
            if sampled.logprobs is not None:
                lps = _logprob_list(
                    sampled.logprobs, sampled.ranks, sampled.topk_ids, sampled.topk_logprobs, tokens
                )
            for i, req in enumerate(samplers):
                outputs.append(self._append_token(req, tokens[i], lps[i] if lps else None))
        self.scheduler.retire()
        return outputs

    def _append_token(self, req: Request, token: int, lp: Logprob | None) -> EngineCoreOutput:
        req.output_token_ids.append(token)
        p = req.params
        out = EngineCoreOutput(req.request_id, [token], num_cached_tokens=req.num_cached_tokens)
        if p.logprobs is not None and lp is not None:
            lp.top = lp.top[: p.logprobs]
            out.new_logprobs = [lp]
        if not req.prompt_logprobs_sent:
            req.prompt_logprobs_sent = True
            out.prompt_logprobs = req.prompt_logprobs
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                out.finish_reason = "stop"
            elif token in p.stop_token_ids:
                out.finish_reason, out.stop_reason = "stop", token
        if out.finish_reason is None and (
            n_out >= req.max_tokens or req.num_tokens >= self.max_model_len
        ):
            out.finish_reason = "length"
        if out.finish_reason is not None:
            self.scheduler.finish(req)
            self.requests.pop(req.request_id, None)
        return out

    def _aborted(self, req: Request) -> EngineCoreOutput:
        self.requests.pop(req.request_id, None)
        return EngineCoreOutput(req.request_id, [], finish_reason="abort")

    def memory_stats(self) -> dict:
        stats = self.memory.stats()
        if self.cache is not None:
            stats.update(self.cache.stats())
        else:
            stats.update(dict.fromkeys(("cache_pages", "host_pages", "cache_hit_tokens",
                                        "evictions", "host_loads"), 0))
        return stats


def _logprob_list(
    chosen: torch.Tensor,
    ranks: torch.Tensor,
    top_ids: torch.Tensor | None,
    top_lps: torch.Tensor | None,
    tokens: list[int],
) -> list[Logprob]:
    """Device tensors -> Logprob objects (a host copy: only when logprobs were asked for)."""
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
