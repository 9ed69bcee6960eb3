"""The fused MoE on a GPU (marked gpu; skipped without CUDA):

    python -m pytest -m gpu tests/gpu/test_moe_gpu.py -s      # -s prints the measured figures

* the Triton layer against the torch reference (``fused_moe_ref``) at Qwen3-30B-A3B's layer shapes in bf16, at
  TP=1 and TP=2 expert widths (relative error bound; the same routing, bit for bit);
* under CUDA-graph capture and replay at decode sizes: a replay with new inputs and a different routing gives
  the eager call's bits (nothing about the routing is fixed at capture);
* FP8 experts (e4m3 with per-row or per-tile scales) against the reference on the dequantized experts, full size;
* its peak memory does not depend on the routing (what the KV-sizing pass measures holds for every step);
* the engine (Triton + CUDA graphs) against the torch backend (eager) in bf16 on a small Qwen3-MoE trained on
  the copy task (benchmarks/train_tiny.py --arch qwen3_moe): greedy agreement bound.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

E, H, INTER, K = 128, 2048, 768, 8  # Qwen3-30B-A3B


def _layer(T: int, inter: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, std=0.02):
        return (std * torch.randn(*shape, generator=g, device="cuda")).to(torch.bfloat16)

    x, router = rand(T, H, std=1.0), rand(E, H)
    return x, F.linear(x, router), rand(E, 2 * inter, H), rand(E, H, inter)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("T", [1, 5, 64, 256, 1000, 4096])
def test_full_size_matches_reference(T, tp):
    from nanovllm.kernels.moe import fused_moe
    from nanovllm.kernels.moe_routing import moe_route
    from nanovllm.layers.moe_ref import fused_moe_ref, route_ref
    x, logits, w13, w2 = _layer(T, INTER // tp, seed=T + tp)
    w, ids = moe_route(logits, K, True)
    wr, idr = route_ref(logits, K, True)
    assert torch.equal(ids, idr)  # exact ties go to the lower index in both; bf16 near-ties are far apart
    torch.testing.assert_close(w, wr, atol=1e-5, rtol=1e-5)
    y = fused_moe(x, logits, w13, w2, K, True)
    ref = fused_moe_ref(x, logits, w13, w2, K, True)
    rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    worst = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    print(f"\nT={T} tp={tp}: relative error {rel:.2e} (max abs error / max abs {worst:.2e})")
    assert rel < 1e-2 and worst < 2e-2


def _quantized(w: torch.Tensor, block):
    """Stacked experts (E, N, K) as Fp8MoEMethod (per row, block None) or a block-FP8 checkpoint stores them."""
    from nanovllm.layers.quantization import fp8_ref
    E_, N, K_ = w.shape
    if block is None:
        q, s = fp8_ref.quantize_rows(w.reshape(E_ * N, K_))
        return q.view(E_, N, K_), s.view(E_, N)
    q, s = zip(*(fp8_ref.quantize_blocks(we, block) for we in w))
    return torch.stack(q), torch.stack(s)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per row", "128 x 128 tiles"])
@pytest.mark.parametrize("T", [1, 64, 256, 4096])
def test_fp8_experts_full_size_match_reference(T, block):
    """FP8 experts (``quantization="fp8"``'s one scale per expert and row, or a block-FP8 checkpoint's 128 x 128
    tiles; gate/up on e4m3 activations) at Qwen3-30B-A3B's shapes: the Triton layer against the reference on the
    dequantized experts and quantized inputs, and how far FP8 moves the layer from bf16 (printed; a few % of its
    norm is e4m3's rounding)."""
    from nanovllm.kernels.moe import fused_moe
    from nanovllm.layers.moe_ref import fused_moe_ref
    x, logits, w13, w2 = _layer(T, INTER, seed=T + 11)
    (q13, s13), (q2, s2) = _quantized(w13, block), _quantized(w2, block)
    y = fused_moe(x, logits, q13, q2, K, True, w13_scale=s13, w2_scale=s2, block=block)
    ref = fused_moe_ref(x, logits, q13, q2, K, True, w13_scale=s13, w2_scale=s2, block=block)
    rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    bf16 = fused_moe_ref(x, logits, w13, w2, K, True)
    moved = ((ref.float() - bf16.float()).norm() / bf16.float().norm()).item()
    print(f"\nT={T} FP8 experts ({block or 'per row'}): relative error vs reference {rel:.2e}; FP8 vs bf16 "
          f"{moved:.2e}")
    assert rel < 1e-2 and moved < 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 256])
def test_cuda_graph_replay_matches_eager(T):
    from nanovllm.kernels.moe import fused_moe
    from nanovllm.layers.moe_ref import fused_moe_ref
    x, logits, w13, w2 = _layer(T, INTER, seed=7)
    fused_moe(x, logits, w13, w2, K, True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, logits, w13, w2, K, True)
    for trial in range(3):
        nx, nlogits, _, _ = _layer(T, INTER, seed=100 + trial)
        if trial == 1:  # every token on experts 0..7: 120 experts get nothing, a few blocks get everything
            nlogits[:, :K] += 20.0
        x.copy_(nx)
        logits.copy_(nlogits)
        graph.replay()
        torch.cuda.synchronize()
        eager = fused_moe(nx, nlogits, w13, w2, K, True)
        assert torch.equal(out, eager), f"trial {trial}"
        ref = fused_moe_ref(nx, nlogits, w13, w2, K, True)
        assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


@pytest.mark.gpu
def test_peak_memory_does_not_depend_on_routing():
    from nanovllm.kernels.moe import fused_moe
    T = 8192
    x, logits, w13, w2 = _layer(T, INTER, seed=3)
    skewed = logits.clone()
    skewed[:, :K] += 20.0
    peaks = []
    for lg in (logits, skewed, logits):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fused_moe(x, lg, w13, w2, K, True)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    print(f"\npeak memory of one 8192-token MoE layer: {peaks[0] / 2**20:.1f} MiB (uniform, skewed routing: {peaks})")
    assert len(set(peaks)) == 1


@pytest.mark.gpu
def test_engine_greedy_agreement_on_a_trained_moe(trained_moe_ckpt):
    """Teacher-forced next tokens of the Triton + CUDA-graphs engine against the torch backend, bf16, on copy
    prompts: a trained model predicts them by a clear margin, so two correct engines agree nearly everywhere."""
    from train_tiny import copy_prompts

    from nanovllm import LLM, SamplingParams
    path = trained_moe_ckpt
    prompts = copy_prompts(48, seed=0, max_len=600)
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    forced, ref = {}, None
    for name, kw in (("torch", dict(attention_backend="torch", enforce_eager=True)), ("triton", {})):
        llm = LLM(path, dtype="bfloat16", kvcache_block_size=16, max_num_seqs=128, **kw)
        if ref is None:
            ref = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        contexts = [p + r[:k] for p, r in zip(prompts, ref) for k in range(len(r))]
        forced[name] = [o["token_ids"][0] for o in llm.generate(contexts, one, use_tqdm=False)]
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    agree = sum(a == b for a, b in zip(forced["torch"], forced["triton"]))
    print(f"teacher-forced next token, Triton + graphs vs torch eager (bf16): {agree}/{len(forced['torch'])} "
          f"({100 * agree / len(forced['torch']):.2f}%)")
    assert agree >= 0.99 * len(forced["torch"])
