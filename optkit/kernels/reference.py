"""Kernels that run everywhere: ``dense`` (float weights) and ``dequant`` (the slow fallback).

``dequant`` keeps the artifact's int8 codes as they are and calls the reference
:func:`optkit.quantize.primitives.dequantize` on every forward: correct for every scheme on every
device, and several times slower than a packed kernel (the whole weight is rebuilt in float
per call), so :func:`optkit.kernels.build_linear` warns when ``auto`` lands on it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from optkit.kernels.base import COMPUTE_DTYPES, LinearKernel, bias_buffer, dtype_label
from optkit.quantize.algorithms.smoothquant import quantize_activation_per_token
from optkit.quantize.primitives import dequantize
from optkit.quantize.rtn import QuantizedWeight
from optkit.quantize.scheme import QuantScheme


class DenseLinear(LinearKernel):
    """Unquantized layers: ``F.linear`` in the compute dtype.

    Buffers: ``weight`` ``(out, in)`` in the compute dtype (the caller's tensor itself when it
    already has that dtype and device, so a tied embedding is not copied); ``bias`` ``(out,)``.
    """

    name = "dense"

    @classmethod
    def unavailable_reason(cls, scheme, device, dtype, shape):
        if dtype not in COMPUTE_DTYPES:
            return f"computes in bfloat16/float16/float32 only, not {dtype_label(dtype)}"
        if scheme is not None:
            return f"runs float weights only; {scheme.label()} is quantized"
        return None

    @classmethod
    def build(cls, qw, weight, bias, device, dtype):
        out_f, in_f = weight.shape
        k = cls(in_f, out_f, None, dtype)
        k.register_buffer("weight", weight.detach().to(device=device, dtype=dtype))
        k.register_buffer("bias", bias_buffer(bias, device, dtype))
        return k

    def _mm(self, x):
        return F.linear(x, self.weight, self.bias)


class DequantLinear(LinearKernel):
    """Reference path for any scheme: dequantize the int8 codes on every call, then ``F.linear``
    (W8A8 schemes first fake-quantize ``x`` per token, as the reference module does).

    Buffers: ``qweight`` int8 ``(out, in)``; ``weight_scale`` ``(out, n_groups)`` as stored;
    ``weight_zero_point`` int8 ``(out, n_groups)`` or ``None``; ``bias`` ``(out,)``.
    """

    name = "dequant"
    slow_path = True

    @classmethod
    def unavailable_reason(cls, scheme: QuantScheme | None, device, dtype, shape):
        if dtype not in COMPUTE_DTYPES:
            return f"computes in bfloat16/float16/float32 only, not {dtype_label(dtype)}"
        if scheme is None:
            return "needs a quantized weight (this one is float)"
        return None

    @classmethod
    def build(cls, qw: QuantizedWeight, weight, bias, device, dtype):
        out_f, in_f = qw.q.shape
        k = cls(in_f, out_f, qw.scheme, dtype)
        k.register_buffer("qweight", qw.q.to(device=device, dtype=torch.int8).contiguous())
        k.register_buffer("weight_scale", qw.scale.to(device).contiguous())
        zp = None if qw.zero_point is None else qw.zero_point.to(device=device, dtype=torch.int8).contiguous()
        k.register_buffer("weight_zero_point", zp)
        k.register_buffer("bias", bias_buffer(bias, device, dtype))
        return k

    def _mm(self, x):
        if self.scheme.act_bits is not None:
            x = quantize_activation_per_token(x, self.scheme.act_bits)
        w = dequantize(self.qweight, self.weight_scale, self.weight_zero_point, self.scheme, x.dtype)  # (out, in)
        return F.linear(x, w, self.bias)
