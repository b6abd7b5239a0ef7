"""swaserve's DFlash drafter against the reference (`dflash` 0.1.0 on PyPI, z-lab; installed
--no-deps by scripts/setup.sh) on random weights, tiny float32 models:

- a reference checkpoint written by its `save_pretrained` loads 1:1 (`load_dflash_drafter`);
- one forward gives the reference's draft logits (within 1e-4) through the same target head;
- the reference's greedy `dflash_generate` and a swaserve-driven loop (context K/V cached per
  layer, a sliding layer keeping only its window's tail) give the same tokens and the same
  draft logits at every step;

on a Qwen3 target (full drafter layers) and a Gemma 3 target (scaled embeddings, a sliding
drafter layer, output multiplier and softcap); and the config rules and errors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from dflash.model import DFlashDraftModel, _raw_input_embeddings, dflash_generate
from dflash.model import build_target_layer_ids as ref_build_target_layer_ids
from safetensors.torch import load_file, save_file
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen3Config, Qwen3ForCausalLM

from swaserve.speculative.dflash_config import (
    DFlashConfig,
    build_target_layer_ids,
    check_num_draft_tokens,
    dflash_config_from_dict,
    load_dflash_config,
)
from swaserve.speculative.dflash_model import ContextKV, DFlashDrafter, load_dflash_drafter

V, H, MASK = 48, 32, 47
_SHAPE = dict(vocab_size=V, hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _target(kind: str, **shape) -> torch.nn.Module:
    """`shape`: overrides of _SHAPE (vocab_size, num_key_value_heads: test_dflash_tp.py)."""
    torch.manual_seed(0)
    common = dict(
        _SHAPE,
        **shape,
        intermediate_size=64,
        num_hidden_layers=6,
        initializer_range=0.2,
        max_position_embeddings=256,
    )
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        full, slide = "full_attention", "sliding_attention"
        model = Gemma3ForCausalLM(
            Gemma3TextConfig(
                **common,
                sliding_window=6,
                query_pre_attn_scalar=8,
                layer_types=[slide, slide, full] * 2,
            )
        )
    _rig_head(model)
    return model.eval()


def _rig_head(model: torch.nn.Module) -> None:
    """Tokens 1 and 2 win by the sign of the normed hidden state's first dimension, for the
    target and (through the same head) for the drafter: random weights then agree often
    enough that blocks commit several tokens."""
    with torch.no_grad():
        head = model.lm_head.weight
        head[1:3] = 0.0
        head[1, 0], head[2, 0] = 30.0, -30.0


def _drafter_raw(kind: str, target_layer_ids: tuple[int, ...] = (1, 4), **shape) -> dict:
    """The drafter's config.json: full layers and explicit ids for Qwen3; for Gemma 3 a
    sliding layer, the default ids (from num_target_layers) and the scaling fields. `shape`:
    overrides of its fields (another target's sizes: test_dflash_ep.py)."""
    raw = dict(
        _SHAPE,
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        intermediate_size=48,
        num_hidden_layers=2,
        num_target_layers=6,
    )
    raw.update(shape)
    if kind == "qwen3":
        ids = list(target_layer_ids)
        raw["dflash_config"] = {"block_size": 4, "mask_token_id": MASK, "target_layer_ids": ids}
        return raw
    raw.update(
        use_sliding_window=True,
        sliding_window=4,
        output_multiplier=0.5,
        layer_types=["sliding_attention", "full_attention"],
    )
    raw["dflash_config"] = {
        "block_size": 4,
        "mask_token_id": MASK,
        "final_logit_softcapping": 5.0,
        "input_embedding_scale": math.sqrt(H),
    }
    return raw


def _reference(kind: str, **shape) -> DFlashDraftModel:
    model = DFlashDraftModel(Qwen3Config.from_dict(_drafter_raw(kind, **shape))).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # larger than the reference's init, so every part shows
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return model


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def pair(request, tmp_path_factory) -> tuple[torch.nn.Module, DFlashDraftModel, DFlashDrafter]:
    """(target, reference drafter, swaserve's drafter loaded from the reference's checkpoint)."""
    target, ref = _target(request.param), _reference(request.param)
    folder = tmp_path_factory.mktemp(f"dflash-{request.param}")
    ref.save_pretrained(folder)
    ours = load_dflash_drafter(folder, target.config, "cpu", torch.float32)
    return target, ref, ours


@torch.no_grad()
def test_forward_matches_reference(pair) -> None:
    target, ref, ours = pair
    cfg = ours.cfg
    assert cfg.target_layer_ids == tuple(ref.target_layer_ids)
    assert (cfg.block_size, cfg.mask_token_id) == (ref.block_size, ref.mask_token_id)
    T, B = 12, cfg.block_size  # T > the sliding window: the window masks context keys
    prompt = torch.randint(0, MASK, (1, T), generator=torch.Generator().manual_seed(2))
    hs = target(prompt, output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i + 1] for i in cfg.target_layer_ids], dim=-1)  # [1, T, n * H]
    block = torch.tensor([[5] + [MASK] * (B - 1)])
    pos = torch.arange(T + B)

    ref_embeds = _raw_input_embeddings(target, block, cfg.input_embedding_scale)
    ref_hidden = ref(position_ids=pos[None], noise_embedding=ref_embeds, target_hidden=feats)[0]
    ref_logits = ref.compute_logits(ref_hidden[1:], target.lm_head)

    embeds = ours.embed_block(block[0], target.get_input_embeddings().weight)
    assert torch.equal(embeds, ref_embeds[0])
    hidden = ours(feats[0], pos[:T], embeds, pos[T:])
    logits = ours.compute_logits(hidden[1:], target.lm_head)
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    # the head's weight gives the same logits as the head module
    torch.testing.assert_close(ours.compute_logits(hidden[1:], target.lm_head.weight), logits)


