"""Kernel tests run on CUDA when present, else on CPU under the Triton interpreter.

TRITON_INTERPRET must be set before triton (or any kernel module) is imported, hence at conftest import time.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nanovllm.kernels import triton_available  # noqa: E402  (does not import triton itself)

if not triton_available():
    collect_ignore_glob = ["test_*.py"]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE
