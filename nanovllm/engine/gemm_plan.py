"""Which GEMM each linear layer uses at each CUDA-graph batch size, chosen by timing them once at startup.

At decode batch sizes no single GEMM library wins everywhere: on an H200, cuBLAS and cuBLASLt trade places by
10-30% from one (layer, rows) pair to the next, and at <= 32 rows the swapped-tile Triton kernel
(``nanovllm.kernels.matmul``) is up to 11% faster than either for some shapes (measured in RESULTS run 16).
So before
the decode graphs are captured, the runner times each candidate on the real weights: for every distinct
(out, in) weight shape, one CUDA graph runs the product with *every* layer of that shape in turn (so the
weights stream from HBM as in a real step, not from L2), for each graph batch size. A candidate replaces
torch's default (``F.linear``) only when it is at least ``margin`` faster, so near-ties keep the default and
the choice (hence the output bits) is stable from run to run.

The choice goes into the ``GemmPlan`` of the layers' ``UnquantizedLinearMethod`` ((out, in) -> rows -> backend)
and is used for exactly those row counts (the decode and mixed-step graph sizes the runner passes); every other
product stays ``F.linear``.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

import torch

from nanovllm.layers.linear import LinearBase, UnquantizedLinearMethod

logger = logging.getLogger(__name__)

BLAS_LIBRARIES = ("cublas", "cublaslt")
TRITON_MAX_ROWS = 32  # the swapped-tile kernel beat cuBLAS only up to here in the sweep


@dataclass(frozen=True)
class GemmBackend:
    """``y = x @ w.T`` by one library: "cublas" or "cublaslt" (torch.mm under that BLAS preference), or
    "triton" (``nanovllm.kernels.matmul.linear`` with ``config``)."""
    name: str
    config: object | None = None  # a MatmulConfig for "triton"

    def __post_init__(self):
        if self.name not in (*BLAS_LIBRARIES, "triton"):
            raise ValueError(f"unknown GEMM backend {self.name!r}; expected one of {(*BLAS_LIBRARIES, 'triton')}")
        if (self.name == "triton") != (self.config is not None):
            raise ValueError(f"GEMM backend {self.name!r}: a config goes with 'triton' and only with it")

    def __call__(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.name == "triton":
            from nanovllm.kernels.matmul import linear
            return linear(x, w, self.config, out)
        prev = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(self.name)
        try:
            return torch.mm(x, w.t(), out=out)
        finally:
            torch.backends.cuda.preferred_blas_library(prev)

    def __str__(self) -> str:
        if self.config is None:
            return self.name
        c = self.config
        return f"triton:{'swap' if c.swap else 'plain'}{c.block_m}x{c.block_n}x{c.block_k}s{c.splits}st{c.num_stages}"


def triton_candidates(rows: int, K: int) -> list[GemmBackend]:
    """Swapped-tile configs for few rows: the sweep's (and the engine's) winners at <= 32 rows, 16-row x 64-output
    tiles over 128 or 256 of K, 5 stages. Two configs only: each is one Triton compile at startup."""
    if rows > TRITON_MAX_ROWS:
        return []
    from nanovllm.kernels.matmul import MatmulConfig
    out = []
    for bk in (128, 256):
        cfg = MatmulConfig(16, 64, bk, swap=True, num_warps=4, num_stages=5)
        if cfg.fits(K):
            out.append(GemmBackend("triton", cfg))
    return out


def _precompile(backends: set[GemmBackend], dtype: torch.dtype, device: torch.device) -> set[GemmBackend]:
    """Compile the Triton candidates side by side (threads overlap the compiler subprocesses); returns the ones
    that fail to build here (not candidates then)."""
    from concurrent.futures import ThreadPoolExecutor
    x = torch.zeros(16, 256 * 4, dtype=dtype, device=device)
    w = torch.zeros(64, 256 * 4, dtype=dtype, device=device)

    def build(b):
        try:
            b(x, w)
            return None
        except Exception as e:
            logger.debug("GEMM candidate %s does not build: %s", b, e)
            return b

    with ThreadPoolExecutor(max(1, len(backends))) as pool:
        return {b for b in pool.map(build, backends) if b is not None}


def graph_seconds(fn, reps: int = 3) -> float:
    """Seconds for one run of fn, from a CUDA graph of it replayed ``reps`` times (after a warm-up)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def _run_all(backend, x, weights, out):
    def fn():
        for w in weights:
            if backend is None:  # what F.linear runs without a bias, under torch's BLAS preference
                torch.mm(x, w.t(), out=out)
            else:
                backend(x, w, out)
    return fn