def _swaserve_greedy(
    drafter: DFlashDrafter, target: torch.nn.Module, prompt: list[int], max_new: int
) -> tuple[list[int], list[torch.Tensor], int]:
    """What the engine will do, in plain torch: the target runs the whole sequence each step
    (no cache; it is not under test); the drafter keeps each layer's context K/V, computed
    once per committed token, a sliding layer only the window - 1 newest. Returns the tokens,
    every step's draft logits and the number of accepted drafts."""
    cfg = drafter.cfg
    embedding = target.get_input_embeddings().weight
    kv: list[ContextKV | None] = [None] * cfg.num_layers

    def commit(hidden_states: tuple[torch.Tensor, ...], first: int, n: int) -> None:
        feats = torch.cat(
            [hidden_states[i + 1][0, first : first + n] for i in cfg.target_layer_ids], dim=-1
        )
        ctx = drafter.project_context(feats)
        for i, window in enumerate(cfg.layer_windows):
            new = drafter.context_kv(i, ctx, torch.arange(first, first + n))
            if kv[i] is not None:
                new = ContextKV(*(torch.cat(pair) for pair in zip(kv[i], new)))
            if window is not None:  # the block's first query, at c, sees c - window + 1..c
                new = ContextKV(*(t[max(t.shape[0] - (window - 1), 0) :] for t in new))
            kv[i] = new

    ids, max_length = list(prompt), len(prompt) + max_new
    out = target(torch.tensor([ids]), output_hidden_states=True)
    ids.append(int(out.logits[0, -1].argmax()))
    commit(out.hidden_states, 0, len(prompt))
    start, draft_logits, accepted = len(prompt), [], 0
    while start + 1 < max_length:
        size = min(cfg.block_size, max_length - start)
        block = [ids[start]] + [cfg.mask_token_id] * (size - 1)
        embeds = drafter.embed_block(torch.tensor(block), embedding)
        hidden = drafter.forward_block(embeds, torch.arange(start, start + size), kv)
        draft_logits.append(drafter.compute_logits(hidden[1:], target.lm_head))
        block[1:] = draft_logits[-1].argmax(-1).tolist()
        out = target(torch.tensor([ids[:start] + block]), output_hidden_states=True)
        posterior = out.logits[0, start:].argmax(-1).tolist()
        a = 0
        while a < size - 1 and block[a + 1] == posterior[a]:
            a += 1
        produced = min(a + 1, max_length - start - 1)
        ids = ids[:start] + block[: a + 1] + [posterior[a]]
        commit(out.hidden_states, start, produced)
        accepted += a
        start += produced
    return ids[: min(start + 1, max_length)], draft_logits, accepted


