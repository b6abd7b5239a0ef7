"""The offline `Engine`: tokenizer + output processor + an in-process `EngineCore`."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from swaserve.config import EngineConfig
from swaserve.engine.core import EngineCore
from swaserve.engine.gc_heap import release_heap
from swaserve.engine.limits import truncate_prompt
from swaserve.engine.output_processor import OutputProcessor
from swaserve.outputs import RequestOutput
from swaserve.sampling.bad_words import resolve_bad_words
from swaserve.sampling.generation_defaults import generation_defaults, sampling_fields
from swaserve.sampling.params import SamplingParams

log = logging.getLogger(__name__)
# Engines of this process not shut down yet (dropped ones leave by themselves). torch's cuBLAS
# workspaces are shared: a live engine's CUDA graphs replay GEMMs that use the workspace of the
# stream they were captured on, so a shutdown frees them only when no other engine lives.
_LIVE: weakref.WeakSet = weakref.WeakSet()


def resolve_folder(model: str) -> Path:
    """A model name or path -> a Hugging Face folder (built-in alias, shipped config, GGUF
    file converted once, or a folder)."""
    from swaserve.weights.loader import SHIPPED_CONFIGS, shipped_config_names

    if model in shipped_config_names():
        return SHIPPED_CONFIGS / model
    from swaserve.weights.builtin import resolve_model  # imports gguf: only when needed

    return resolve_model(model)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # one of them: a tokenizer
# what else transformers may read into one: a change to any of them loads it again
TOKENIZER_EXTRAS = ("chat_template.jinja", "chat_template.json", "special_tokens_map.json",
                    "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt")


def load_tokenizer(folder: Path, name: str | None = None) -> Any | None:
    """The folder's tokenizer, or None when it has none (dummy shapes): then only token ids.

    Loaded once per process and folder state: every Engine of a folder shares one tokenizer
    object (treat it as read-only). transformers takes ~6.5 s for Gemma 3's 262k-token
    vocabulary on a 2-core machine (two-thirds of building its Engine), and a copy of the
    loaded one ~3 s."""
    src = Path(name) if name else folder
    if not any((src / f).exists() for f in TOKENIZER_FILES):
        return None
    stamp = tuple(
        (f, st.st_mtime_ns, st.st_size)
        for f in TOKENIZER_FILES + TOKENIZER_EXTRAS
        if (st := _stat(src / f)) is not None
    )
    return _load_tokenizer(str(src.resolve()), stamp)


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


@functools.lru_cache(maxsize=4)
def _load_tokenizer(src: str, stamp: tuple) -> Any:
    """`stamp` (the tokenizer files' names, times and sizes) is the cache key beside the
    path: a folder whose files changed, or gained or lost one, loads again."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(src)


def child_params(params: SamplingParams, i: int) -> SamplingParams:
    """Sequence i of a request with n > 1: its own core request, seed + i when seeded."""
    seed = None if params.seed is None else params.seed + i
    return dataclasses.replace(params, n=1, seed=seed)


def _children(params: SamplingParams) -> list[SamplingParams]:
    """The n samples' params (ValueError, e.g. a seed + i past 2**64, before any is added)."""
    return [child_params(params, i) for i in range(params.n)]


class _ShutDown:
    """What `Engine.core` becomes after `Engine.shutdown()`: any use names the cause."""

    def __init__(self, model: str) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"this Engine ({self._model}) was shut down; start a new one")


