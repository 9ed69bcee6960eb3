"""All-reduce over NVLink through torch's symmetric memory: the tensor-parallel layers' hot collective.

A row-parallel layer's partial output is at most ``max_num_batched_tokens x hidden`` elements, small enough
that NCCL's latency dominates (on two H200s: ~37 us for a 2 MB decode tensor, 72 of them per Qwen3-8B step).
torch's ``two_shot_all_reduce_`` on a symmetric buffer (each rank reduces its half of the tensor by loading
the peers' halves directly, then gathers the other halves the same way) takes ~13 us for the same tensor.
It uses peer-to-peer loads only, no NVLink multicast.

Each engine owns one ``SymmMemAllReduce`` (built by the model runner, collectively on every rank). It holds
two symmetric buffers used in turn: a layer writes its partial result straight into ``buffer()``, reduces it
in place and hands the buffer on. A result stays valid until the next-but-one reduction, which is enough for
the decoder (each reduced tensor is consumed by the norm right after it). Anything it can't take (another
dtype, a size that doesn't fit or isn't 16-byte divisible per rank) goes through NCCL.

Two ranks: fused with the norm after it
---------------------------------------
Every all-reduce in the decoder is followed by a residual add and an RMSNorm. With two ranks the reduction is
folded into that norm instead (``add_rms_norm_``): one kernel (``nanovllm.kernels.ar_norm``) signals the peer
that this rank's partial is written, waits for the peer's signal, reads this rank's partial and the peer's
(through its peer mapping), adds them and the residual, normalizes and writes the result locally. That
replaces the two-shot kernel (its two barriers, a reduce-scatter and an all-gather over NVLink) plus the
separate norm kernel; both ranks add the same two numbers (IEEE addition is commutative), so they hold the
same bits. (A first version did the
handshake with torch's barrier kernel before the norm kernel: 0.6% slower on the Qwen3-8B benchmark.)

Why a buffer is never overwritten while the peer still reads it: a rank writes a buffer again only two
reductions later. Its peer's program that read it belongs to reduction k; this rank's next write comes after
its own reduction k + 1 finished, which needed the peer's signals of reduction k + 1, which the peer sends
only when its kernel k + 1 starts, that is after its kernel k (the reader) has finished: kernels on one stream
run in order.
"""
from __future__ import annotations

import logging
import math

import torch

logger = logging.getLogger(__name__)


