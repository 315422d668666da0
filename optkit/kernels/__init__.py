"""Quantized matmul kernels per device, each tested against the pure-torch reference.

``build_linear(qw, weight, bias, device, dtype, kernel="auto")`` packs one linear layer's
weight into a :class:`LinearKernel` (``y = x @ W^T + b``); nothing is dequantized to 16 bits on
load. Registered kernels, in ``auto``'s preference order:

=====================  ========  ==========================================================
name                   device    runs
=====================  ========  ==========================================================
cuda-w8a8-intmm        cuda      W8A8 per-channel symmetric (``torch._int_mm``)
cuda-int4-tinygemm     cuda      int4 weight-only, bf16 (``aten._weight_int4pack_mm``)
cuda-int8-weightonly   cuda      int8 per-channel symmetric weight-only
cpu-w8a8-intmm         cpu       W8A8 per-channel symmetric (``torch._int_mm``)
cpu-int4pack           cpu       int4 weight-only, any group multiple of 32 or per channel
cpu-int8pack           cpu       int8 per-channel symmetric weight-only
dense                  any       float (unquantized) weights: ``F.linear``
dequant                any       every scheme: reference dequantize per call (slow path)
=====================  ========  ==========================================================

The CPU weight-only kernels switch by batch rows: torch's GEMV op for small M, the weight
rebuilt from the packed storage + one dense matmul above (measured thresholds in
:mod:`optkit.kernels.cpu`). fp8 kernels are not here: artifact schemes are integer only.
"""

from optkit.kernels.base import KernelUnavailableError, LinearKernel
from optkit.kernels.registry import KERNELS, build_linear, kernel_candidates, register_kernel

__all__ = ["KERNELS", "KernelUnavailableError", "LinearKernel", "build_linear", "kernel_candidates", "register_kernel"]
