"""Pure quantization primitives on tensors: no modules, no I/O, no global state.

Shapes: a weight ``W`` is ``(out, in)``; with group size ``g`` it is viewed as
``(out, in // g, g)``; scales and zero points are ``(out, in // g)`` (``(out, 1)`` for
per-channel). Integers are signed, in ``[qmin, qmax]`` (compressed-tensors' convention):

    symmetric:   q = clamp(round(w / s), qmin, qmax)            w' = s * q
    asymmetric:  q = clamp(round(w / s) + z, qmin, qmax)        w' = s * (q - z)
"""

from __future__ import annotations

import torch

from optkit.quantize.scheme import QuantScheme


def _grouped(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """(out, in) -> (out, n_groups, g)."""
    out_f, in_f = w.shape
    g = in_f if scheme.group_size is None else scheme.group_size
    if in_f % g:
        raise ValueError(f"in_features {in_f} is not divisible by group_size {g}")
    return w.reshape(out_f, in_f // g, g)


def compute_qparams(
    w: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min/max scales (and zero points) per group.

    Returns ``scale`` ``(out, n_groups)`` already rounded to ``scale_dtype`` (the dtype it is
    stored in, so the integers are computed against the stored scale) and ``zero_point``
    ``(out, n_groups)`` int8, or ``None`` when symmetric.
    """
    wg = _grouped(w.float(), scheme)  # (out, G, g)
    # 0 must be exactly representable (padding, ReLU zeros), so the range always spans it.
    wmin = wg.amin(dim=-1).clamp(max=0.0)  # (out, G)
    wmax = wg.amax(dim=-1).clamp(min=0.0)
    return qparams_for_range(wmin, wmax, scheme, scale_dtype)


def qparams_for_range(
    wmin: torch.Tensor, wmax: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point) covering ``[wmin, wmax]`` (both (out, G), ``wmin <= 0 <= wmax``)."""
    qrange = scheme.qmax - scheme.qmin  # 15 for int4, 255 for int8
    if scheme.symmetric:
        # Half the signed range (7.5 for int4): +absmax maps to qmax + 0.5, which rounds into
        # qmax with at most half a step of error, the same bound as every other weight.
        scale = torch.maximum(wmax, -wmin) / (qrange / 2)
    else:
        scale = (wmax - wmin) / qrange
    # An all-zero group has no range; any positive scale reproduces it exactly.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scale = scale.to(scale_dtype)
    # The stored scale may have rounded to 0 or inf in a 16-bit dtype (subnormal ranges).
    finfo = torch.finfo(scale_dtype)
    scale = scale.clamp(min=finfo.tiny, max=finfo.max)
    if scheme.symmetric:
        return scale, None
    zp = torch.round(scheme.qmin - wmin / scale.float()).clamp(scheme.qmin, scheme.qmax)
    return scale, zp.to(torch.int8)


def quantize(
    w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, scheme: QuantScheme
) -> torch.Tensor:
    """Float weight -> signed int8 codes ``(out, in)`` in ``[qmin, qmax]``."""
    wg = _grouped(w.float(), scheme)  # (out, G, g)
    q = torch.round(wg / scale.float().unsqueeze(-1))
    if zero_point is not None:
        q = q + zero_point.float().unsqueeze(-1)
    q = q.clamp(scheme.qmin, scheme.qmax)
    return q.reshape(w.shape).to(torch.int8)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    scheme: QuantScheme,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Reference dequantization, the ground truth every fast kernel is tested against."""
    qg = _grouped(q, scheme).float()  # (out, G, g)
    if zero_point is not None:
        qg = qg - zero_point.float().unsqueeze(-1)
    w = qg * scale.float().unsqueeze(-1)
    return w.reshape(q.shape).to(dtype)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(|x|^2 / |x - x'|^2)."""
    ref = reference.float()
    noise = (ref - approx.float()).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).sum() / noise))
