"""A model's tokenizer (transformers' AutoTokenizer, errors as ValueErrors) and its EOS ids as transformers'
generate sees them."""
from __future__ import annotations

import json
import os


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - surfaced as a clear user error
        raise ValueError(f"could not load a tokenizer from {path!r}: {e}") from e


def eos_ids(model_dir: str, config_eos: tuple[int, ...], tokenizer) -> frozenset[int]:
    """EOS ids as transformers' generate sees them: generation_config.json first, then config.json."""
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            return frozenset(eos if isinstance(eos, list) else [eos])
    if config_eos:
        return frozenset(config_eos)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        return frozenset([tokenizer.eos_token_id])
    return frozenset()