@torch.no_grad()
def test_greedy_generate_matches_reference(pair, monkeypatch) -> None:
    target, ref, ours = pair
    ref_logits: list[torch.Tensor] = []
    compute_logits = ref.compute_logits

    def spy(hidden: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
        logits = compute_logits(hidden, head)
        ref_logits.append(logits[0])
        return logits

    monkeypatch.setattr(ref, "compute_logits", spy)
    prompt = torch.randint(0, MASK, (1, 10), generator=torch.Generator().manual_seed(3))
    ref_ids = dflash_generate(ref, target, prompt, max_new_tokens=24, stop_token_ids=None)
    ids, logits, accepted = _swaserve_greedy(ours, target, prompt[0].tolist(), 24)
    assert ids == ref_ids[0].tolist()
    assert len(logits) == len(ref_logits)
    for step, (mine, theirs) in enumerate(zip(logits, ref_logits)):
        # 1e-4 of the logits' scale: the rigged head gives logits up to ~80, where float32
        # sums in a different order differ by ~1e-4 absolute (1e-6 relative)
        scale = max(1.0, theirs.abs().max().item())
        torch.testing.assert_close(mine, theirs, atol=1e-4 * scale, rtol=0, msg=f"step {step}")
    assert accepted >= 4, accepted  # blocks commit several tokens: multi-token context updates


# ----- config -----------------------------------------------------------------------------


def _target_config() -> Qwen3Config:
    return Qwen3Config(**_SHAPE, intermediate_size=64, num_hidden_layers=6)


def test_dflash_config_wins_over_top_level() -> None:
    raw = _drafter_raw("qwen3")
    raw.update(
        block_size=8,
        mask_token_id=3,
        target_layer_ids=[0],
        input_embedding_scale=9.0,
        output_multiplier=2.0,
    )
    raw["dflash_config"]["input_embedding_scale"] = 3.0
    cfg = dflash_config_from_dict(raw, _target_config())
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (4, MASK, (1, 4))
    assert (cfg.input_embedding_scale, cfg.output_multiplier) == (3.0, 2.0)  # 2.0: fallback
    assert cfg.final_logit_softcapping is None and cfg.layer_causal == (False, False)
    ref = DFlashDraftModel(Qwen3Config.from_dict(raw))
    assert (ref.block_size, ref.mask_token_id, ref.target_layer_ids) == (4, MASK, [1, 4])
    # top-level fields alone are the fallback
    del raw["dflash_config"]
    cfg = dflash_config_from_dict(raw, _target_config())
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (8, 3, (0,))
    assert cfg.input_embedding_scale == 9.0


@pytest.mark.parametrize("n_target,n_draft", [(6, 1), (6, 2), (36, 5), (28, 3), (48, 8), (5, 4)])
def test_default_target_layer_ids(n_target: int, n_draft: int) -> None:
    assert build_target_layer_ids(n_target, n_draft) == ref_build_target_layer_ids(
        n_target, n_draft
    )


def test_default_ids_and_layer_kinds_from_config() -> None:
    raw = _drafter_raw("gemma3")  # no target_layer_ids anywhere: from num_target_layers
    cfg = dflash_config_from_dict(raw, _target_config())
    ref = DFlashDraftModel(Qwen3Config.from_dict(raw))
    assert cfg.target_layer_ids == tuple(ref.target_layer_ids) == (1, 3)
    attn = [layer.self_attn for layer in ref.layers]
    assert cfg.layer_windows == tuple(a.sliding_window for a in attn) == (4, None)
    assert cfg.layer_causal == tuple(a.is_causal for a in attn) == (True, False)
    assert (cfg.output_multiplier, cfg.final_logit_softcapping) == (0.5, 5.0)
    raw["is_causal"] = True  # a top-level is_causal sets every layer, as in the reference
    assert dflash_config_from_dict(raw, _target_config()).layer_causal == (True, True)


def _write(folder: Path, raw: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def _bad_ids(raw: dict) -> None:
    raw["dflash_config"]["target_layer_ids"] = [1, 6]


def _negative_id(raw: dict) -> None:
    raw["dflash_config"]["target_layer_ids"] = [-1]


def _no_ids(raw: dict) -> None:
    del raw["dflash_config"]["target_layer_ids"], raw["num_target_layers"]


def _bad_mask(raw: dict) -> None:
    raw["dflash_config"]["mask_token_id"] = V


def _no_mask(raw: dict) -> None:
    del raw["dflash_config"]["mask_token_id"]


@pytest.mark.parametrize(
    "mutate,message",
    [
        (_bad_ids, "target_layer_ids"),
        (_negative_id, "target_layer_ids"),
        (_no_ids, "target_layer_ids"),
        (_bad_mask, "mask_token_id"),
        (_no_mask, "mask_token_id"),
        (lambda r: r.update(hidden_size=64), "hidden_size"),
        (lambda r: r.update(hidden_size="32"), "hidden_size"),
        (lambda r: r.update(num_key_value_heads=3), "num_key_value_heads"),
        (lambda r: r.update(vocab_size=V + 2), "vocab_size"),
        (lambda r: r.update(num_target_layers=8), "num_target_layers"),
        (lambda r: r["dflash_config"].update(block_size=1), "block_size"),
        (lambda r: r.update(architectures=["Qwen3ForCausalLM"]), "architectures"),
        (lambda r: r.update(architectures=["DFlash2DraftModel"]), "DFlash2 checkpoints are not"),
        (lambda r: r.pop("architectures"), "architectures"),
        (
            lambda r: r.update(
                rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
            ),
            "rope_type",
        ),
    ],
)
def test_bad_config_names_the_field_and_file(tmp_path: Path, mutate, message: str) -> None:
    raw = _drafter_raw("qwen3")
    mutate(raw)
    folder = _write(tmp_path / "drafter", raw)
    with pytest.raises(ValueError, match=message) as e:
        load_dflash_config(folder, _target_config())
    assert str(folder / "config.json") in str(e.value)


def test_missing_folder_or_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_dflash_config(tmp_path / "nowhere", _target_config())
    with pytest.raises(ValueError, match="config.json"):
        load_dflash_config(tmp_path, _target_config())


def test_num_draft_tokens() -> None:
    cfg = dflash_config_from_dict(_drafter_raw("qwen3"), _target_config())
    assert isinstance(cfg, DFlashConfig) and cfg.default_num_draft_tokens == 3
    assert check_num_draft_tokens(None, cfg) == 3 and check_num_draft_tokens(1, cfg) == 1
    for k in (0, 4):
        with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
            check_num_draft_tokens(k, cfg)


def test_loader_is_strict_and_names_the_file(tmp_path: Path) -> None:
    _reference("qwen3").save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    save_file({**tensors, "lm_head.weight": torch.zeros(V, H)}, path)
    with pytest.raises(ValueError, match="unexpected tensor 'lm_head.weight'") as e:
        load_dflash_drafter(tmp_path, _target_config(), "cpu", torch.float32)
    assert str(path) in str(e.value)
    del tensors["fc.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"model.safetensors.*missing tensors \['fc.weight'\]"):
        load_dflash_drafter(tmp_path, _target_config(), "cpu", torch.float32)
    save_file({**tensors, "fc.weight": torch.zeros(H, H)}, path)
    with pytest.raises(ValueError, match="'fc.weight' has shape"):
        load_dflash_drafter(tmp_path, _target_config(), "cpu", torch.float32)
