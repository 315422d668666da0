"""W8A8 kernels: int8 activations x int8 weights on the integer GEMM ``torch._int_mm``.

    x_q, s_x = quantize(x)                      per token: s_x = max|x_t| / 127.5, x_q = clamp(round(x / s_x), -128, 127)
    acc      = x_q @ W_q^T                      int32 (M, N), exact
    y        = acc * s_x * s_w + b              s_x (M, 1), s_w (1, N), in float32, then the compute dtype

The quantizer repeats :func:`optkit.quantize.algorithms.smoothquant.quantize_activation_per_token`
op for op, so the integer codes are the reference's. Weights must be per-channel symmetric
(int8, or int4 codes, which are valid int8 values).

``_int_mm`` wants ``W_q^T`` as the transposed view of the row-major ``(N, K)`` codes: on CPU
that is ~20x faster than a contiguous ``(K, N)`` copy (0.08 vs 1.7 ms, 3072x576, M=1). On CPU the
whole kernel (3072x576, 2 threads, ``python -m optkit.kernels.bench``) takes 0.14 ms at M=1,
0.28 at M=32, 1.73 at M=512 in bf16 (dense bf16 ``F.linear``: 0.14, 0.16, 0.83) and 1.64 ms at
M=512 in float32 (dense: 5.7), so it keeps one path for every M. The CPU op takes any M, K, N
(checked M=1..32, K=36..520, N=20..260). (Fake-quantized x times a
rebuilt bf16 W would take ~1.2 ms at M=512: a possible prefill path, not taken.) On CUDA it
needs M > 16 (we pad with zero rows) and K, N multiples of 8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from optkit.kernels.base import LinearKernel, build_per_channel, common_reason, per_channel_reason
from optkit.kernels.compiled import COMPILE_MIN_WEIGHTS, LazyCompiled


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``(M, K)`` -> int8 codes ``(M, K)`` and float32 scales ``(M, 1)`` (the reference's convention)."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.5  # (M, 1): (qmax - qmin) / 2
    return torch.clamp(torch.round(xf / s), -128, 127).to(torch.int8), s


def _epilogue(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int32 ``(M, N)`` x ``s_x`` ``(M, 1)`` x ``s_w`` ``(N,)`` in float32 -> ``dtype``."""
    return (acc.float() * sx * sw).to(dtype)


def _w8a8_mm(x: torch.Tensor, qweight: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    xq, sx = quantize_per_token(x)  # (M, K) int8, (M, 1) fp32
    return _epilogue(torch._int_mm(xq, qweight.t()), sx, sw, x.dtype)  # (M, N)


#: Rows from which the CPU path runs compiled (quantize and epilogue fused, one graph around the
#: _int_mm call). 3072x576, 1 thread, M=512: quantize 0.58 -> ~0.1 ms, epilogue 1.5 -> ~0.3 ms;
#: below ~64 rows the compiled call's fixed cost (~0.07 ms of guards) outweighs the gain.
COMPILED_MIN_M = 64
_w8a8_mm_compiled = LazyCompiled(_w8a8_mm)


class _W8A8IntMM(LinearKernel):
    """Buffers: ``qweight`` int8 ``(out, in)`` row-major; ``weight_scale`` float32 ``(out,)``; ``bias``."""

    device_type: str = ""
    min_m: int = 1  # _int_mm's smallest M on this device; smaller batches are zero-padded

    @classmethod
    def unavailable_reason(cls, scheme, device, dtype, shape):
        reason = common_reason(scheme, device, dtype, device_type=cls.device_type, act_bits=8)
        if reason:
            return reason
        if per_channel_reason(scheme):
            return per_channel_reason(scheme, "the int32 GEMM has one scale per output row")
        if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_int_mm", cls.device_type.upper()):
            return f"this torch build has no {cls.device_type} kernel for aten._int_mm"
        return cls._shape_reason(shape)

    @classmethod
    def _shape_reason(cls, shape: tuple[int, int] | None) -> str | None:
        return None

    @classmethod
    def build(cls, qw, weight, bias, device, dtype):
        return build_per_channel(cls, qw, bias, device, dtype, scale_name="weight_scale", scale_dtype=torch.float32)

    def _mm(self, x):
        m = x.shape[0]
        if x.device.type == "cpu" and m >= COMPILED_MIN_M and self.qweight.numel() >= COMPILE_MIN_WEIGHTS:
            y = _w8a8_mm_compiled(x, self.qweight, self.weight_scale)
        else:
            xq, sx = quantize_per_token(x)  # (M, K) int8, (M, 1) fp32
            if m < self.min_m:
                xq = F.pad(xq, (0, 0, 0, self.min_m - m))
            acc = torch._int_mm(xq, self.qweight.t())[:m]  # (M, N) int32
            y = _epilogue(acc, sx, self.weight_scale, x.dtype)
        return y if self.bias is None else y.add_(self.bias)


class CpuW8A8IntMM(_W8A8IntMM):
    name = "cpu-w8a8-intmm"
    device_type = "cpu"


class CudaW8A8IntMM(_W8A8IntMM):
    name = "cuda-w8a8-intmm"
    device_type = "cuda"
    min_m = 17  # cuBLASLt int8 GEMM through _int_mm requires M > 16

    @classmethod
    def _shape_reason(cls, shape):
        if shape is not None and (shape[0] % 8 or shape[1] % 8):
            return f"needs in_features and out_features multiples of 8 on cuda, got out={shape[0]}, in={shape[1]}"
        return None
