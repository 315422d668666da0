"""The kernel contract: :class:`LinearKernel` and :class:`KernelUnavailableError`.

A kernel is an ``nn.Module`` computing ``y = x W^T + b`` from weights it stored at build time
in its own layout. Each kernel class says, before anything is built, whether it can run a
``(scheme, device, dtype, shape)`` and why not (:meth:`LinearKernel.unavailable_reason`);
:mod:`optkit.kernels.registry` uses those answers to pick one.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from optkit.errors import UserError
from optkit.quantize.rtn import QuantizedWeight
from optkit.quantize.scheme import QuantScheme

#: Compute dtypes any kernel may be asked for (activations, outputs and float weights).
COMPUTE_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)


class KernelUnavailableError(UserError):
    """A kernel cannot run this weight: names the scheme, device, dtype, the reason and what can run."""


def scheme_label(scheme: QuantScheme | None) -> str:
    return "float (unquantized)" if scheme is None else scheme.label()


def dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class LinearKernel(nn.Module):
    """``y = x @ W^T + b`` for ``x`` ``(..., in_features)`` in the compute dtype.

    Subclasses set ``name`` (the registry key), ``slow_path``, implement
    :meth:`unavailable_reason`, :meth:`build` and :meth:`_mm` (2-D ``(T, in) -> (T, out)``), and
    keep every tensor the forward reads as a buffer, so :meth:`weight_bytes` is their sum.
    """

    name: ClassVar[str] = ""
    #: True only for the per-call dequantize fallback.
    slow_path: ClassVar[bool] = False

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme | None, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.scheme = scheme
        self.dtype = dtype

    # -- what a kernel class declares -------------------------------------------------------
    @classmethod
    def unavailable_reason(
        cls, scheme: QuantScheme | None, device: torch.device, dtype: torch.dtype, shape: tuple[int, int] | None
    ) -> str | None:
        """``None`` if this kernel runs ``scheme`` on ``device`` in ``dtype`` (for a weight of
        ``shape`` = (out, in) when given), else a short reason."""
        raise NotImplementedError

    @classmethod
    def build(
        cls,
        qw: QuantizedWeight | None,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> LinearKernel:
        """Pack the weight; called only after :meth:`unavailable_reason` returned ``None``."""
        raise NotImplementedError

    # -- what it does -----------------------------------------------------------------------
    def _mm(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if x.dim() == 2:
            return self._mm(x)
        lead = x.shape[:-1]
        return self._mm(x.reshape(-1, self.in_features)).view(*lead, self.out_features)

    def weight_bytes(self) -> int:
        """Bytes of weight data one forward reads: every buffer (packed codes, scales, zero
        points, bias), as stored."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (
            f"{self.name}: in_features={self.in_features}, out_features={self.out_features}, "
            f"scheme={scheme_label(self.scheme)}, dtype={dtype_label(self.dtype)}"
        )


# -- shared checks --------------------------------------------------------------------------


def common_reason(
    scheme: QuantScheme | None,
    device: torch.device,
    dtype: torch.dtype,
    *,
    device_type: str,
    dtypes: tuple[torch.dtype, ...] = COMPUTE_DTYPES,
    bits: tuple[int, ...] = (4, 8),
    act_bits: int | None = None,
) -> str | None:
    """The checks every quantized kernel starts with: device, dtype, bits, activation bits."""
    if device.type != device_type:
        return f"runs on {device_type} only, not {device.type}"
    if dtype not in dtypes:
        return f"computes in {', '.join(dtype_label(d) for d in dtypes)} only, not {dtype_label(dtype)}"
    if scheme is None:
        return "needs a quantized weight (this one is float)"
    if scheme.bits not in bits:
        return f"takes {'/'.join(f'int{b}' for b in bits)} weights, not int{scheme.bits}"
    if scheme.act_bits != act_bits:
        if act_bits is None:
            return f"is weight-only; int{scheme.act_bits} activations need a W{scheme.bits}A{scheme.act_bits} kernel"
        return "needs int8 activations (W8A8 scheme); this scheme is weight-only"
    return None


def bias_buffer(bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    return None if bias is None else bias.detach().to(device=device, dtype=dtype).contiguous()


def per_channel_reason(scheme: QuantScheme, why: str = "one scale per row, no zero point") -> str | None:
    """Why a per-channel symmetric kernel cannot take ``scheme``, or None."""
    if scheme.group_size is not None or not scheme.symmetric:
        return f"takes per-channel symmetric weights only ({why})"
    return None


def build_per_channel(
    cls: type[LinearKernel], qw, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
    scale_name: str = "scales", scale_dtype: torch.dtype | None = None,
) -> LinearKernel:
    """A kernel whose buffers are the int8 codes ``qweight`` (out, in), one scale per row
    (``scale_name``, in ``scale_dtype`` or the compute dtype) and the bias."""
    out_f, in_f = qw.q.shape
    k = cls(in_f, out_f, qw.scheme, dtype)
    k.register_buffer("qweight", qw.q.to(device=device, dtype=torch.int8).contiguous())
    k.register_buffer(scale_name, qw.scale[:, 0].to(device=device, dtype=scale_dtype or dtype).contiguous())
    k.register_buffer("bias", bias_buffer(bias, device, dtype))
    return k
