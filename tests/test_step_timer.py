"""The benchmark hooks read from the environment: off by default and on CPU, specs checked."""
from __future__ import annotations

import pytest
import torch

from nanovllm.engine.step_timer import ENV, PROFILE_ENV, StepProfiler, StepTimer

CUDA = torch.device("cuda")  # parsing only: nothing here touches a GPU


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    assert StepTimer.from_env(CUDA, 0) is None
    assert StepProfiler.from_env(CUDA, 0) == []
    monkeypatch.setenv(ENV, "/tmp/steps")
    monkeypatch.setenv(PROFILE_ENV, "/tmp/p:1:2")
    assert StepTimer.from_env(torch.device("cpu"), 0) is None      # CUDA events only
    assert StepProfiler.from_env(torch.device("cpu"), 0) == []
    assert StepTimer.from_env(CUDA, 1).path == "/tmp/steps.rank1.json"


def test_profile_specs(monkeypatch):
    monkeypatch.setenv(PROFILE_ENV, "/tmp/a:300:3:decode,/tmp/b:2:1:prefill,/tmp/c:0:5")
    a, b, c = StepProfiler.from_env(CUDA, 1)
    assert (a.path, a.first, a.count, a.kind) == ("/tmp/a.rank1.txt", 300, 3, "decode")
    assert (b.kind, c.kind) == ("prefill", None)
    # a decode-only profiler counts decode steps only: 300 of them pass before it starts
    assert a._counts(True) and not a._counts(False) and b._counts(False) and c._counts(True)
    for bad in ("/tmp/a:1", "/tmp/a:x:1", "/tmp/a:1:0", "/tmp/a:1:2:mixed", ":1:2"):
        monkeypatch.setenv(PROFILE_ENV, bad)
        with pytest.raises(ValueError, match=PROFILE_ENV):
            StepProfiler.from_env(CUDA, 0)
