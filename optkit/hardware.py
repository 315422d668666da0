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
