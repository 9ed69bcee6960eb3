"""GPU tests (`pytest -m gpu` on a CUDA machine; skipped without CUDA by tests/conftest.py): fixtures.

A tiny checkpoint trained on benchmarks/train_tiny.py's copy task (once per session, ~30 s on an H200), and
the device's cached memory returned after every test, so that each engine sizes its KV cache from a clean GPU.
"""
import json
import os
import sys

import pytest

from tests.gpu.engines import free_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.join(ROOT, "benchmarks"))  # (after the installed packages: no shadowing)


@pytest.fixture(autouse=True)
def _free_gpu_after():
    yield
    free_gpu()


@pytest.fixture(scope="session")
def trained_ckpt(tmp_path_factory):
    """Path of the parity architecture trained on the periodic-copy task (train_tiny's defaults: seed 0, 1,000
    steps), which predicts its next tokens by clear margins, as a real model does."""
    import train_tiny

    path = train_tiny.train_copy_checkpoint(str(tmp_path_factory.mktemp("copy-task") / "m"), device="cuda")
    with open(os.path.join(path, train_tiny.META_FILE)) as f:
        accuracy = json.load(f)["accuracy"]
    if accuracy < train_tiny.MIN_ACCURACY:
        pytest.fail(f"train_tiny did not learn the copy task (held-out accuracy {accuracy:.1%}): a parity check on "
                    f"it would say nothing; see train_tiny's docstring on seeds and steps")
    free_gpu()
    return path


@pytest.fixture(scope="session")
def trained_moe_ckpt(tmp_path_factory):
    """Path of a Qwen3-MoE (train_tiny's MOE_ARCH: layer 0 dense, then 8 experts, top-2) trained on the copy task.
    The task is learned in a sudden phase change whose step depends on the seed: seed 1 is tried if seed 0's run
    has not learned it."""
    import train_tiny

    for seed in (0, 1):
        path = train_tiny.train_copy_checkpoint(str(tmp_path_factory.mktemp("copy-task-moe") / f"m{seed}"),
                                                device="cuda", seed=seed, model_arch="qwen3_moe",
                                                **train_tiny.ARCH, **train_tiny.MOE_ARCH)
        with open(os.path.join(path, train_tiny.META_FILE)) as f:
            accuracy = json.load(f)["accuracy"]
        if accuracy >= train_tiny.MIN_ACCURACY:
            break
    free_gpu()
    if accuracy < train_tiny.MIN_ACCURACY:
        pytest.fail(f"train_tiny did not learn the copy task with a Qwen3-MoE (held-out accuracy {accuracy:.1%} "
                    f"with seeds 0 and 1)")
    print(f"\ntrained Qwen3-MoE: held-out copy accuracy {accuracy:.3f} (seed {seed})")
    return path
