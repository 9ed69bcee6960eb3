"""What the engine drives: the `Executor` protocol (one `ModelRunner` in-process, or the tensor-parallel
`TPExecutor` over worker processes), the handle of a launched step, and what a step produces."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from nanovllm.engine.batch import StepBatch


@dataclass
class StepResult:
    """What one step produced, on the host, row by row over the batch's logits rows."""
    token_ids: list[int]
    logprobs: list[float] | None = None      # raw log-probability of each sampled token (when asked for)
    ranks: list[int] | None = None           # its 1-based rank
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # speculative decoding: accepted draft tokens of each verifying sequence (SamplingBatch.drafts order)
    num_accepted: list[int] | None = None
    # prompt_logprobs: per StepBatch.prompt_lp_rows row, the next prompt token's, its rank, the top tokens
    prompt_logprobs: list[float] | None = None
    prompt_ranks: list[int] | None = None
    prompt_top_ids: list[list[int]] | None = None
    prompt_top_logprobs: list[list[float]] | None = None


class StepHandle(Protocol):
    def sample(self, late) -> None:
        """Sample a deferred step (StepBatch.sampling.deferred) with its LateInputs; before the next launch."""

    def result(self) -> StepResult | None:
        """Wait for the step; its StepResult (on the rank that samples; None on the others)."""


class Executor(Protocol):
    num_kvcache_blocks: int
    # start-up timings in seconds (the slowest rank's under tensor parallelism)
    load_seconds: float
    kv_seconds: float
    gemm_plan_seconds: float
    capture_seconds: float

    @property
    def is_alive(self) -> bool:
        """False once shut down or failed (a tensor-parallel worker died): no step can run."""

    def launch(self, batch: StepBatch) -> StepHandle:
        """Enqueue one step and return at once. Placeholder inputs (async scheduling) read the sampled ids of
        the step launched just before, which stay on the device."""

    def execute(self, batch: StepBatch) -> StepResult | None:
        """Run one step and wait for it."""

    def shutdown(self) -> None:
        """Release everything; idempotent. No step can run afterwards."""
