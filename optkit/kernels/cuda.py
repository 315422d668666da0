"""CUDA weight-only kernels: ``cuda-int4-tinygemm`` and ``cuda-int8-weightonly``.

Written against torch 2.13's ops and tested only where a GPU exists (``pytest -m gpu``); their
speed has not been measured by this project yet, so neither switches paths by M the way the CPU
kernels do (tinygemm is known to fall behind a dense bf16 GEMM for large M; measure before
adding a threshold).

``cuda-int4-tinygemm``: ``aten._convert_weight_to_int4pack(u8 (N, K/2), inner_k_tiles)`` takes
nibbles packed two per byte with the *even* column in the high nibble, and returns the
tensor-core tiled int32 layout ``(N/8, K/(inner_k_tiles*16), 32, inner_k_tiles/2)``;
``aten._weight_int4pack_mm(x bf16, packed, group, scales_and_zeros bf16 (K/g, N, 2))`` computes
``w = (u - 8) * scale + zero`` (see :mod:`optkit.kernels.int4`). It needs sm80+, bf16 inputs,
K a multiple of 32 (of ``inner_k_tiles * 16``) and N a multiple of 8 (we pad rows).

``cuda-int8-weightonly``: per-channel symmetric int8. ``aten._weight_int8pack_mm`` when this torch
has a CUDA kernel for it (added in 2025), else ``x @ (q.to(dtype) * s)^T`` built per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from optkit.kernels.base import LinearKernel, bias_buffer, build_per_channel, common_reason, per_channel_reason
from optkit.kernels.int4 import group_reason, kernel_group, round_up, scales_and_zeros, unsigned_codes


def _has_cuda_kernel(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")


def _inner_k_tiles(in_features: int) -> int:
    """Widest tile the packing accepts: K must be a multiple of ``inner_k_tiles * 16``."""
    return next(t for t in (8, 4, 2) if in_features % (t * 16) == 0)


class CudaInt4Tinygemm(LinearKernel):
    """Int4 weight-only on CUDA (bf16).

    Buffers: ``packed`` int32 ``(n_pad/8, in/(t*16), 32, t/2)`` (tinygemm layout, ``t`` =
    inner k tiles, ``n_pad`` = out rounded up to 8); ``scales_and_zeros`` bf16 ``(in/g, n_pad, 2)``; ``bias``.
    """

    name = "cuda-int4-tinygemm"

    @classmethod
    def unavailable_reason(cls, scheme, device, dtype, shape):
        reason = common_reason(scheme, device, dtype, device_type="cuda", dtypes=(torch.bfloat16,), bits=(4,))
        if reason:
            return reason
        if not _has_cuda_kernel("aten::_weight_int4pack_mm"):
            return "this torch build has no CUDA kernel for aten._weight_int4pack_mm"
        if torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 0):
            return f"needs compute capability 8.0+ (tensor-core bf16), this GPU is {torch.cuda.get_device_capability(device)}"
        reason = group_reason(scheme, shape)
        if reason:
            return reason
        if shape is not None and shape[1] % 32:
            return f"needs in_features % 32 == 0, got {shape[1]}"
        return None

    @classmethod
    def build(cls, qw, weight, bias, device, dtype):
        out_f, in_f = qw.q.shape
        k = cls(in_f, out_f, qw.scheme, dtype)
        k.group = kernel_group(qw.scheme, in_f)
        k.n_pad = round_up(out_f, 8)
        u = unsigned_codes(qw.q.to(device), k.n_pad).to(torch.uint8)  # (n_pad, in) in [0, 15]
        u8 = (u[:, ::2] << 4) | u[:, 1::2]  # (n_pad, in/2): even column in the high nibble
        k.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack(u8.contiguous(), _inner_k_tiles(in_f)))
        k.register_buffer("scales_and_zeros", scales_and_zeros(qw, k.group, k.n_pad, torch.bfloat16).to(device))
        k.register_buffer("bias", bias_buffer(bias, device, dtype))
        return k

    def _mm(self, x):
        y = torch.ops.aten._weight_int4pack_mm(x.contiguous(), self.packed, self.group, self.scales_and_zeros)
        y = y[:, : self.out_features]  # drop the padded rows' outputs
        return y.contiguous() if self.bias is None else y + self.bias


class CudaInt8WeightOnly(LinearKernel):
    """Int8 weight-only, per-channel symmetric, on CUDA.

    Buffers: ``qweight`` int8 ``(out, in)``; ``scales`` ``(out,)`` in the compute dtype; ``bias``.
    """

    name = "cuda-int8-weightonly"

    @classmethod
    def unavailable_reason(cls, scheme, device, dtype, shape):
        reason = common_reason(scheme, device, dtype, device_type="cuda", bits=(8,))
        if reason:
            return reason
        return per_channel_reason(scheme)

    @classmethod
    def build(cls, qw, weight, bias, device, dtype):
        in_f = qw.q.shape[1]
        k = build_per_channel(cls, qw, bias, device, dtype)
        # The CPU op silently miscomputes when in % 16 != 0; hold the CUDA one to the same rule.
        k.use_op = _has_cuda_kernel("aten::_weight_int8pack_mm") and in_f % 16 == 0
        return k

    def _mm(self, x):
        if self.use_op:
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, self.scales)
            return y if self.bias is None else y.add_(self.bias)
        w = self.qweight.to(x.dtype).mul_(self.scales.unsqueeze(1))  # (out, in), transient
        return F.linear(x, w, self.bias)
