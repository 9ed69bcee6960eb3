"""An engine core that fails on purpose (a `make_core` for the engine-core process of the fault tests): a step
raises once for every request whose prompt starts with POISON, as a device error would."""
from __future__ import annotations

from nanovllm.engine.core import EngineCore

POISON = [7, 7, 7]


class FaultyCore(EngineCore):
    def __init__(self, engine):
        super().__init__(engine)
        self.failed_for: set[str] = set()

    def step(self):
        for rid, seqs in self.engine.requests.items():   # request id -> its samples
            if seqs[0].prompt_token_ids[:len(POISON)] == POISON and rid not in self.failed_for:
                self.failed_for.add(rid)
                raise RuntimeError("simulated device failure")
        return super().step()


def make_faulty_core(args) -> FaultyCore:
    return FaultyCore.from_args(args)
