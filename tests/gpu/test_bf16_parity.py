"""Triton kernels + CUDA graphs give the greedy tokens of the torch backend (eager, plain-torch attention).

Teacher-forced (tests.gpu.engines.teacher_forced_agreement): at every position of torch eager's greedy
continuation both engines get the same context, and their next tokens are compared. float32: every position.
bf16 on a model trained on a copy task (clear margins, like a real model): >= 99% (measured: 100%). bf16 on
random weights, whose top-2 logits are a few bf16 ulps apart almost everywhere, so that two correct engines
round differently: >= 95% (measured: 97.2-97.3%).
"""
import pytest

from tests.gpu.engines import ARCH, random_prompts, teacher_forced_agreement

pytestmark = pytest.mark.gpu

TORCH_EAGER = dict(attention_backend="torch", enforce_eager=True)
TRITON_GRAPHS = dict()  # the defaults on CUDA: Triton kernels, CUDA graphs


def report(capsys, what, agree):
    with capsys.disabled():
        print(f"\n{what}: Triton + CUDA graphs pick torch eager's next token at {agree:.2%} of positions")


def test_float32_every_position(tiny_ckpt, capsys):
    agree = teacher_forced_agreement(tiny_ckpt("qwen3", **ARCH), random_prompts(16), [TORCH_EAGER, TRITON_GRAPHS],
                                     dtype="float32")
    report(capsys, "float32, random weights", agree)
    assert agree == 1.0


def test_bf16_trained_model(trained_ckpt, capsys):
    import train_tiny  # (benchmarks/, on the path through tests/gpu/conftest.py)

    prompts = train_tiny.copy_prompts(64, seed=0, max_len=600)
    agree = teacher_forced_agreement(trained_ckpt, prompts, [TORCH_EAGER, TRITON_GRAPHS], dtype="bfloat16")
    report(capsys, "bf16, copy-task model", agree)
    assert agree >= 0.99


def test_bf16_random_weights(tiny_ckpt, capsys):
    agree = teacher_forced_agreement(tiny_ckpt("qwen3", **ARCH), random_prompts(64), [TORCH_EAGER, TRITON_GRAPHS],
                                     dtype="bfloat16")
    report(capsys, "bf16, random weights (near-ties)", agree)
    assert agree >= 0.95
