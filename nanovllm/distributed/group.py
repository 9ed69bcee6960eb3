"""The tensor-parallel group handed to every sharded layer (no global state: each engine owns its own)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            import torch.distributed as dist
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's x along the last dim, rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def check_tp_supported(tp_size: int, model_cfg, device: torch.device) -> None:
    """Raise ValueError if this model can't be split over `tp_size` ranks on `device`."""
    raise ValueError(f"tensor_parallel_size={tp_size} is not supported yet; use tensor_parallel_size=1")
