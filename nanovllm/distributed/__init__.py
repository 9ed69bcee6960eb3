"""Tensor parallelism: the group a model's layers shard over."""
from nanovllm.distributed.group import TPGroup, check_tp_supported

__all__ = ["TPGroup", "check_tp_supported"]
