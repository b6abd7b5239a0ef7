"""Test helpers shared by several test files (no fixtures here: see conftest.py)."""

from __future__ import annotations

import torch


def engine_prompt_logits(engine, prompt_ids: list[int]) -> torch.Tensor:
    """Per-position logits of one prompt computed through the engine's real path (scheduler,
    chunked prefill, paged KV, window retirement): the runner's hidden states of every step are
    recorded and projected by the model's own head."""
    core = engine.core
    assert not core.has_unfinished()
    captured: list[torch.Tensor] = []
    forward = core.runner.forward

    def record(fb):
        h = forward(fb)
        captured.append(h.clone())  # on CUDA a static graph buffer, overwritten next step
        return h

    core.runner.forward = record
    try:
        from swaserve import SamplingParams

        # prompt_logprobs makes the request compute every position (it skips the prefix
        # cache), so the recorded hidden states cover the whole prompt even on a warm engine.
        engine.generate(prompt_token_ids=[prompt_ids], sampling_params=SamplingParams(
            max_tokens=1, temperature=0, prompt_logprobs=0))
    finally:
        core.runner.forward = forward
    hidden = torch.cat(captured)[: len(prompt_ids)]
    return core.runner.logits(hidden)


def random_prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    """Seeded random token-id prompts of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def assert_same_outputs(a, b, tol: float = 1e-4) -> None:
    """Two engines' RequestOutputs: the same tokens; chosen and top logprobs within `tol`."""
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert abs(lx.logprob - ly.logprob) < tol, (lx, ly)
            assert max(abs(p - q) for (_, p), (_, q) in zip(lx.top, ly.top)) < tol


def assert_logits_match_hf(engine, ref, vocab: int = 128, tol: float = 1e-3) -> None:
    """A 40-token prompt's per-position logits through `engine` equal the transformers model
    `ref`'s within `tol`; afterwards the pool checks out and no page is held by a request."""
    ids = random_prompts(vocab, [40])[0]
    got = engine_prompt_logits(engine, ids)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    err = (got - want).abs().max().item()
    assert err < tol, f"max |logit diff| {err}"
    engine.core.memory.check_integrity()
    idle = engine.memory_stats()
    assert idle["pages_free"] + idle["cache_pages"] == idle["pages_total"]
    assert idle["pages_held_by_requests"] == 0


def assert_greedy_equals_hf_generate(engine, ref, prompts: list[list[int]], max_tokens: int = 6,
                                     label: str = "") -> None:  # fmt: skip
    """Greedy tokens of `engine` (EOS ignored) for `prompts`, in one batch, equal transformers'
    `generate` of `ref` one prompt at a time: an explicit attention mask (token 0 in a prompt is
    not padding) and no eos (as the engine's ignore_eos; min_new_tokens would instead forbid
    the eos token, which a greedy path may take)."""
    from swaserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    for ids, out in zip(prompts, outs, strict=True):
        x = torch.tensor([ids])
        with torch.no_grad():
            want = ref.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                do_sample=False, pad_token_id=0, eos_token_id=None,
            )[0, len(ids):].tolist()  # fmt: skip
        assert len(want) == max_tokens
        assert out.token_ids == want, label


def logits_and_greedy(engine, ids: list[int], max_tokens: int = 6,
                      prefix: int = 9) -> tuple[torch.Tensor, list[int]]:  # fmt: skip
    """Every position's logits of prompt `ids`, and the greedy tokens (EOS ignored) after its
    first `prefix` ids: what the fused-ops tests compare before and after fusing."""
    from swaserve import SamplingParams

    logits = engine_prompt_logits(engine, ids)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    out = engine.generate(prompt_token_ids=[ids[:prefix]], sampling_params=greedy)
    return logits, out[0].outputs[0].token_ids


def assert_tp2_equals_tp1(engine_kwargs: dict, vocab: int = 128, max_tokens: int = 8,
                          check=None) -> None:  # fmt: skip
    """TP = 2 (gloo, 2 ranks) against one eager rank on the same checkpoint: greedy tokens and
    logprobs of three prompts, and every position's logits of a 40-token prompt; `check(two)`
    runs on the TP engine before it shuts down."""
    from swaserve import Engine, SamplingParams

    one = Engine(disable_fused_ops=True, **engine_kwargs)
    two = Engine(tensor_parallel_size=2, **engine_kwargs)
    try:
        prompts = random_prompts(vocab, [37, 9, 23], seed=5)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                logprobs=3)  # fmt: skip
        assert_same_outputs(
            one.generate(prompt_token_ids=prompts, sampling_params=params),
            two.generate(prompt_token_ids=prompts, sampling_params=params),
        )
        ids = random_prompts(vocab, [40], seed=3)[0]
        want, got = engine_prompt_logits(one, ids), engine_prompt_logits(two, ids)
        assert (got - want).abs().max().item() < 1e-4
        two.core.memory.check_integrity()
        if check is not None:
            check(two)
    finally:
        two.core.shutdown()


