"""``--actor.model_name_or_path`` for the Megatron actor: a local folder, or a Hugging Face hub id.

The converter reads safetensors slices from a folder, so a hub id (``Qwen/Qwen3-8B-Base``, the
recipes' default) is first resolved to its snapshot folder with ``huggingface_hub``: the local cache
is tried first (works offline, ``HF_HUB_OFFLINE=1``), then a download of the config, tokenizer and
safetensors files when online. Anything else fails with a message naming the flag and the fix.
"""

from __future__ import annotations

import os
from typing import Optional

# what the actor needs from a repository: configs, tokenizer files, weights (no pickles, no code)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def _offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return env in ("1", "ON", "YES", "TRUE") or bool(constants.HF_HUB_OFFLINE)


def _has_weights(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json"))


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or os.sep + os.sep in name or name.count("/") > 1


def resolve_pretrained(name: str, cache_dir: Optional[str] = None, flag: str = "--actor.model_name_or_path") -> str:
    """Local folder holding ``config.json`` and safetensors weights for ``name``."""
    if os.path.isdir(name):
        if not _has_weights(name):
            raise ValueError(f"{flag} {name!r}: the folder has no model.safetensors(.index.json) "
                             "(the Megatron actor reads safetensors only)")
        return name
    if _looks_like_path(name):
        raise ValueError(f"{flag} {name!r}: no such directory")
    from huggingface_hub import snapshot_download

    errors = []
    try:  # the cache first: no network, works with HF_HUB_OFFLINE=1
        path = snapshot_download(name, local_files_only=True, allow_patterns=ALLOW_PATTERNS, cache_dir=cache_dir)
        if _has_weights(path) and os.path.exists(os.path.join(path, "config.json")):
            return path
        errors.append(f"the cached snapshot {path} lacks config.json or safetensors weights")
    except Exception as e:  # noqa: BLE001 - not cached (LocalEntryNotFoundError and friends)
        errors.append(f"{type(e).__name__}: {e}")
    if _offline():
        raise ValueError(
            f"{flag} {name!r} is not a local folder and is not complete in the Hugging Face cache, and the hub is "
            f"offline (HF_HUB_OFFLINE=1): {errors[-1]}. Download it first (`huggingface-cli download {name}`) or "
            "pass a local folder."
        )
    try:
        path = snapshot_download(name, allow_patterns=ALLOW_PATTERNS, cache_dir=cache_dir)
    except Exception as e:  # noqa: BLE001 - wrong id, gated repo, no network, ...
        raise ValueError(
            f"{flag} {name!r} is neither a local folder nor a Hugging Face hub id that could be downloaded "
            f"({type(e).__name__}: {e}). Check the id, set HF_TOKEN for gated models, or pass a local folder."
        ) from None
    if not _has_weights(path):
        raise ValueError(f"{flag} {name!r}: the hub repository has no safetensors weights "
                         "(the Megatron actor reads safetensors only)")
    return path
