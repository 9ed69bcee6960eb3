"""Weights into a built model: from safetensors (sharded or not), or random for benchmarks."""
from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open
from torch import nn

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"checkpoint index lists missing file(s): {', '.join(missing)}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir!r} (use load_format='dummy' for random weights)")
    return files


def packed_target(name: str, mapping: dict) -> tuple[str, object]:
    """(parameter name, shard id) of a checkpoint tensor under a ``packed_modules_mapping`` ({checkpoint module
    name: (fused module name, shard id)}); (name, None) when no entry matches."""
    for ckpt_part, (fused, shard) in mapping.items():
        key = f".{ckpt_part}."
        if key in name:
            return name.replace(key, f".{fused}."), shard
    return name, None


def load_safetensors(model: nn.Module, model_dir: str) -> None:
    """Copy every checkpoint tensor into its (possibly fused, possibly sharded) parameter: the one the model's
    ``checkpoint_target(name) -> (parameter name, shard id)`` names, or else its ``packed_modules_mapping``.
    A parameter with ``shard_ids`` (stacked experts) must receive every one of them."""
    params = dict(model.named_parameters(remove_duplicate=False))
    mapping = getattr(model, "packed_modules_mapping", {})
    target_of = getattr(model, "checkpoint_target", None) or (lambda n: packed_target(n, mapping))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    seen: set[str] = set()
    shards: dict[str, set] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if tied and name == "lm_head.weight":
                    continue  # the head shares the embedding's parameter
                target, shard = target_of(name)
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} in {os.path.basename(path)} has no matching "
                                     f"parameter in {type(model).__name__}")
                loader = getattr(param, "weight_loader", None)
                tensor = f.get_tensor(name)
                if loader is None:
                    if param.shape != tensor.shape:
                        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                         f"parameter wants {tuple(param.shape)}")
                    param.data.copy_(tensor)
                else:
                    try:
                        loader(param, tensor, shard)
                    except ValueError as e:
                        raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
                seen.add(target)
                shards.setdefault(target, set()).add(shard)
    missing = sorted(n for n in params if n not in seen and not (tied and n == "lm_head.weight"))
    if missing:
        raise ValueError(f"checkpoint in {model_dir!r} lacks weights for: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))
    for n, p in params.items():
        lacking = sorted(getattr(p, "shard_ids", set()) - shards.get(n, set()))
        if lacking:
            raise ValueError(f"checkpoint in {model_dir!r} lacks {len(lacking)} part(s) of {n}, e.g. "
                             f"{', '.join(map(str, lacking[:4]))}")


@torch.no_grad()
def init_dummy(model: nn.Module, seed: int, rank: int = 0) -> None:
    """Random weights with a plausible scale (benchmarks without a checkpoint): N(0, 0.02) matrices (the stacked
    experts and the routers too), norms 1, biases 0. A tensor-parallel rank draws its shards from seed + rank;
    parameters marked ``replicated`` (a router) are drawn from `seed` alone, the same on every rank. A parameter
    stored in another form (e4m3 weights and their scales) carries its own ``dummy_init(param, generator)``."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed + rank)
    same = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        init = getattr(p, "dummy_init", None)
        if init is not None:
            init(p, gen)
        elif name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.dim() == 1:
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=same if getattr(p, "replicated", False) else gen)


def process_weights_after_loading(model: nn.Module) -> None:
    """Let each linear and MoE layer's method repack or quantize the weights now in place (after either loader)."""
    from nanovllm.layers.linear import LinearBase
    from nanovllm.layers.moe import FusedMoE
    for m in model.modules():
        if isinstance(m, (LinearBase, FusedMoE)):
            m.method.process_weights_after_loading(m)
