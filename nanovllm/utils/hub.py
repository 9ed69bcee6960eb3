"""A model name as a local directory: a directory as it is, else a Hugging Face model id ("org/name") resolved
through huggingface_hub's cache (downloading what is missing, unless HF_HUB_OFFLINE=1)."""
from __future__ import annotations

import os
import re

# what a checkpoint needs: configs, tokenizer files, safetensors weights (never *.bin / *.pt pickles or remote code)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def resolve_model_dir(name: str, revision: str | None = None, download_dir: str | None = None,
                      what: str = "model") -> str:
    """`name` as a directory holding its files; ValueError naming it if it is neither a directory nor a model id
    the hub (or its cache) has."""
    path = os.fspath(name)
    if os.path.isdir(path):
        return path
    looks_local = path.startswith((".", "/", "~")) or os.sep in path.replace("/", "") or path.count("/") > 1
    if looks_local or not _REPO_ID.match(path):
        raise ValueError(f"{what} directory {path!r} does not exist")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # (transformers depends on it)
        raise ValueError(f"{what} {path!r} is not a directory, and huggingface_hub is not installed") from e
    try:
        return snapshot_download(path, revision=revision, cache_dir=download_dir, allow_patterns=ALLOW_PATTERNS)
    except Exception as e:  # noqa: BLE001 - not found, offline without a cached copy, no network, gated...
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
        why = "not in the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else \
            f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        rev = f" at revision {revision!r}" if revision else ""
        raise ValueError(f"{what} {path!r}{rev} is neither a local directory nor a Hugging Face model id that could "
                         f"be loaded: {why}") from None
