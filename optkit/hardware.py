"""What this machine computes fast: shared by the pipeline and the runner."""

from __future__ import annotations

import torch


def resolve_compute_dtype(choice: str, device: torch.device | None = None) -> torch.dtype:
    """'auto' -> bfloat16 where matmuls in it are fast, else float32."""
    if choice == "float32":
        return torch.float32
    if choice == "bfloat16":
        return torch.bfloat16
    device = device or torch.device("cpu")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    fast = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return torch.bfloat16 if fast else torch.float32


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peak_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> dict:
    """Read bandwidth: ``sum()`` over a buffer larger than the last-level cache (1 GiB), the
    best of ``repeats`` (a peak is what the hardware can do, so the best run, not the median)."""
    import time

    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        _sync(device)
        t = time.perf_counter()
        x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    del x
    return {"read_gb_s": nbytes / best / 1e9, "buffer_bytes": nbytes,
            "method": "max over runs of sum() over a 1 GiB float32 buffer"}


def measure_peak_matmul(device: torch.device, dtype: torch.dtype, n: int | None = None, repeats: int = 5) -> dict:
    """Matmul throughput: the best of ``repeats`` square ``n x n`` products (2 n^3 FLOPs each);
    n = 2048 on CPU, 8192 on a GPU (large enough to reach the roof, short enough to probe fast)."""
    import time

    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        _sync(device)
        t = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return {"tflops": 2 * n**3 / best / 1e12, "n": n, "dtype": str(dtype).removeprefix("torch."),
            "method": f"max over runs of a {n}x{n} @ {n}x{n} matmul"}
