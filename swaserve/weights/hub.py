"""Models named by a Hugging Face Hub id (`Qwen/Qwen2.5-1.5B-Instruct`), as vLLM takes them:
the repository's config, tokenizer and safetensors files, downloaded once into the Hub's own
cache (`HF_HOME` / `HF_HUB_CACHE`; `HF_TOKEN` for gated models; `HF_HUB_OFFLINE=1` uses the
cache alone). PyTorch `.bin` and `original/` checkpoints and GGUF files are not fetched:
swaserve reads safetensors (a repository without them fails at load, saying so)."""

from __future__ import annotations

import re
from pathlib import Path

# owner/name, as the Hub spells repository ids
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# what a model folder needs: configs (config, generation, tokenizer), weights, tokenizer files
FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def is_hub_id(model: str) -> bool:
    return bool(HUB_ID.fullmatch(model)) and not Path(model).expanduser().exists()


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local folder of `repo_id`'s files (downloaded on first use); ValueError saying why
    when the Hub cannot give it (offline without a cached copy, unknown or gated)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=FILES,
                                      ignore_patterns=["original/*"]))  # fmt: skip
    except LocalEntryNotFoundError as e:
        raise ValueError(f"model {repo_id!r}: not in the Hugging Face cache and the Hub cannot "
                         f"be reached (offline, or HF_HUB_OFFLINE=1): {e}") from None
    except HfHubHTTPError as e:
        raise ValueError(f"model {repo_id!r}: the Hugging Face Hub refused it (unknown, or "
                         f"gated: set HF_TOKEN): {e}") from None