class Engine:
    """`Engine(model="gemma-3-270m", device="cpu")`; keyword arguments are EngineConfig fields
    (the CLI flags with underscores). `shutdown()` (or a `with` block) frees its memory now;
    a dropped engine frees it by reference counting."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(EngineConfig.field_names())
        if unknown:
            raise TypeError(f"unknown Engine arguments: {sorted(unknown)}")
        self.config = EngineConfig(model=model or EngineConfig.model, **kwargs)
        self.folder = resolve_folder(self.config.model)
        if self.config.load_format != "dummy" and not any(self.folder.glob("*.safetensors")):
            raise ValueError(
                f"{self.config.model} has no weights (no *.safetensors in {self.folder}); "
                "for random weights in its shapes use --load-format dummy"
            )
        dp, nodes = self.config.data_parallel_size, self.config.nnodes
        if dp > 1 and nodes > 1:  # the offline ranks and replicas are this machine's
            raise ValueError(
                f"--nnodes {nodes} with --data-parallel-size {dp} is for `swaserve serve` (the "
                "offline Engine runs its data-parallel ranks on one machine)"
            )
        if self.config.enable_expert_parallel:  # D engine cores, one per process, in lockstep
            from swaserve.distributed.ep_engine import DPExpertCore

            self.core: Any = DPExpertCore(self.config, self.folder)
        elif self.config.data_parallel_size > 1:  # D replicas here, each with its T ranks
            from swaserve.engine.replicas import DPReplicas

            self.core = DPReplicas(self.config, self.folder)
        else:
            self.core = EngineCore(self.config, self.folder)
        self.tokenizer = load_tokenizer(self.folder, self.config.tokenizer)
        self.processor = OutputProcessor(self.tokenizer)
        _LIVE.add(self)
        self.generation_defaults = generation_defaults(
            self.folder, self.config.generation_config, self.config.override_generation_config
        )
        self._ids = itertools.count()

    # ---- public API -----------------------------------------------------------------------

    def generate(
        self,
        prompts: str | list[str] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        prompt_token_ids: list[list[int]] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        if prompts is None and prompt_token_ids is None:
            raise ValueError("give prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts is not None:
            texts: list[str | None] = list(prompts)
            ids = [self._encode(p) for p in prompts]
        else:
            ids = [list(p) for p in prompt_token_ids]
            texts = [None] * len(ids)
        params = self._params_list(sampling_params, len(ids))
        return self._run(self._add_batch(texts, ids, params), use_tqdm)

    def chat(
        self,
        conversations: list[list[dict]] | list[dict],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool | None = None,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Chat completions of each conversation; `tools` (OpenAI's function tools) go to the
        chat template, as `apply_chat_template` says. The answers are text: calls in them are
        for the caller to read (`swaserve.server.tool_parsers`), as with vLLM's LLM.chat.
        `continue_final_message`: each answer continues its conversation's last message (an
        assistant prefill) instead of opening a new turn; needs add_generation_prompt=False."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [
            self.apply_chat_template(c, chat_template, add_generation_prompt, tools=tools,
                                     continue_final_message=continue_final_message)
            for c in conversations
        ]
        # The template already holds the special tokens: encode without adding BOS again.
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        params = self._params_list(sampling_params, len(ids))
        return self._run(self._add_batch(prompts, ids, params), use_tqdm)

    def chat_stream(
        self,
        messages: list[dict],
        sampling_params: SamplingParams | None = None,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
    ) -> Iterator[str]:
        """One conversation's answer as it is generated: the text of each step's new tokens
        (text a stop string may begin is held back until it is known). Closing the iterator
        early (a `break`, Ctrl-C) aborts the request. One sample: n must be 1."""
        params = resolve_bad_words(sampling_params or self.default_sampling_params(),
                                   self.tokenizer)
        if params.n != 1:
            raise ValueError("chat_stream takes n = 1")
        prompt = self.apply_chat_template(messages, chat_template, tools=tools)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        kept = self._truncated(ids, params)
        self.core.resolve_max_tokens(len(kept), params)  # a bad request fails before it is added
        rid = self._add(prompt, kept, params, stream=True)
        finished = False
        try:
            while not finished:
                for out in self._step():
                    finished = finished or out.finished
                    if out.outputs and out.outputs[0].text:
                        yield out.outputs[0].text
                if not finished and not self.core.has_unfinished():
                    raise RuntimeError("engine stopped with the request unfinished")
        finally:
            if not finished:
                self.core.abort_requests(self.processor.abort_request(rid))
            self._settle()

    def apply_chat_template(
        self,
        messages: list[dict],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text of `messages`. With `tools`, as the server renders a chat request's
        tools (server/tools.py): through the template, or, for a template that never reads
        them, in a system message (with the call format the template's own tool format
        implies, if it implies one)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False: the "
                             "answer either continues the last message or opens a new turn")
        tok = self._need_tokenizer()
        template = chat_template or self.config.chat_template
        if template and Path(template).is_file():
            template = Path(template).read_text()
        if not template and not tok.chat_template:
            raise ValueError(
                f"model {self.config.model} has no chat template; pass chat_template "
                "(--chat-template FILE)"
            )
        plan = None
        if tools:
            from swaserve.server.tools import messages_for_template, plan_tools, resolve_parser

            source = template or tok.chat_template
            parser = resolve_parser(None, source)
            plan = plan_tools(tools, "auto" if parser else "none", None, parser)
            messages = messages_for_template([dict(m) for m in messages], plan, source)
        return tok.apply_chat_template(
            messages, chat_template=template, tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=plan.tools if plan is not None else None,
        )

    def memory_stats(self) -> dict:
        return self.core.memory_stats()

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (vLLM's LLM.get_tokenizer)."""
        return self._need_tokenizer()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, device pages and host/disk tiers (vLLM's
        LLM.reset_prefix_cache), e.g. between benchmark runs of the same prompts. False, and
        nothing dropped, while a request is unfinished (a `chat_stream` being read)."""
        reset = getattr(self.core, "reset_prefix_cache", None)
        if reset is None:
            raise NotImplementedError("reset_prefix_cache is not available with expert "
                                      "parallelism")  # fmt: skip
        return reset()

    def shutdown(self) -> None:
        """Stop the engine and give its memory back now: tensor-parallel and expert-parallel
        workers stop, and the KV pool, graphs and weights are freed (on a GPU, returned to the
        device) even if something among them were held in a reference cycle, which `del`
        alone would keep: engine starts freeze the collector's heap (gc_heap.py). Later calls
        on this engine raise; a second shutdown does nothing."""
        core = self.core
        if isinstance(core, _ShutDown):
            return
        self.core = _ShutDown(self.config.model)
        _LIVE.discard(self)
        core.shutdown()
        del core
        release_heap("engine shutdown")
        import torch

        if torch.cuda.is_initialized():
            if not _LIVE:
                # torch's per-stream cuBLAS workspaces: every graph capture's side stream left
                # one; another live engine's graphs still use theirs (_LIVE)
                torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- internals ------------------------------------------------------------------------

    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError(f"model {self.config.model} has no tokenizer; pass token ids")
        return self.tokenizer

    def _encode(self, text: str) -> list[int]:
        if not isinstance(text, str) or not text:
            raise ValueError("the prompt is empty")
        return self._need_tokenizer().encode(text)

    def default_sampling_params(self) -> SamplingParams:
        """What generate/chat use without sampling_params: the model's generation_config
        defaults (sampling/generation_defaults.py; vLLM's `get_default_sampling_params`)."""
        return SamplingParams(**sampling_fields(self.generation_defaults))

    def _params_list(self, sp: SamplingParams | list | None, n: int) -> list[SamplingParams]:
        if sp is None:
            return [self.default_sampling_params()] * n
        if isinstance(sp, SamplingParams):
            return [resolve_bad_words(sp, self.tokenizer)] * n
        if len(sp) != n:
            raise ValueError(f"{len(sp)} sampling_params for {n} prompts")
        return [resolve_bad_words(p, self.tokenizer) for p in sp]

    def _add_batch(
        self, texts: list, ids: list[list[int]], params: list[SamplingParams]
    ) -> list[str]:
        """Queue a batch; returns its request ids in the order given.

        Validates everything before adding anything: a bad prompt fails alone and early.
        With `offline_order` longest_first the requests queue by max_tokens, longest first
        (stable: equal ones keep their order). A batch returns when its last request ends,
        and when more requests wait than fit, the order given can start a long one late and
        leave it decoding alone at the end, a step's weights read for one row (SGLang's
        `lof` policy; the classic longest-processing-time-first rule for a makespan)."""
        ids = [self._truncated(t, p) for t, p in zip(ids, params)]
        max_tokens = [self.core.resolve_max_tokens(len(t), p) for t, p in zip(ids, params)]
        children = [_children(p) for p in params]  # seed + i past 2**64 fails here
        order = list(range(len(ids)))
        if self.config.offline_order == "longest_first":
            order.sort(key=lambda i: -max_tokens[i])
        rids: list[str] = [""] * len(ids)
        for i in order:
            rids[i] = self._add(texts[i], ids[i], params[i], children=children[i])
        return rids

    def _truncated(self, ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt as `truncate_prompt_tokens` keeps it (the same list when whole)."""
        return truncate_prompt(ids, params, self.core.max_model_len)

    def _add(
        self, text: str | None, ids: list[int], params: SamplingParams, stream: bool = False,
        children: list[SamplingParams] | None = None,
    ) -> str:
        """Adds a request (its n samples as core requests); `stream`: its outputs are deltas,
        else only the finished one comes out. Every sample's params are built (validated)
        before anything is added."""
        children = children if children is not None else _children(params)
        rid = str(next(self._ids))
        core_ids = [f"{rid}-{i}" for i in range(params.n)]
        self.processor.add_request(rid, text, ids, params, core_ids, stream=stream,
                                   final_only=not stream)  # fmt: skip
        for cid, child in zip(core_ids, children):
            self.core.add_request(cid, ids, child)
        return rid

    def _run(self, rids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm or (use_tqdm is None and len(rids) > 1):
            from tqdm import tqdm

            bar = tqdm(total=len(rids), desc="generate", unit="req", leave=False)
        try:
            while len(done) < len(rids):
                for out in self._step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if not self.core.has_unfinished() and len(done) < len(rids):
                    raise RuntimeError("engine stopped with requests unfinished")
            self._settle()
        finally:
            if bar is not None:
                bar.close()
        return [done[r] for r in rids]

    def _step(self) -> list[RequestOutput]:
        """One core step through the output processor; a stop string's samples are aborted."""
        outs, to_abort = self.processor.process(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort)
        return outs

    def _settle(self) -> None:
        """The overlap's last step, when one is in flight and nothing else runs: it holds only
        finished (or aborted) requests, whose outputs are dropped."""
        if self.core.has_in_flight() and not self.core.scheduler.has_unfinished():
            self.core.step()