def time_product(backend: GemmBackend | None, x: torch.Tensor, weights: list[torch.Tensor], out: torch.Tensor
                 ) -> float:
    """Seconds for ``x @ w.T`` with every weight in turn, by ``backend`` (None: torch's default), on CUDA."""
    return graph_seconds(_run_all(backend, x, weights, out))


def plan_gemms(model: torch.nn.Module, sizes: list[int], *, use_triton: bool, margin: float = 0.05,
               time_fn=time_product) -> dict[tuple[int, int], dict[int, GemmBackend]]:
    """Time the candidates (``time_fn``, CUDA graphs by default) and fill the ``GemmPlan`` of every bias-free
    unquantized linear layer of ``model``.

    Returns {(N, K): {rows: chosen backend}} for the rows where something beat the default by ``margin``."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    groups: dict[tuple[int, int], list[LinearBase]] = defaultdict(list)
    for m in model.modules():
        if isinstance(m, LinearBase) and isinstance(m.method, UnquantizedLinearMethod) and m.bias is None:
            groups[tuple(m.weight.shape)].append(m)
    # torch's current preference ("cublas" unless changed): what the default product already runs
    default_lib = str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1].lower()
    plan: dict[tuple[int, int], dict[int, GemmBackend]] = {}
    broken: set[GemmBackend] = set()
    if use_triton and groups:
        w0 = next(iter(groups.values()))[0].weight
        broken = _precompile({b for rows in sizes for (_, K) in groups for b in triton_candidates(rows, K)},
                             w0.dtype, w0.device)
    for (N, K), layers in groups.items():
        weights = [m.weight for m in layers]
        w0 = weights[0]
        chosen: dict[int, GemmBackend] = {}
        for rows in sizes:
            x = torch.randn(rows, K, device=w0.device, dtype=w0.dtype)
            out = torch.empty(rows, N, device=w0.device, dtype=w0.dtype)
            base = time_fn(None, x, weights, out)
            best, best_t = None, base * (1.0 - margin)
            cands = [GemmBackend(lib) for lib in BLAS_LIBRARIES if lib != default_lib]  # the default is timed
            if use_triton:
                cands += [b for b in triton_candidates(rows, K) if b not in broken]
            for cand in cands:
                try:
                    t = time_fn(cand, x, weights, out)
                except Exception as e:  # a config this GPU can't run (shared memory, ...): not a candidate
                    logger.debug("GEMM candidate %s failed for (%d, %d) x %d rows: %s", cand, N, K, rows, e)
                    continue
                if t < best_t:
                    best, best_t = cand, t
            if best is not None:
                chosen[rows] = best
                logger.debug("GEMM (%d, %d) x %d rows: %s %.1f us vs default %.1f us", N, K, rows, best,
                             best_t * 1e6 / len(weights), base * 1e6 / len(weights))
        if chosen:
            for layer_plan in {id(m.method.plan): m.method.plan for m in layers}.values():
                layer_plan.choices[(N, K)] = dict(chosen)
            plan[(N, K)] = chosen
    return plan


def describe(plan: dict[tuple[int, int], dict[int, GemmBackend]]) -> str:
    """One line per weight shape: 'N x K: rows=backend, ...'."""
    return "; ".join(f"{N}x{K}: " + ", ".join(f"{r}={b}" for r, b in sorted(c.items()))
                     for (N, K), c in plan.items()) or "default everywhere"
