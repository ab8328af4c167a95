"""Measurements the benchmarks share: memory (the process's peak RSS, a sampler of it, the kernel's
high-water mark), the bytes tensors hold, wall time, the machine's matmul peak, medians."""

from __future__ import annotations

import re
import resource
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

MB = 2**20


# ----------------------------------------------------------------------------- memory
def rss() -> int:
    """The process's resident set size now, bytes."""
    import psutil

    return psutil.Process().memory_info().rss


def peak_rss_mb() -> float:
    """The process's peak RSS so far (``ru_maxrss``, model loading included), MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def kernel_peak() -> int | None:
    """The kernel's high-water mark of this process's RSS (``VmHWM``) since the last reset, bytes."""
    m = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(m.group(1)) * 1024 if m else None


def reset_kernel_peak() -> bool:
    """Reset the kernel's high-water mark to the current RSS; False where the kernel refuses."""
    try:  # "5": reset the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """The process's peak RSS while the block runs, sampled every ``interval`` seconds in a thread,
    and the kernel's own high-water mark over the block where it can be reset (``kernel_peak``)."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.peak = 0
        self.kernel_peak: int | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._hwm_reset = False

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.interval)

    def __enter__(self):
        self.peak = rss()
        self._hwm_reset = reset_kernel_peak()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        if self._hwm_reset:
            self.kernel_peak = kernel_peak()


def read_weights(models) -> None:
    """Read every weight once. ``from_pretrained`` maps safetensors files into memory lazily: a
    weight enters the RSS when first read (and becomes private memory when first written). The
    first rollout reads them all anyway; reading them before the "loaded" sample puts them in
    ``models_mb`` rather than in the peak above it, on both sides alike."""
    import torch

    with torch.no_grad():
        for m in models:
            for p in m.parameters():
                p.detach().sum()


# ----------------------------------------------------------------------------- tensors
def tensor_bytes(tensors: Iterable) -> int:
    """Bytes of ``tensors`` held by this process: a DTensor counts its local shard, a tensor seen
    twice (a tied weight, one storage behind two names) once; None entries are skipped."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        key = (t.data_ptr(), t.numel(), t.dtype)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def optimizer_tensors(optimizer):
    """Every tensor in ``optimizer.state`` (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``)."""
    import torch

    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v


# ----------------------------------------------------------------------------- time
def timed(fn: Callable[[], Any], sync: Callable[[], None] | None = None) -> tuple[Any, float]:
    """``fn()`` and its wall time in seconds; ``sync`` (a device synchronisation) runs before the
    clock starts and before it stops."""
    if sync:
        sync()
    t0 = time.perf_counter()
    out = fn()
    if sync:
        sync()
    return out, time.perf_counter() - t0


def gemm_peak_gflops(dtype: str = "float32", n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of one ``n x n`` by ``n x n`` matmul in ``dtype``, on this machine at torch's
    current thread count: the best of ``repeats`` after a warm-up, counted as the profiler counts
    a matmul (2 n^3 FLOPs). The ceiling an iteration's matmuls are held against (its MFU): a GEMM
    this size runs near the library's best, so what an iteration falls short of it is the
    smaller, thinner shapes of its own matmuls plus the time it spends outside them."""
    import torch

    a = torch.randn(n, n).to(getattr(torch, dtype))
    b = torch.randn(n, n).to(getattr(torch, dtype))
    torch.mm(a, b)
    best = min(timed(lambda: torch.mm(a, b))[1] for _ in range(repeats))
    return 2 * n**3 / best / 1e9


# ----------------------------------------------------------------------------- medians
def median_of(rows: Iterable[dict], key: str) -> float:
    """The median of ``row[key]`` over ``rows``."""
    return statistics.median(r[key] for r in rows)