class ListPipes:
    """A core loop's pipes (server/core_process.py CorePipes) as lists: `inp.queue` holds the
    encoded messages the loop will read, `out.msgs` the decoded ones it sent."""

    class _Out:
        def __init__(self) -> None:
            self.msgs: list[list] = []

        def send(self, data: bytes) -> None:
            from swaserve.server.ipc import decode

            self.msgs.append(decode(data))

    class _In:
        def __init__(self) -> None:
            self.queue: list[bytes] = []

        def poll(self, timeout_ms: int) -> bool:
            return bool(self.queue)

        def recv(self, flags: int = 0) -> bytes:
            import zmq

            if not self.queue:
                raise zmq.Again()
            return self.queue.pop(0)

    def __init__(self) -> None:
        self.ctx, self.inp, self.out = None, self._In(), self._Out()

    def link_lost(self) -> bool:
        return False


def spawned_children(pid: int) -> list[int]:
    """Processes that `pid` started with multiprocessing's spawn (not its resource tracker)."""
    from pathlib import Path

    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
                out.append(int(entry.name))
    return out


def save_random_hf_models(configs: dict, tmp_path_factory) -> dict:
    """name -> a fresh folder holding `save_random_hf_model` of configs[name]."""
    return {name: folder for name, (folder, _) in
            random_hf_models(configs, tmp_path_factory).items()}  # fmt: skip


def random_hf_models(configs: dict, tmp_path_factory) -> dict:
    """name -> (a fresh folder holding `save_random_hf_model` of configs[name], that model)."""
    out = {}
    for name, cfg in configs.items():
        folder = tmp_path_factory.mktemp(name)
        out[name] = (folder, save_random_hf_model(cfg, folder))
    return out


def save_random_hf_model(cfg, folder):
    """A transformers model of `cfg` with seeded random weights (std 0.2, norms included),
    saved as a Hugging Face folder; returns the model (eager attention, eval mode)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return model.eval()


def tiny_gemma3_config(**overrides):
    """A small Gemma 3 text config for engine tests: two SWA layers (window 24) and one full,
    2 KV heads of 16 dims; `overrides` set what a test measures (layer_types sets the depth)."""
    import transformers

    args = dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, sliding_window=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=16, max_position_embeddings=2048,
    )
    args.update(overrides)
    return transformers.Gemma3TextConfig(num_hidden_layers=len(args["layer_types"]), **args)


def tiny_moe_config(**overrides):
    """A tiny Qwen3-MoE config for expert-parallel tests: 3 layers (the middle one dense), 8
    experts of 32 (top 2), 4 heads of 16, 2 KV heads, 128 tokens; `overrides` change it."""
    import transformers

    args = dict(
        hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
        vocab_size=128, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=3,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=[1],
    )  # fmt: skip
    args.update(overrides)
    return transformers.Qwen3MoeConfig(**args)


def check_integrity_every_step(engine):
    """Wrap `engine.core.step` so the pool's invariants are checked after every step;
    returns the engine."""
    step = engine.core.step

    def checked_step():
        outs = step()
        engine.core.memory.check_integrity()
        return outs

    engine.core.step = checked_step
    return engine


def on_dflash_proposals(proposer, record) -> None:
    """Call record(request, drafts) for each request of every DFlash proposal, whether the
    engine keeps the drafts on the device or reads them back (both paths go through
    `propose_on_device`); the drafts come to the host here, a sync the engine does not make."""
    device = proposer.propose_on_device

    def wrapped(reqs, ks, memory, kv):
        ids = device(reqs, ks, memory, kv)
        for req, k, row in zip(reqs, ks, ids.tolist(), strict=True):
            record(req, row[:k])
        return ids

    proposer.propose_on_device = wrapped


def save_byte_tokenizer(folder) -> int:
    """A byte-level BPE tokenizer with no merges (ids 0-255: the bytes, 256: `<eos>`) saved
    to `folder` beside a tiny model, for tests of what needs a real tokenizer (structured
    outputs) on machines without the built-in models; returns the eos id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    vocab = {ch: i for i, ch in enumerate(chars)}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(folder)
    return vocab["<eos>"]
