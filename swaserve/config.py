"""EngineConfig: one dataclass for every knob, from CLI flags or `Engine(**kwargs)`
(docs/serving.md).

`FLAGS` beside it is the rest of each knob's single source: its `--help` line, argument group
and choices (`swaserve.cli.add_engine_args` builds the flags from both; a field without an
entry fails tests/unit/test_cli_help.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

BIG_GPU_BYTES = 70 * 2**30  # vLLM's line for its larger defaults (H100/H200 class)
GRAPH_MAX_BS = 128  # --cuda-graph-max-bs by default, and the cap of verify graphs
GRAPH_MAX_BS_BIG = 512  # --cuda-graph-max-bs by default on a big GPU


@dataclass
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    load_format: str = "auto"  # auto | dummy
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # None: by device (`with_device_defaults`): 1024 and 16,384 (server 8,192) on a GPU of
    # >= 70 GiB, else 256 and 2,048.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    page_size: int = 16
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float = 0.85
    kv_cache_dtype: str = "auto"  # auto | fp8_e4m3 (| fp8, vLLM's name, normalised to it)
    # None | fp8: the layers' projections as float8 e4m3 weights (swaserve/ops/fp8_linear.py)
    quantization: str | None = None
    kv_cache_scale: float | None = None  # fp8: one given scale for every layer; None: calibrate
    # cpu | torch | triton; None: triton on CUDA, else cpu (torch with --disable-fused-ops)
    attention_backend: str | None = None
    disable_prefix_cache: bool = False
    host_cache_gb: float = 0.0
    host_cache_policy: str = "write_back"
    disk_cache_dir: str | None = None
    disk_cache_gb: float | None = None  # default: min(16 GiB, half the directory's free space)
    # Every layer keeps a full-length KV (the baseline the window-aware pool is measured
    # against); attention still uses each layer's window, so outputs do not change.
    disable_hybrid_kv_cache: bool = False
    # Schedule and launch step N+1 before reading step N's sampled tokens back (see core.py).
    disable_overlap_schedule: bool = False
    # Triton RMSNorm / rotary / activation kernels on CUDA (eager torch elsewhere).
    disable_fused_ops: bool = False
    # CUDA only; 0 disables. None: by device (`with_device_defaults`): 512 on a GPU of >= 70
    # GiB (at most max_num_seqs), else 128.
    cuda_graph_max_bs: int | None = None
    # Piecewise graphs (all but attention) for the other steps; None: min(budget, 2048).
    piecewise_cuda_graph_max_tokens: int | None = None  # CUDA only; 0 disables
    # Whole graphs, attention included, for steps mixing decodes and prefill chunks of up to
    # this many tokens (engine/mixed_graph.py); None: min(budget, 256). CUDA only; 0 disables
    mixed_cuda_graph_max_tokens: int | None = None
    chat_template: str | None = None
    seed: int = 0
    max_queue: int = 1024
    # Admission's reserve for running requests' decode growth (engine/scheduler.py): 0 admits
    # eagerly and preempts when short, 1 keeps their expected output's pages free.
    schedule_conservativeness: float = 1.0
    # Under KV pressure, steps with decodes carry prefill up to this many tokens in all
    # (engine/scheduler.py); 0: off. Opt-in: on an H100 it lost 7% on a Llama-8B run of 16k
    # prompts (benchmarks/RESULTS.md, 2026-12-06); the Gemma runs it is meant for are not
    # measured yet.
    kv_bound_step_tokens: int = 0
    # Prefill ahead (engine/scheduler.py): while the pool is full of decodes, one waiting
    # prompt at a time is prefilled in chunks of at most this many tokens less the step's
    # decodes, and parked in the prefix cache's host tier until there is room for it to decode.
    # Needs the prefix cache and --host-cache-gb. 0: off. Did not pay on an H100 (the Gemma
    # decode-heavy run it was built for: even to -12%; docs/architecture.md §2).
    prefill_ahead_tokens: int = 0
    # fcfs | priority: requests' `priority` orders admission and preemption
    # (engine/scheduler.py), as vLLM's --scheduling-policy
    scheduling_policy: str = "fcfs"
    # Offline generate()/chat(): the order a batch's requests queue in (engine/engine.py).
    offline_order: str = "longest_first"  # longest_first | arrival
    max_logprobs: int = 20
    # The model's sampling defaults (sampling/generation_defaults.py): auto (its
    # generation_config.json), vllm or none (the API's), or a folder holding one
    generation_config: str = "auto"
    override_generation_config: str | dict | None = None  # JSON: {"temperature": 0.5, ...}
    # Speculative decoding (docs/architecture.md §8): off unless an algorithm is named.
    speculative_algorithm: str | None = None  # ngram | dflash
    speculative_draft_model: str | None = None  # dflash: the drafter's folder
    # Drafts per verify step (vLLM's num_speculative_tokens); default: ngram 4, dflash
    # block_size - 1 of its checkpoint.
    speculative_num_draft_tokens: int | None = None
    speculative_ngram_min: int = 1  # ngram: shortest suffix to look up in the request's tokens
    speculative_ngram_max: int = 4  # ngram: longest suffix, tried first
    # Every decode step drafts (otherwise a measured gate drafts only at batch sizes where it
    # pays: speculative/gate.py; seeded sampling requests always draft).
    disable_adaptive_speculation: bool = False
    # Tensor parallelism (docs/architecture.md, scale-out): one process per rank, rank 0 runs
    # the EngineCore; the others are spawned workers holding their shard of the weights and KV.
    tensor_parallel_size: int = 1
    # Machines the ranks span: with data parallelism data_parallel_size / nnodes data-parallel
    # ranks on each (replicas or expert-parallel ranks), else tensor_parallel_size / nnodes.
    nnodes: int = 1
    node_rank: int = 0  # this machine's index; node 0 runs the engine(s) and HTTP
    dist_init_addr: str | None = None  # HOST:PORT of node 0's rendezvous; None: a free local port
    # Data parallelism: D engine-core replicas (each a tensor-parallel group of T ranks) behind
    # one frontend, or offline in the Engine's process.
    data_parallel_size: int = 1
    # MoE models: the experts split over the D ranks, attention data-parallel (one engine each)
    enable_expert_parallel: bool = False
    # Expert parallelism: rows per rank of the fixed-shape MoE exchange of decode-only steps,
    # and the most decode/verify tokens the scheduler puts on a rank's step (0: no fixed
    # workspace, every step variable-size). None: the largest decode step, min(budget,
    # max_num_seqs x (1 + drafts per verify)) (swaserve/distributed/decode_workspace.py).
    moe_decode_max_tokens_per_rank: int | None = None
    # Prefill/decode disaggregation (docs/architecture.md §9.3, swaserve/disaggregation/):
    # `serve` only; a PD pair is two instances behind `swaserve router`.
    disaggregation_mode: str | None = None  # prefill | decode
    disaggregation_transfer_backend: str = "nixl"  # nixl | local
    disaggregation_timeout: float = 60.0  # seconds one side of a pair waits for the other

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            flag = "--" + name.replace("_", "-")
            return ValueError(f"invalid {flag} {getattr(self, name)!r} ({name}): {why}")

        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise bad("max_num_seqs", "must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", "must be >= 1")
        if self.page_size < 1:
            raise bad("page_size", "must be >= 1")
        if self.kv_cache_dtype == "fp8":  # vLLM's name; e4m3 is what it means on CUDA
            self.kv_cache_dtype = "fp8_e4m3"
        for name, info in FLAGS.items():
            value = getattr(self, name)
            none_ok = value is None and _DEFAULTS[name] is None  # None: the flag not given
            if info.choices and value not in info.choices and not none_ok:
                raise bad(name, "must be " + _one_of(info.choices))
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 0:
            raise bad("cuda_graph_max_bs", "must be >= 0 (0: no CUDA graphs)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise bad("kv_cache_gb", "must be > 0")
        if self.disk_cache_gb is not None and self.disk_cache_gb <= 0:
            raise bad("disk_cache_gb", "must be > 0")
        if self.disk_cache_gb is not None and not self.disk_cache_dir:
            raise bad("disk_cache_gb", "needs --disk-cache-dir (disk_cache_dir)")
        if self.host_cache_gb < 0:
            raise bad("host_cache_gb", "must be >= 0")
        if not self.schedule_conservativeness >= 0:
            raise bad("schedule_conservativeness", "must be >= 0")
        if self.piecewise_cuda_graph_max_tokens is not None and (
            self.piecewise_cuda_graph_max_tokens < 0
        ):
            raise bad("piecewise_cuda_graph_max_tokens", "must be >= 0")
        if self.mixed_cuda_graph_max_tokens is not None and self.mixed_cuda_graph_max_tokens < 0:
            raise bad("mixed_cuda_graph_max_tokens", "must be >= 0")
        if self.kv_bound_step_tokens < 0:
            raise bad("kv_bound_step_tokens", "must be >= 0 (0: no cap)")
        if self.prefill_ahead_tokens < 0:
            raise bad("prefill_ahead_tokens", "must be >= 0 (0: off)")
        if self.prefill_ahead_tokens and (self.disable_prefix_cache or self.host_cache_gb <= 0):
            raise bad("prefill_ahead_tokens", "parks prompts in the prefix cache's host tier: "
                      "it needs the prefix cache and --host-cache-gb > 0")  # fmt: skip
        if self.max_model_len is not None and self.max_model_len < 1:
            raise bad("max_model_len", "must be >= 1")
        cap = self.moe_decode_max_tokens_per_rank
        if cap is not None and cap < 0:
            raise bad("moe_decode_max_tokens_per_rank", "must be >= 0 (0: no decode workspace)")
        self._check_speculative(bad)
        self._check_parallel(bad)
        self._check_disaggregation(bad)
        self._check_device()

    def _check_speculative(self, bad) -> None:
        algo = self.speculative_algorithm  # its choices are checked with FLAGS
        if algo != "dflash" and self.speculative_draft_model:
            raise bad("speculative_draft_model", "is for --speculative-algorithm dflash")
        k = self.speculative_num_draft_tokens
        if k is not None and (k < 1 or algo is None):
            why = "must be >= 1" if k < 1 else "needs --speculative-algorithm"
            raise bad("speculative_num_draft_tokens", why)
        if self.speculative_ngram_min < 1:
            raise bad("speculative_ngram_min", "must be >= 1")
        if self.speculative_ngram_max < self.speculative_ngram_min:
            raise bad("speculative_ngram_max", "must be >= --speculative-ngram-min")

    def _check_parallel(self, bad) -> None:
        """Tensor-, data- and expert-parallel flags, and what does not run with TP > 1 yet:
        refused here, before any process starts."""
        tp = self.tensor_parallel_size
        if tp < 1:
            raise bad("tensor_parallel_size", "must be >= 1")
        if self.data_parallel_size < 1:
            raise bad("data_parallel_size", "must be >= 1")
        self._check_nodes(bad)
        self._check_data_parallel(bad)
        if tp == 1:
            return
        # Speculation: verify chunks are forwards like any other on every rank, drafts and
        # acceptance on rank 0. n-gram drafts on rank 0 alone; DFlash's drafter is sharded like
        # the target and every drafter forward runs on every rank (distributed/dflash_tp.py;
        # tests/unit/test_tensor_parallel.py, test_dflash_tp.py), inside expert-parallel ranks
        # too (_check_expert_parallel). Host and disk
        # tiers: rank 0 decides, every rank moves its shard (memory/host_cache.py,
        # tests/unit/test_tp_host_cache.py); inside expert-parallel ranks no test covers them yet.
        ep = self.enable_expert_parallel
        unsupported = [
            ("host_cache_gb", ep and self.host_cache_gb > 0, " and --enable-expert-parallel"),
            ("disk_cache_dir", ep and self.disk_cache_dir is not None,
             " and --enable-expert-parallel"),
        ]  # fmt: skip
        for name, on, also in unsupported:
            if on:
                raise bad(name, f"is not supported with --tensor-parallel-size {tp}{also} yet")

    def _check_nodes(self, bad) -> None:
        """--nnodes N: the ranks spread evenly over N machines. What spans them: with
        --data-parallel-size D above 1 the D data-parallel ranks (replicas, or expert-parallel
        ranks), D/N on each node, each with its T tensor-parallel processes on its node
        (server/nodes.py); else the tensor-parallel ranks of the one engine."""
        n = self.nnodes
        dp, tp = self.data_parallel_size, self.tensor_parallel_size
        spread, what = (dp, "--data-parallel-size") if dp > 1 else (tp, "--tensor-parallel-size")
        if n < 1 or spread % n:
            raise bad("nnodes", f"must be >= 1 and divide {what} ({spread}): every node runs "
                      "as many of those ranks")
        if not 0 <= self.node_rank < n:
            raise bad("node_rank", f"must be in 0..{n - 1} (--nnodes {n})")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise bad("dist_init_addr", "must be HOST:PORT")
        elif n > 1:
            raise bad("nnodes", "needs --dist-init-addr HOST:PORT (node 0's address)")

    def _check_data_parallel(self, bad) -> None:
        """--data-parallel-size D: D full replicas, each a tensor-parallel group of T ranks
        (replica i on cuda:i*T .. cuda:i*T+T-1), or with --enable-expert-parallel D ranks of T
        sharing the MoE experts. Whether the model has experts, and whether D x T divides
        them, is checked once it is known (distributed/expert_shards.check_expert_parallel)."""
        dp = self.data_parallel_size
        if self.enable_expert_parallel:
            self._check_expert_parallel(bad)
        if dp > 1 and self.device.startswith("cuda:"):
            raise bad(
                "data_parallel_size",
                f"with --device {self.device}: replica i uses cuda:i (x --tensor-parallel-size);"
                " give --device cuda (CUDA_VISIBLE_DEVICES picks the GPUs)",
            )

    def _check_expert_parallel(self, bad) -> None:
        dp = self.data_parallel_size
        if dp < 2:
            raise bad("enable_expert_parallel", "needs --data-parallel-size >= 2 (the ranks the "
                      "experts are spread over)")
        # -tp T: attention tensor-parallel inside each data-parallel rank, the experts over all
        # D x T processes (distributed/ep_tp.py); whether D x T divides the experts is checked
        # with the model. With --nnodes the T processes of a rank stay on its node (their
        # rendezvous is local) and the expert-parallel groups of each tensor-parallel index span
        # the nodes through node 0's store.
        # Speculation runs per rank, n-gram and DFlash alike: each rank drafts for its own
        # requests and its verify forwards join the MoE exchange like any forward (an idle rank
        # joins with its idle forward); the drafter is dense and per rank, with no collective of
        # the expert-parallel group, so a rank drafting while another does not waits in nothing
        # but the next step's agreement. DFlash's context K/V come from the target's kept
        # outputs of the rank's own forward, which are its own tokens' rows on either MoE path
        # (the combine hands a rank its rows only). With -tp inside the ranks, rank 0 of each
        # drafts and accepts, and its workers forward the verify chunks and run the DFlash
        # drafter's shard and context stores when told (dflash_tp.py); every process sizes the
        # decode workspace for K + 1 tokens a request from the same K (speculation.py
        # num_draft_tokens; ep_tp.attach_worker). Tests: test_expert_parallel_spec.py,
        # test_dp_tp_expert_parallel_spec.py (n-gram), test_dflash_ep.py (DFlash).

    def _check_disaggregation(self, bad) -> None:
        """A PD instance: what does not run inside a pair yet is refused before loading."""
        if not self.disaggregation_timeout > 0:
            raise bad("disaggregation_timeout", "must be > 0")
        mode = self.disaggregation_mode
        if mode is None:
            return
        unsupported = [
            ("speculative_algorithm", self.speculative_algorithm is not None),
            ("tensor_parallel_size", self.tensor_parallel_size > 1),
            ("data_parallel_size", self.data_parallel_size > 1),
        ]
        for name, on in unsupported:
            if on:
                raise bad(name, f"is not supported inside a prefill/decode pair "
                          f"(--disaggregation-mode {mode}) yet")

    def _check_device(self) -> None:
        """--device names a device this torch can use: a ValueError now, not a traceback
        after the weights load."""
        if self.device == "auto":
            return
        try:
            dev = torch.device(self.device)
        except RuntimeError:
            raise ValueError(
                f"invalid --device {self.device!r}: must be auto, cpu, cuda or cuda:N"
            ) from None
        if dev.type != "cuda":
            return
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {self.device}: no CUDA device is available to this torch "
                f"({torch.__version__}); use --device cpu"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"--device {self.device}: this machine has {count} CUDA device(s), "
                f"cuda:0..cuda:{count - 1}"
            )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def with_device_defaults(self, device: torch.device, server: bool = False) -> EngineConfig:
        """This config with the flags whose default depends on the device filled in. As vLLM
        does, a GPU of >= 70 GiB runs up to 1,024 sequences and a step of 16,384 tokens
        offline (8,192 in the server, where a long prompt's step stalls every stream): more
        requests per step amortise the weights, and a bigger budget keeps prefill chunks big
        beside hundreds of decodes (benchmarks/RESULTS.md: 9,648 -> 12,235 -> 14,305 output
        tok/s offline on an H200). Other devices: 256 and 2,048."""
        big = device.type == "cuda" and (
            torch.cuda.get_device_properties(device).total_memory >= BIG_GPU_BYTES
        )
        seqs, tokens = (1024, 8192 if server else 16384) if big else (256, 2048)
        seqs = self.max_num_seqs or seqs
        # Decode batches up to 512 as CUDA graphs on a big GPU: hundreds of requests decode
        # at once there, and a decode step above the largest graph runs piecewise (attention
        # launched from Python per layer): 10,259 -> 11,094 output tok/s offline on an H200
        # with graphs to 512 instead of 128 (benchmarks/RESULTS.md, 2026-12-02).
        graphs = min(seqs, GRAPH_MAX_BS_BIG) if big else GRAPH_MAX_BS
        return dataclasses.replace(
            self,
            max_num_seqs=seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or tokens,
            cuda_graph_max_bs=graphs if self.cuda_graph_max_bs is None else self.cuda_graph_max_bs,
        )

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def backend_name(self) -> str:
        if self.attention_backend:
            return self.attention_backend
        if self.torch_device().type == "cuda":
            return "triton"
        # the eager reference keeps the plain torch backend
        return "torch" if self.disable_fused_ops else "cpu"


# ---- --help: one line per flag, its group and choices -------------------------------------

# Argument groups, in --help order (`serve` adds "server" after them).
GROUPS = (
    "model", "memory", "scheduling", "GPU", "cache", "speculative decoding", "distributed",
    "disaggregation",
)


class FlagInfo(NamedTuple):
    group: str  # one of GROUPS
    help: str  # one line, no trailing period
    choices: tuple[str, ...] | None = None  # checked by EngineConfig (None also ok if default)
    default: str | None = None  # how --help shows the default, when the value says too little
    alias: str | None = None  # a short flag besides --the-field-name (`-tp`)


FLAGS: dict[str, FlagInfo] = {
    # model
    "model": FlagInfo(
        "model",
        "a built-in alias (smollm2-135m-instruct, gemma-3-270m), a "
        ".gguf file, a Hugging Face folder with config.json, or a Hub id (owner/name)",
    ),
    "tokenizer": FlagInfo("model", "tokenizer folder, when not the model's", default="the model's"),
    "dtype": FlagInfo(
        "model",
        "weight and activation dtype",
        ("auto", "float32", "bfloat16", "float16"),
        default="auto: bfloat16 on CUDA, else float32",
    ),
    "load_format": FlagInfo(
        "model",
        "auto: the checkpoint's weights; dummy: random weights in "
        "the real shapes, no checkpoint needed",
        ("auto", "dummy"),
    ),
    "max_model_len": FlagInfo(
        "model",
        "context length in tokens (prompt + output)",
        default="the model's, capped to what the KV pool holds",
    ),
    "quantization": FlagInfo(
        "model",
        "fp8: the decoder layers' projections quantised at load to float8 e4m3 (a scale per "
        "output channel), inputs per token, FP8 GEMMs; half the weight memory (CUDA sm89+ with "
        "bfloat16, or CPU). Embeddings, head, attention and MoE experts keep --dtype. An FP8 "
        "checkpoint (quant_method fp8 or compressed-tensors) sets it by itself; naming another "
        "method than the checkpoint's is an error",
        ("fp8", "compressed-tensors"),
        default="the checkpoint's (config.json quantization_config), else none: --dtype",
    ),
    "chat_template": FlagInfo(
        "model", "Jinja chat template: a file, or the template text", default="the tokenizer's"
    ),
    "seed": FlagInfo("model", "sampling seed of requests that give none, so runs repeat"),
    "max_logprobs": FlagInfo("model", "most logprobs / prompt_logprobs a request may ask for"),
    "generation_config": FlagInfo(
        "model",
        "sampling defaults of requests that leave them out (temperature, top_p, top_k, min_p, "
        "repetition_penalty; max_new_tokens caps max_tokens): auto, the model's "
        "generation_config.json; vllm or none, the API's; or a folder holding one",
    ),
    "override_generation_config": FlagInfo(
        "model",
        "JSON object of sampling defaults set over --generation-config's, e.g. "
        "'{\"temperature\": 0.5}'",
        default="none",
    ),
    # memory
    "page_size": FlagInfo("memory", "tokens per KV page", alias="--block-size"),
    "kv_cache_gb": FlagInfo(
        "memory",
        "KV pool size in GiB, per tensor-parallel rank (each holds its share of the KV heads)",
        default="CUDA: what --gpu-memory-utilization leaves; CPU: 2",
    ),
    "gpu_memory_utilization": FlagInfo(
        "memory",
        "fraction of GPU memory for weights, activations and the KV pool, unless --kv-cache-gb",
    ),
    "kv_cache_dtype": FlagInfo(
        "memory",
        "KV element type: auto (the model's dtype) or fp8_e4m3, half the bytes (fp8: the "
        "same, vLLM's name)",
        ("auto", "fp8_e4m3", "fp8"),
    ),
    "kv_cache_scale": FlagInfo(
        "memory", "fp8_e4m3 KV: one scale for every layer", default="calibrated at start"
    ),
    "disable_hybrid_kv_cache": FlagInfo(
        "memory",
        "full-length KV for every layer, sliding-window ones too: the baseline, same outputs",
    ),
    # scheduling
    "max_num_seqs": FlagInfo(
        "scheduling", "most sequences running at once", default="1024 on a GPU of >= 70 GiB, "
        "else 256"
    ),
    "max_num_batched_tokens": FlagInfo(
        "scheduling", "token budget of one step (prefill chunks and decodes)",
        default="on a GPU of >= 70 GiB 16384 offline, 8192 served; else 2048",
    ),
    "max_queue": FlagInfo(
        "scheduling", "server: most sequences waiting beyond --max-num-seqs; more get a 503"
    ),
    "schedule_conservativeness": FlagInfo(
        "scheduling",
        "share of running requests' expected output kept free at admission: 0 admits eagerly "
        "and preempts (recompute) when short, 1 avoids most preemptions",
    ),
    "kv_bound_step_tokens": FlagInfo(
        "scheduling",
        "when the KV pool holds fewer requests than this and more wait, a step with decodes "
        "carries prefill chunks up to this many tokens in all (stall-free batching: the small "
        "decode batch reads the weights anyway; ~192 is a bf16 GEMM's turn from reading to "
        "computing on an H200); 0: off",
    ),
    "prefill_ahead_tokens": FlagInfo(
        "scheduling",
        "while the KV pool is full of decodes and prompts wait, prefill one of them at a time "
        "beside the decodes (chunks of at most this many tokens less the step's decodes) and "
        "park its K/V in the host tier until it has room to decode; needs --host-cache-gb; 0: "
        "off",
    ),
    "scheduling_policy": FlagInfo(
        "scheduling",
        "fcfs: first come, first served; priority: requests' priority (lower first), then "
        "arrival, orders admission and preemption",
        ("fcfs", "priority"),
    ),
    "offline_order": FlagInfo(
        "scheduling",
        "offline generate()/chat(): queue a batch's requests longest max_tokens first (the "
        "batch ends sooner: no long request starts late) or in the order given",
        ("longest_first", "arrival"),
    ),
    "disable_overlap_schedule": FlagInfo(
        "scheduling", "read each step's tokens back before scheduling the next: no CPU/GPU overlap"
    ),
    # GPU
    "device": FlagInfo("GPU", "auto, cpu, cuda or cuda:N", default="auto: cuda when available"),
    "attention_backend": FlagInfo(
        "GPU", "attention kernels", ("cpu", "torch", "triton"),
        default="triton on CUDA; else cpu (torch with --disable-fused-ops)",
    ),
    "cuda_graph_max_bs": FlagInfo(
        "GPU", "largest decode batch run as a CUDA graph; 0: no CUDA graphs at all",
        default="512 on a GPU of >= 70 GiB (at most --max-num-seqs), else 128",
    ),
    "piecewise_cuda_graph_max_tokens": FlagInfo(
        "GPU",
        "largest step (tokens) run as piecewise CUDA graphs (all but attention); 0: eager",
        default="min(--max-num-batched-tokens, 2048)",
    ),
    "mixed_cuda_graph_max_tokens": FlagInfo(
        "GPU",
        "largest step (tokens) mixing decodes and prefill chunks run as one CUDA graph, "
        "attention included; 0: none (piecewise graphs take those steps)",
        default="min(--max-num-batched-tokens, 256)",
    ),
    "disable_fused_ops": FlagInfo(
        "GPU", "eager torch RMSNorm, rotary and activations instead of the Triton kernels; "
        "on CPU, dense float32 weights instead of oneDNN-packed ones"
    ),
    # cache
    "disable_prefix_cache": FlagInfo("cache", "no prefix cache: no KV reuse across requests"),
    "host_cache_gb": FlagInfo(
        "cache", "host-memory tier of the prefix cache in GiB, per tensor-parallel rank (each "
        "holds its shard of the KV heads); 0: none"
    ),
    "host_cache_policy": FlagInfo(
        "cache",
        "write_back: pages go to the host tier when evicted; write_through: once cached",
        ("write_back", "write_through"),
    ),
    "disk_cache_dir": FlagInfo(
        "cache", "folder of a disk tier of the prefix cache (with -tp T, each rank's file in its "
        "subfolder tpT-rankR)", default="no disk tier"
    ),
    "disk_cache_gb": FlagInfo(
        "cache", "disk tier size in GiB, per tensor-parallel rank",
        default="min(16, half the folder's free space)"
    ),
    # speculative decoding
    "speculative_algorithm": FlagInfo(
        "speculative decoding",
        "ngram: drafts from the request's own tokens; dflash: a draft model",
        ("ngram", "dflash"),
        default="off",
    ),
    "speculative_draft_model": FlagInfo(
        "speculative decoding", "dflash: the draft model's folder", default="none"
    ),
    "speculative_num_draft_tokens": FlagInfo(
        "speculative decoding",
        "draft tokens per verify step",
        default="ngram: 4; dflash: its block_size - 1",
    ),
    "speculative_ngram_min": FlagInfo(
        "speculative decoding", "ngram: shortest suffix of the request's tokens to look up"
    ),
    "speculative_ngram_max": FlagInfo("speculative decoding", "ngram: longest suffix, tried first"),
    "disable_adaptive_speculation": FlagInfo(
        "speculative decoding",
        "draft at every decode step; by default the engine measures, per batch size, whether "
        "drafting commits more tokens per second than plain decoding and drafts only where it "
        "does (greedy and unseeded requests; seeded sampling requests always draft)",
    ),
    # distributed
    "tensor_parallel_size": FlagInfo(
        "distributed",
        "ranks that split every layer's heads, MLP and vocabulary (one process and one GPU "
        "each; gloo on CPU)",
        alias="-tp",
    ),
    "nnodes": FlagInfo(
        "distributed",
        "machines the ranks span: with -dp D the D data-parallel ranks (replicas, or "
        "expert-parallel ranks), D/N each, each rank's -tp processes on its node; else the "
        "tensor-parallel ranks",
    ),
    "node_rank": FlagInfo(
        "distributed", "this machine's index; node 0 runs HTTP and its ranks, the others only "
        "their ranks (with -dp their engine cores, else tensor-parallel workers)"
    ),
    "dist_init_addr": FlagInfo(
        "distributed",
        "HOST:PORT where the ranks meet (node 0's address)",
        default="a free local port, one machine",
    ),
    "data_parallel_size": FlagInfo(
        "distributed",
        "engine-core replicas behind one HTTP server (or one offline Engine), each with its own "
        "scheduler and KV pool and --tensor-parallel-size ranks (replica i on cuda:i*T.."
        "i*T+T-1); requests go by prefix affinity and load",
        alias="-dp",
    ),
    "enable_expert_parallel": FlagInfo(
        "distributed", "MoE models: spread every layer's experts over the --data-parallel-size "
        "x --tensor-parallel-size processes (attention stays data-parallel, split over -tp "
        "inside each rank; tokens reach the experts by collectives)"
    ),
    "moe_decode_max_tokens_per_rank": FlagInfo(
        "distributed",
        "expert parallelism: most decode/verify tokens on a rank's step; steps where every "
        "rank decodes exchange fixed-shape buffers of this many rows per rank; 0: none",
        default="min(--max-num-batched-tokens, --max-num-seqs x (1 + draft tokens))",
    ),
    # disaggregation
    "disaggregation_mode": FlagInfo(
        "disaggregation",
        "serve: this instance's role in a prefill/decode pair behind `swaserve router`",
        ("prefill", "decode"),
        default="off: prefill and decode here",
    ),
    "disaggregation_transfer_backend": FlagInfo(
        "disaggregation",
        "how KV pages move between the pair: nixl (UCX: DRAM on CPU, VRAM on GPU) or local "
        "(processes of one host, CPU)",
        ("nixl", "local"),
    ),
    "disaggregation_timeout": FlagInfo(
        "disaggregation", "seconds one side of a pair waits for the other before failing"
    ),
}

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def _one_of(choices: tuple[str, ...]) -> str:
    """`a, b or c`."""
    return choices[0] if len(choices) == 1 else ", ".join(choices[:-1]) + " or " + choices[-1]
