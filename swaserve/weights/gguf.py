"""Convert a GGUF checkpoint into a cached Hugging Face folder, once.

The folder holds config.json, generation_config.json, the tokenizer files and
model.safetensors with every tensor dequantized to float32 under its Hugging Face name,
with llama.cpp's storage transforms undone (rope row permutation of Q/K for llama, the
+1 folded into Gemma norm weights). It is built in a temporary folder and renamed into
place, so a folder under the cache root is always complete.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Bump when the output of the conversion changes: old cache folders are then ignored.
CONVERTER_VERSION = 1
_SAMPLE = 1 << 20  # bytes hashed from each end of the file


@dataclass(frozen=True)
class ArchSpec:
    """How one llama.cpp architecture maps to Hugging Face."""

    model_type: str  # Hugging Face config model_type
    layer_names: dict[str, str]  # blk.{i}.<key>.{weight,bias} -> model.layers.{i}.<value>
    rope_permute: bool = False  # llama.cpp permuted Q/K rows for its interleaved rope
    norm_offset: float = 0.0  # llama.cpp stored RMSNorm weights as w + offset


_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_LAYER = {
    **_LLAMA_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", _LLAMA_LAYER, rope_permute=True),  # also Mistral (same arch)
    "qwen2": ArchSpec("qwen2", _LLAMA_LAYER),  # Qwen2.5: q/k/v biases ride in .bias tensors
    "qwen3": ArchSpec("qwen3", _LLAMA_LAYER),
    # HF Gemma3RMSNorm computes x * (1 + w); llama.cpp stores 1 + w.
    "gemma3": ArchSpec("gemma3_text", _GEMMA3_LAYER, norm_offset=1.0),
    "gemma2": ArchSpec("gemma2", _GEMMA3_LAYER, norm_offset=1.0),  # no q/k norm tensors
    # Command R7B: one input norm (a LayerNorm, weight only), q/k rows stored as HF's (llama.cpp
    # rotates pairs of consecutive dims, as Cohere does)
    "cohere2": ArchSpec("cohere2", _LLAMA_LAYER),
}
# HF model_type -> architectures entry.
_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
}
# End-of-turn tokens also added to generation_config's eos ids when the vocab has them.
_END_OF_TURN = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>")
# GGUF "<arch>.<key>" -> Hugging Face config attribute.
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window",
}
_TENSOR_RE = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)$")


def cache_root() -> Path:
    """`$SWASERVE_CACHE`, else ~/.cache/swaserve."""
    env = os.environ.get("SWASERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "swaserve"


def file_key(path: Path) -> str:
    """12 hex digits identifying the file (size, first and last MiB) and converter version."""
    size = path.stat().st_size
    h = hashlib.sha256(f"v{CONVERTER_VERSION}:{size}:".encode())
    with path.open("rb") as f:
        h.update(f.read(_SAMPLE))
        f.seek(max(0, size - _SAMPLE))
        h.update(f.read(_SAMPLE))
    return h.hexdigest()[:12]


def read_metadata(reader: Any) -> dict[str, Any]:
    """All GGUF key/values as Python values (arrays as lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def hf_tensor_name(gguf_name: str, spec: ArchSpec) -> str | None:
    m = _TENSOR_RE.match(gguf_name)
    if m is None:
        return None
    layer, key, kind = m.groups()
    if layer is None:
        base = _GLOBAL_NAMES.get(key)
        return f"{base}.{kind}" if base else None
    base = spec.layer_names.get(key)
    return f"model.layers.{layer}.{base}.{kind}" if base else None


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert_hf_to_gguf `LlamaModel.permute` (rows per head)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_tensors(reader: Any, arch: str, config: Any) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (hf_name, float32 array) for every tensor of the GGUF file."""
    from gguf.quants import dequantize

    spec = ARCHS[arch]
    unknown = [t.name for t in reader.tensors if hf_tensor_name(t.name, spec) is None]
    if unknown:
        raise ValueError(f"GGUF tensors with no Hugging Face name for {arch!r}: {unknown[:8]}")
    for t in reader.tensors:
        name = hf_tensor_name(t.name, spec)
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims fastest-first
        if spec.rope_permute and ".attn_q." in t.name:
            w = unpermute_rope(w, config.num_attention_heads)
        elif spec.rope_permute and ".attn_k." in t.name:
            w = unpermute_rope(w, config.num_key_value_heads)
        if spec.norm_offset and t.name.endswith("norm.weight"):
            w = w - np.float32(spec.norm_offset)
        yield name, np.ascontiguousarray(w)


def _round_f32(x: float) -> float:
    """1e-6 instead of 9.999999974752427e-07: GGUF stores floats as float32."""
    return float(str(np.float32(x)))


def build_config(meta: dict[str, Any], tensor_names: set[str]) -> Any:
    """The transformers config for a GGUF file, from its metadata (as llama.cpp reads it).

    Checked against `AutoConfig.from_pretrained(dir, gguf_file=...)` by the tests; built
    here because that call reads the whole file again (15 s for Gemma 3 270M).
    """
    from transformers import AutoConfig

    arch = meta["general.architecture"]
    model_type = ARCHS[arch].model_type
    if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        model_type = "mistral"  # llama.cpp writes Mistral as llama, without sliding window
        kw_extra: dict[str, Any] = {"sliding_window": None}
    else:
        kw_extra = {}
    kw = {hf: meta[f"{arch}.{k}"] for k, hf in _CONFIG_KEYS.items() if f"{arch}.{k}" in meta}
    kw = {**kw_extra, **kw}
    kw["rms_norm_eps"] = _round_f32(kw.get("rms_norm_eps", 1e-6))
    kw["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    kw["tie_word_embeddings"] = "output.weight" not in tensor_names
    for attr, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
        if meta.get(f"tokenizer.ggml.{key}_token_id") is not None:
            kw[f"{attr}_token_id"] = int(meta[f"tokenizer.ggml.{key}_token_id"])
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))
    elif scaling != "none":
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    if model_type == "gemma3_text":
        # llama.cpp hard-codes these for Gemma 3 too: every 6th layer global, local rope base
        # 10k, attention scale 1/sqrt(head_dim) except 27B (1/sqrt(hidden/heads)).
        n = kw["num_hidden_layers"]
        kw["layer_types"] = [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)
        ]
        local = {"rope_type": "default", "rope_theta": 10000.0}
        kw["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
        is_27b = n == 62
        kw["query_pre_attn_scalar"] = (
            kw["hidden_size"] // kw["num_attention_heads"] if is_27b else kw.get("head_dim", 256)
        )
    elif model_type == "gemma2":
        # llama.cpp's Gemma 2: even layers sliding, attention scale as Gemma 3's, the two
        # soft-caps from the metadata (50 and 30 when absent, Gemma 2's own)
        n = kw["num_hidden_layers"]
        kw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                             for i in range(n)]  # fmt: skip
        kw["rope_parameters"] = rope
        is_27b = n == 46
        kw["query_pre_attn_scalar"] = (
            kw["hidden_size"] // kw["num_attention_heads"] if is_27b else kw.get("head_dim", 256)
        )
        kw["attn_logit_softcapping"] = float(meta.get("gemma2.attn_logit_softcapping", 50.0))
        kw["final_logit_softcapping"] = float(meta.get("gemma2.final_logit_softcapping", 30.0))
    elif model_type == "cohere2":
        # llama.cpp's Cohere2: every 4th layer full (its hard-coded pattern, transformers'
        # default too), LayerNorm eps and the logit scale from the metadata
        n = kw["num_hidden_layers"]
        kw["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                             for i in range(n)]  # fmt: skip
        del kw["rms_norm_eps"]
        kw["layer_norm_eps"] = _round_f32(meta.get("cohere2.attention.layer_norm_epsilon", 1e-5))
        kw["logit_scale"] = _round_f32(meta.get("cohere2.logit_scale", 1.0))
        kw["rope_parameters"] = rope
    else:
        kw["rope_parameters"] = rope
    config = AutoConfig.for_model(model_type, **kw)
    config.architectures = [_HF_ARCHITECTURES[model_type]]
    config.dtype = "float32"
    return config


def _eos_ids(meta: dict[str, Any]) -> list[int]:
    ids = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    types = meta.get("tokenizer.ggml.token_type")
    # Only control tokens end a turn (a normal piece spelled like one does not).
    ids += [
        i
        for i, t in enumerate(meta["tokenizer.ggml.tokens"])
        if t in _END_OF_TURN and (not types or types[i] == 3)
    ]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _write_folder(path: Path, out: Path) -> None:
    import gguf
    from safetensors.numpy import save_file
    from tqdm import tqdm
    from transformers import GenerationConfig

    from swaserve.weights.gguf_tokenizer import build_tokenizer

    try:
        reader = gguf.GGUFReader(path)
        meta = read_metadata(reader)
    except Exception as e:  # the parser fails with whatever a bad byte leads it to
        raise ValueError(
            f"not a readable GGUF file, truncated or corrupt? ({type(e).__name__}: {e})"
        ) from e
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported ({', '.join(ARCHS)})")
    config = build_config(meta, {t.name for t in reader.tensors})
    tokenizer = build_tokenizer(meta)  # before the slow part: fails fast if unsupported
    bar = tqdm(
        convert_tensors(reader, arch, config),
        total=len(reader.tensors),
        desc=f"Converting {path.name}",
        unit="tensor",
    )
    save_file(dict(bar), str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    eos = _eos_ids(meta)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else eos,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    source = {"gguf": str(path), "converter_version": CONVERTER_VERSION}
    (out / "swaserve_gguf.json").write_text(json.dumps(source, indent=2) + "\n")


@contextlib.contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    """Exclusive lock so concurrent processes build a cached file once (no-op without fcntl)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with lock_path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert_gguf(
    path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Return the Hugging Face folder converted from the GGUF file `path`, converting once.

    The folder is `<cache_dir or cache_root()>/<stem>-<file_key>/`.
    """
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"GGUF file not found: {path}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    name = f"{path.stem}-{file_key(path)}"
    final = root / name
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".{name}.lock"):
        if (final / "config.json").is_file():  # another process finished it meanwhile
            return final
        for stale in root.glob(glob.escape(f".tmp-{name}-") + "*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
        # Half a minute or more for a small model: say so (once per file and cache folder).
        print(f"swaserve: converting {path.name} into {final} (once)", file=sys.stderr, flush=True)
        try:
            try:
                _write_folder(path, tmp)
            except ValueError as e:  # a file we cannot convert: the message names it
                raise ValueError(f"{path}: {e}") from e
            os.chmod(tmp, 0o755)  # mkdtemp made it private
            if final.exists():  # incomplete (no config.json), e.g. made by hand
                shutil.rmtree(final)
            os.rename(tmp, final)  # atomic: the folder appears complete or not at all
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
