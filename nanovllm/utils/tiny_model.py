"""Tiny *random* Hugging Face checkpoints for tests and CPU demos.

Nothing is downloaded: a byte-level BPE tokenizer is trained on a small
built-in English corpus and a miniature Qwen3 / Qwen2 / Llama model (or a
Qwen3-MoE / Qwen2-MoE / Mixtral mixture of experts, configs in
``nanovllm.utils.tiny_configs``) is randomly initialised, then both are written
with ``save_pretrained`` so that ``transformers.AutoModelForCausalLM.from_pretrained(path)`` and
``transformers.AutoTokenizer.from_pretrained(path)`` load them.  That lets the
engine's outputs be compared token for token against transformers.

Design notes
------------
* Weights are drawn from ``N(0, init_std)`` (default ``DEFAULT_INIT_STD`` =
  0.3, much larger than the usual 0.02) so that the next-token distribution is
  far from flat and greedy argmax is numerically robust: with the default
  shapes the logits have std ~2.4 and the top-1/top-2 gap has median ~0.55 and
  exceeds 1e-3 for ~99.8% of random prompts (tests/test_tiny_model.py).  With
  small stds (0.02-0.1) the tied-embedding model mostly repeats one token;
  with 0.3 greedy generations are varied.
* Every RMSNorm weight is ``1 + 0.1 * randn`` rather than all ones, so a bug in
  norm handling (forgotten weight, wrong eps placement, q/k norm skipped...)
  changes the output.
* MoE routers (``*.gate.weight``) are drawn with ``ROUTER_STD``, so routing is
  decisive (a token's k-th expert scores well above its runner-up).
* Qwen2 q/k/v projection biases are random and non-zero (transformers would
  initialise them to zero, hiding a forgotten bias).
* The EOS (``<|endoftext|>``) row of the output projection is zeroed, so its
  logit is always exactly 0 while the other logits have std ~2.4; greedy
  decoding therefore (practically) never emits EOS.  With tied
  embeddings this also zeroes the input embedding of ``<|endoftext|>``.
  Tests that need an EOS stop should use a custom stop token / ``ignore_eos``.
* The model vocabulary is the tokenizer size rounded up to a multiple of 64, so
  a few ids at the end are valid model ids that have no text (like the padded
  vocabularies of real Qwen checkpoints).
* Initialisation is done by this module with its own ``torch.Generator``
  (parameters visited in sorted-name order), so the weights depend only on
  ``seed`` and the shapes, not on the transformers version.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import tempfile
import time
import uuid

from nanovllm.utils.tiny_configs import ARCH_CLASSES, MOE_ARCHS, make_config
from nanovllm.utils.tiny_tokenizer import CHAT_TEMPLATE, EOS_TOKEN, IM_END, IM_START, build_hf_tokenizer

__all__ = [
    "build_tiny_checkpoint",
    "default_tiny_model_dir",
    "ensure_default_tiny_model",
    "SUPPORTED_ARCHS",
    "DEFAULT_INIT_STD",
    "EOS_TOKEN",
    "IM_START",
    "IM_END",
    "CHAT_TEMPLATE",
]

SUPPORTED_ARCHS = tuple(ARCH_CLASSES)

DEFAULT_INIT_STD = 0.3
NORM_WEIGHT_STD = 0.1
ROUTER_STD = 0.5  # MoE routers: logits std ~4 at hidden 64, so a token's top-k is far from its runner-up
VOCAB_MULTIPLE = 64
_FORMAT_VERSION = 1
_MARKER_FILE = ".nanovllm_tiny_model.json"


# ----------------------------------------------------------------------------
# Random initialisation
# ----------------------------------------------------------------------------


def _randomize_(model, *, seed: int, init_std: float, eos_id: int, arch: str):
    import torch

    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    params = dict(model.named_parameters())  # tied weights appear once
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim == 1 and name.endswith("norm.weight"):
                p.copy_(1.0 + NORM_WEIGHT_STD * noise)
            elif name.endswith(".gate.weight"):  # an MoE router
                p.copy_(ROUTER_STD * noise)
            else:
                # Linear / embedding weights and (Qwen2) q/k/v biases.
                p.copy_(init_std * noise)
        if arch in ("qwen2", "qwen2_moe"):
            for name, p in params.items():
                if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) and not torch.all(p != 0):
                    raise RuntimeError(f"qwen2 bias {name} has zero entries")
        # Suppress EOS: its logit becomes exactly 0 (see module docstring).
        out = model.get_output_embeddings()
        out.weight[eos_id].zero_()


# ----------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------


def _dir_is_nonempty(path: str) -> bool:
    return os.path.isdir(path) and any(True for _ in os.scandir(path))


def build_tiny_checkpoint(path, arch="qwen3", *, vocab_size=None, hidden_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                          max_position_embeddings=4096, tie_word_embeddings=True, seed=0,
                          max_shard_size=None, init_std=None, overwrite=False, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=32, mlp_only_layers=(0,), norm_topk_prob=None,
                          shared_expert_intermediate_size=48) -> str:
    """Write a tiny random HF checkpoint (model + tokenizer) to ``path``.

    Returns the absolute path.  ``arch`` is one of SUPPORTED_ARCHS: "qwen3", "qwen2", "llama", or a mixture
    of experts, "qwen3_moe" (norm_topk_prob True by default), "qwen2_moe" (a shared expert, norm_topk_prob False
    by default) or "mixtral" (every layer sparse, experts ``moe_intermediate_size`` wide); the expert arguments
    apply to those (mlp_only_layers: the dense layers of the Qwen ones).
    ``vocab_size`` defaults to the tokenizer size rounded up to a multiple of
    64 and must be >= the tokenizer size.  ``max_shard_size`` (e.g. "20KB")
    produces a sharded checkpoint with ``model.safetensors.index.json``.
    The checkpoint is assembled in a sibling temporary directory and renamed
    into place, so ``path`` never holds a half-written checkpoint.
    """
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unknown tiny-model arch {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    if num_heads % num_kv_heads != 0:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    if arch in ("qwen2", "qwen2_moe") and head_dim * num_heads != hidden_size:
        raise ValueError(f"{arch} requires head_dim * num_heads == hidden_size")
    init_std = DEFAULT_INIT_STD if init_std is None else float(init_std)

    path = os.path.abspath(os.fspath(path))
    if _dir_is_nonempty(path):
        if not overwrite:
            raise FileExistsError(f"{path} exists and is not empty (pass overwrite=True)")
    elif os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{path} exists and is not a directory")

    import torch
    from transformers import GenerationConfig

    tokenizer = build_hf_tokenizer()
    tok_size = len(tokenizer)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    if vocab_size is None:
        vocab_size = -(-tok_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    elif vocab_size < tok_size:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({tok_size} tokens)")

    moe = None
    if arch in MOE_ARCHS:
        moe = dict(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                   moe_intermediate_size=moe_intermediate_size, mlp_only_layers=tuple(mlp_only_layers),
                   norm_topk_prob=arch == "qwen3_moe" if norm_topk_prob is None else bool(norm_topk_prob),
                   shared_expert_intermediate_size=shared_expert_intermediate_size)
    config, model_cls = make_config(
        arch, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, eos_id=eos_id, init_std=init_std, moe=moe,
    )

    torch.manual_seed(seed)
    prev_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        model = model_cls(config)
    finally:
        torch.set_default_dtype(prev_dtype)
    model = model.float().eval()
    _randomize_(model, seed=seed, init_std=init_std, eos_id=eos_id, arch=arch)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False,
    )

    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        save_kwargs = {}
        save_params = inspect.signature(model.save_pretrained).parameters
        if "safe_serialization" in save_params:
            save_kwargs["safe_serialization"] = True
        if max_shard_size is not None:
            save_kwargs["max_shard_size"] = max_shard_size
        with _quiet_progress_bars():
            model.save_pretrained(tmp, **save_kwargs)
        tokenizer.save_pretrained(tmp)
        # Make sure architectures / generation config are on disk whatever the
        # transformers version decided to write.
        cfg_file = os.path.join(tmp, "config.json")
        with open(cfg_file) as f:
            cfg_json = json.load(f)
        if not cfg_json.get("architectures"):
            cfg_json["architectures"] = list(config.architectures)
            with open(cfg_file, "w") as f:
                json.dump(cfg_json, f, indent=2, sort_keys=True)
        if not os.path.exists(os.path.join(tmp, "generation_config.json")):
            model.generation_config.save_pretrained(tmp)
        marker = {
            "format_version": _FORMAT_VERSION,
            "arch": arch,
            "seed": seed,
            "init_std": init_std,
            "tokenizer_size": tok_size,
            "vocab_size": vocab_size,
            "eos_token_id": eos_id,
            "transformers_version": _transformers_version(),
        }
        with open(os.path.join(tmp, _MARKER_FILE), "w") as f:
            json.dump(marker, f, indent=2)

        if os.path.isdir(path):
            if _dir_is_nonempty(path):
                if not overwrite:
                    raise FileExistsError(f"{path} appeared while building")
                _remove_dir(path)
            else:
                os.rmdir(path)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _transformers_version() -> str:
    try:
        from importlib.metadata import version

        return version("transformers")
    except Exception:  # pragma: no cover - unusual installs
        import transformers

        return transformers.__version__


@contextlib.contextmanager
def _quiet_progress_bars():
    """Silence transformers' "Writing model shards" progress bar."""
    try:
        from transformers.utils import logging as hf_logging

        was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover - API missing in some version
        yield
        return
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _remove_dir(path: str) -> None:
    """Move ``path`` aside atomically, then delete it."""
    trash = f"{path}.trash-{uuid.uuid4().hex[:8]}"
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def default_tiny_model_dir() -> str:
    """Where ``ensure_default_tiny_model`` keeps its checkpoint.

    ``$NANOVLLM_TINY_MODEL_DIR`` if set, else ``$NANOVLLM_CACHE/tiny-qwen3-random``
    with ``$NANOVLLM_CACHE`` defaulting to ``~/.cache/nanovllm``.
    """
    explicit = os.environ.get("NANOVLLM_TINY_MODEL_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    cache = os.environ.get("NANOVLLM_CACHE") or os.path.join("~", ".cache", "nanovllm")
    return os.path.abspath(os.path.join(os.path.expanduser(cache), "tiny-qwen3-random"))


def _is_complete(path: str) -> bool:
    try:
        with open(os.path.join(path, _MARKER_FILE)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return False
    # Rebuild when the format or the transformers version changed (the saved
    # tokenizer / config files are written by, and for, that version).
    if marker.get("format_version") != _FORMAT_VERSION:
        return False
    if marker.get("transformers_version") != _transformers_version():
        return False
    needed = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
    if not all(os.path.isfile(os.path.join(path, n)) for n in needed):
        return False
    return (os.path.isfile(os.path.join(path, "model.safetensors"))
            or os.path.isfile(os.path.join(path, "model.safetensors.index.json")))


@contextlib.contextmanager
def _file_lock(lock_path: str, timeout: float = 600.0):
    try:
        import fcntl
    except ImportError:  # non-POSIX: rely on the atomic rename alone
        yield
        return
    with open(lock_path, "a+") as fh:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"could not lock {lock_path}") from e
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def ensure_default_tiny_model() -> str:
    """Build the default tiny Qwen3 checkpoint once and return its path.

    Idempotent and safe to call concurrently: an existing complete checkpoint is
    reused; otherwise it is built in a temporary sibling directory and renamed
    into place (an incomplete / outdated directory is replaced).
    """
    path = default_tiny_model_dir()
    if _is_complete(path):
        return path
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    with _file_lock(os.path.join(parent, f".{os.path.basename(path)}.lock")):
        if _is_complete(path):
            return path
        return build_tiny_checkpoint(path, "qwen3", overwrite=True)
