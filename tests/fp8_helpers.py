"""FP8 test helpers: a transformers reference that quantizes exactly as the engine does (fake quantization: quantize
and dequantize in float32 with ``nanovllm.layers.quantization.fp8_ref``), and a block-FP8 checkpoint writer in the
Hub's format (the Qwen3-*-FP8 layout)."""
from __future__ import annotations

import json
import os
import shutil
from functools import partial

import torch

from nanovllm.layers.quantization import fp8_ref

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KV_ATTENTION = "nanovllm_fp8_kv_reference"


def fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize each row of x (..., K) (per token / per output channel / per (token, head))."""
    flat = x.reshape(-1, x.shape[-1])
    q, s = fp8_ref.quantize_rows(flat)
    return fp8_ref.dequantize(q, s).to(x.dtype).view(x.shape)


def fake_quant_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    q, s = fp8_ref.quantize_groups(flat, group)
    return fp8_ref.dequantize(q, s.repeat_interleave(group, 1)).to(x.dtype).view(x.shape)


def fake_quant_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    q, s = fp8_ref.quantize_blocks(w, block)
    return fp8_ref.dequantize(q, fp8_ref.expand_block_scales(s, block, tuple(w.shape))).to(w.dtype)


def _register_kv_attention() -> str:
    """An attention function for transformers that fake-quantizes K and V per (token, KV head) and then runs sdpa:
    the FP8 KV cache's numerics (keys after RoPE, as the cache stores them)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, fake_quant_rows(key), fake_quant_rows(value), attention_mask,
                                      **kwargs)

    AttentionInterface.register(_KV_ATTENTION, attention)
    return _KV_ATTENTION


def reference_model(path: str, weights: str | tuple[int, int] | None = None, kv: bool = False,
                    skip: tuple[str, ...] = (), tp: int = 1):
    """The checkpoint in transformers (float32, CPU), with its decoder projections fake-quantized as the engine
    quantizes them: ``weights="rows"`` (online FP8: weights per output channel, activations per token) or a block
    (bn, bk) (block FP8: weights per tile, activations per token and bk columns); ``kv``: K/V per (token, head).
    ``skip``: modules left unquantized. ``tp``: online FP8 under tensor parallelism, where each rank of a
    row-parallel layer (o_proj, down_proj) quantizes its own slice of the input features (weights and activations
    per row *and* rank). A mixture of experts' stacked experts (``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H,
    I)) are quantized per expert and row (online) or tile (block), as ``Fp8MoEMethod`` / ``Fp8BlockMoEMethod``
    store them, and their input per token (online) or per token and bk columns (block), as the gate/up kernel
    quantizes it; the down projections' input stays unquantized."""
    from transformers import AutoModelForCausalLM
    kw = {"attn_implementation": _register_kv_attention()} if kv else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()
    if weights is None:
        return model
    for m in model.modules():
        # FP8 experts: online, each expert's rows quantized per output row (w2's per rank's slice of I under TP);
        # block-FP8, each expert's projections per tile; the tokens entering them per token (and bk columns)
        if type(m).__name__.endswith("Experts"):
            with torch.no_grad():
                for p in (m.gate_up_proj, m.down_proj):
                    if weights == "rows":
                        p.copy_(_fake_quant_parts(p, tp if p is m.down_proj else 1))
                    else:
                        p.copy_(torch.stack([fake_quant_blocks(w, weights) for w in p]))
            m.register_forward_pre_hook(partial(_fake_quant_expert_input, weights=weights), with_kwargs=True)
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or name.rsplit(".", 1)[-1] not in PROJECTIONS or name in skip:
            continue
        with torch.no_grad():
            if weights == "rows":
                parts = tp if name.endswith(("o_proj", "down_proj")) else 1
                m.weight.copy_(_fake_quant_parts(m.weight, parts))
                m.register_forward_pre_hook(lambda mod, args, n=parts: (_fake_quant_parts(args[0], n),))
            else:
                m.weight.copy_(fake_quant_blocks(m.weight, weights))
                m.register_forward_pre_hook(lambda mod, args, g=weights[1]: (fake_quant_groups(args[0], g),))
    return model


def _fake_quant_expert_input(module, args, kwargs, weights):
    """A forward pre-hook of an experts module: its hidden states (the first argument) fake-quantized."""
    quant = fake_quant_rows if weights == "rows" else partial(fake_quant_groups, group=weights[1])
    if args:
        return (quant(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": quant(kwargs["hidden_states"])}


def _fake_quant_parts(x: torch.Tensor, parts: int) -> torch.Tensor:
    """fake_quant_rows of each of `parts` equal slices of the last dim."""
    return fake_quant_rows(x.reshape(*x.shape[:-1], parts, x.shape[-1] // parts)).view(x.shape)


def greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=model.generation_config.eos_token_id)
        outs.append(g[0, len(p):].tolist())
    return outs


def write_block_fp8_checkpoint(src: str, dst: str, block: tuple[int, int] = (128, 128),
                               not_converted: tuple[str, ...] = (), extra_config: dict | None = None) -> str:
    """Copy checkpoint `src` to `dst` with every decoder projection (except modules named in `not_converted`) stored
    as e4m3 ``weight`` + float32 ``weight_scale_inv`` per tile, and config.json's quantization_config saying so."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst, dirs_exist_ok=True)
    files = [f for f in os.listdir(dst) if f.endswith(".safetensors")]
    if files != ["model.safetensors"]:
        raise ValueError(f"expected one model.safetensors in {src}, found {files}")
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS and module not in not_converted:
            q, s = fp8_ref.quantize_blocks(t, block)
            out[name], out[f"{module}.weight_scale_inv"] = q, s
        else:
            out[name] = t  # (a Hub checkpoint has these in bf16; float32 here keeps the test's reference exact)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": list(block), **({"modules_to_not_convert": list(not_converted)}
                                                                      if not_converted else {}),
                                  **(extra_config or {})}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


def assert_same_tokens(model, prompts, ref, out, tie: float = 0.01) -> None:
    """Engine tokens `out` equal the reference's `ref`, except that a sequence may diverge where the reference's top
    two logits are within `tie` of each other (a float32 difference between the two implementations can move a
    value across an e4m3 rounding boundary: a one-step change of one element, which decides only near-ties)."""
    for i, (r, o) in enumerate(zip(ref, out)):
        if r == o:
            continue
        j = next((k for k in range(min(len(r), len(o))) if r[k] != o[k]), None)
        assert j is not None, f"prompt {i}: lengths differ ({len(r)} vs {len(o)})"
        with torch.no_grad():
            top = model(torch.tensor([prompts[i] + r[:j]])).logits[0, -1].float().topk(2).values
        gap = (top[0] - top[1]).item()
        assert gap < tie, f"prompt {i} (len {len(prompts[i])}) diverged at token {j} where the top-2 gap is {gap:.4f}"
