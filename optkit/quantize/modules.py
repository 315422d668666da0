"""Quantized modules: self-describing integer weights with a pure-torch ``dequantize()``.

The forward passes here are the *reference* path (dequantize, then a float matmul). Fast
kernels (the runner) are tested against ``dequantize()``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from optkit.quantize.algorithms.smoothquant import quantize_activation_per_token
from optkit.quantize.primitives import dequantize
from optkit.quantize.rtn import QuantizedWeight, quantize_weight_rtn
from optkit.quantize.scheme import QuantScheme

Algorithm = Callable[[torch.Tensor, QuantScheme, torch.dtype], QuantizedWeight]


class _QuantizedWeightMixin(nn.Module):
    """Buffers shared by quantized layers.

    Buffers:
        qweight: int8 ``(out, in)``, signed codes in ``[scheme.qmin, scheme.qmax]``.
        weight_scale: ``(out, n_groups)`` in the storage dtype (``(out, 1)`` per channel).
        weight_zero_point: int8 ``(out, n_groups)``; registered only when asymmetric.
    """

    scheme: QuantScheme

    def _init_qbuffers(self, qw: QuantizedWeight) -> None:
        self.scheme = qw.scheme
        self.register_buffer("qweight", qw.q.contiguous())
        self.register_buffer("weight_scale", qw.scale.contiguous())
        if qw.zero_point is not None:
            self.register_buffer("weight_zero_point", qw.zero_point.contiguous())
        else:
            self.weight_zero_point = None

    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.weight_scale, self.weight_zero_point, self.scheme)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Float weight ``(out, in)`` from the integer codes (reference implementation)."""
        return dequantize(self.qweight, self.weight_scale, self.weight_zero_point, self.scheme, dtype)


class QuantizedLinear(_QuantizedWeightMixin):
    """``y = x W'^T + b`` with ``W'`` dequantized from integer codes (see the mixin's buffers).
    With ``scheme.act_bits`` (W8A8) ``x`` is first quantized per token, dynamically.

    ``bias``: ``(out,)`` float or ``None``.
    """

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qw.q.shape
        self._init_qbuffers(qw)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_float(
        cls,
        linear: nn.Linear,
        scheme: QuantScheme,
        scale_dtype: torch.dtype,
        algorithm: Algorithm = quantize_weight_rtn,
    ) -> QuantizedLinear:
        return cls(algorithm(linear.weight.detach(), scheme, scale_dtype), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in)
        if self.scheme.act_bits is not None:  # W8A8: int8 per-token activations, as the int8 GEMM sees them
            x = quantize_activation_per_token(x, self.scheme.act_bits)
        return F.linear(x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.label()}"


class QuantizedEmbedding(_QuantizedWeightMixin):
    """Embedding table stored as int8 rows with one scale per row (vocabulary entry)."""

    def __init__(self, qw: QuantizedWeight, padding_idx: int | None, out_dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = qw.q.shape
        self.padding_idx = padding_idx
        self.out_dtype = out_dtype  # the dtype the float table had, so the model sees no change
        self._init_qbuffers(qw)

    @classmethod
    def from_float(cls, emb: nn.Embedding, scheme: QuantScheme, scale_dtype: torch.dtype) -> QuantizedEmbedding:
        if scheme.group_size is not None:
            raise ValueError("embeddings are quantized per row (group_size=None)")
        return cls(quantize_weight_rtn(emb.weight.detach(), scheme, scale_dtype), emb.padding_idx, emb.weight.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: (...,) -> (..., dim)
        q = self.qweight[ids].float()  # (..., dim)
        if self.weight_zero_point is not None:
            q = q - self.weight_zero_point[ids].float()
        return (q * self.weight_scale[ids].float()).to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, scheme={self.scheme.label()}"