class SymmMemAllReduce:
    def __init__(self, group, rank: int, world_size: int, max_numel: int, dtype: torch.dtype,
                 device: torch.device, fuse_norm: bool = True):
        import torch.distributed._symmetric_memory as symm_mem
        self.group_name = group.group_name
        self.rank = rank
        self.world_size = world_size
        self.dtype = dtype
        self.max_numel = max_numel
        self.bufs, self.handles = [], []
        for _ in range(2):
            buf = symm_mem.empty(max_numel, dtype=dtype, device=device)
            self.handles.append(symm_mem.rendezvous(buf, self.group_name))
            self.bufs.append(buf)
        self._next = 0
        self.fuse_norm = fuse_norm and world_size == 2
        if self.fuse_norm:  # the kernel's handshake counters (nanovllm.kernels.ar_norm)
            from nanovllm.kernels.ar_norm import DEFAULT_PROGRAMS, MAX_PROGRAMS
            self.programs = DEFAULT_PROGRAMS  # programs per fused launch (512 / 1,024 measured no faster)
            self.sig = symm_mem.empty(MAX_PROGRAMS, dtype=torch.int32, device=device)
            sig_handle = symm_mem.rendezvous(self.sig, self.group_name)
            self.sig.zero_()
            self.peer_sig = sig_handle.get_buffer(1 - rank, (MAX_PROGRAMS,), torch.int32)
            torch.cuda.synchronize(device)
            sig_handle.barrier(channel=0)  # both ranks' counters are zero before anyone signals
        # self-test: every rank contributes rank + 1
        t = self.buffer((world_size * 8,), dtype)
        t.fill_(rank + 1)
        self.all_reduce_(t)
        want = world_size * (world_size + 1) / 2
        if not bool((t == want).all()):
            raise RuntimeError(f"symmetric-memory all-reduce self-test gave {t[:4].tolist()}, want {want}")
        if self.fuse_norm:
            self._self_test_fused(group, rank, device)

    def _self_test_fused(self, group, rank: int, device: torch.device) -> None:
        """rank r contributes r + 1 to a (300, 64) tensor (more rows than kernel programs); with a zero residual
        the new residual must be 3. The ranks agree on the outcome, so all of them fuse or none does."""
        import torch.distributed as dist
        try:
            t = self.buffer((300, 64), self.dtype)
            t.fill_(rank + 1)
            zeros = torch.zeros(300, 64, dtype=self.dtype, device=device)
            _, res = self.add_rms_norm_(t, zeros, torch.ones(64, dtype=self.dtype, device=device), 1e-6)
            ok = bool((res == 3).all())
        except Exception as e:  # noqa: BLE001 - the unfused two-shot path still works
            logger.warning("fused all-reduce + norm unavailable (%s: %s); using two-shot", type(e).__name__, e)
            ok = False
        flag = torch.tensor([int(ok)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        if not flag.item():
            self.fuse_norm = False

    @classmethod
    def maybe_create(cls, group, rank: int, world_size: int, max_numel: int, dtype: torch.dtype,
                     device: torch.device) -> SymmMemAllReduce | None:
        """The reducer, or None (NCCL then does every all-reduce) when it is unsupported or failing.
        Every rank must call this at the same point: building it is collective."""
        if device.type != "cuda" or world_size < 2 or dtype not in (torch.bfloat16, torch.float32):
            return None
        try:
            return cls(group, rank, world_size, max_numel, dtype, device)
        except Exception as e:  # noqa: BLE001 - any failure here means "use NCCL"
            logger.warning("symmetric-memory all-reduce unavailable (%s: %s); using NCCL", type(e).__name__, e)
            return None

    def fits(self, numel: int, dtype: torch.dtype) -> bool:
        return (dtype == self.dtype and 0 < numel <= self.max_numel
                and (numel * self.bufs[0].element_size()) % (16 * self.world_size) == 0)

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The next free symmetric buffer viewed as ``shape``, or None if such a tensor can't go this way."""
        numel = math.prod(shape)
        if not self.fits(numel, dtype):
            return None
        buf = self.bufs[self._next]
        self._next ^= 1
        return buf[:numel].view(shape)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (a view from ``buffer()``) over the ranks, in place."""
        torch.ops.symm_mem.two_shot_all_reduce_(t, "sum", self.group_name)
        return t

    def _index(self, t: torch.Tensor) -> int | None:
        """Which buffer ``t`` is a view from ``buffer()`` of, or None."""
        for i, buf in enumerate(self.bufs):
            if t.data_ptr() == buf.data_ptr() and t.is_contiguous():
                return i
        return None

    def owns(self, t: torch.Tensor) -> bool:
        return self._index(t) is not None

    def can_fuse_norm(self, t: torch.Tensor) -> bool:
        """Whether ``add_rms_norm_`` can take ``t`` (2-D, from ``buffer()``)."""
        return self.fuse_norm and t.dim() == 2 and self.owns(t)

    def add_rms_norm_(self, t: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``add_rms_norm(sum over the two ranks of t, residual, weight, eps)`` -> (normed, new residual), the
        reduction fused into the norm kernel. ``t`` must pass ``can_fuse_norm``; the peer must make the same
        call."""
        from nanovllm.kernels.ar_norm import two_rank_add_rms_norm
        peer = self.handles[self._index(t)].get_buffer(1 - self.rank, tuple(t.shape), t.dtype)
        return two_rank_add_rms_norm(t, peer, residual, weight, eps, self.sig, self.peer_sig, self.programs)
