"""SmoothQuant (Xiao et al., 2022, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models") as pure functions.

Activation outliers sit in a few input channels; int8 per-token activation scales are set by
them. Dividing channel ``j`` of the input by ``s_j`` and multiplying the weights' column ``j``
by ``s_j`` keeps ``x W^T`` unchanged and moves the difficulty into the weights (eq. 4)::

    s_j = max|X_j|^alpha / max_i |W_ij|^(1 - alpha)

with the max over every linear that reads ``x``. The ``1/s`` is folded into the producer of
``x`` (see :mod:`optkit.quantize.mappings`).
"""

from __future__ import annotations

import torch

#: Channels whose activation or weight maximum is below this are left unscaled (s = 1):
#: they carry no signal and a power of ~0 would blow the scale up.
_MIN_MAGNITUDE = 1e-5


def smooth_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """Per-input-channel scales ``s`` (in,) for linears (out_i, in) that share one input."""
    a = act_absmax.float()  # (in,)
    w = torch.cat([x.float().abs() for x in weights], dim=0).amax(dim=0)  # (in,)
    s = a.clamp(min=_MIN_MAGNITUDE).pow(alpha) / w.clamp(min=_MIN_MAGNITUDE).pow(1 - alpha)
    keep = (a < _MIN_MAGNITUDE) | (w < _MIN_MAGNITUDE) | ~torch.isfinite(s)
    return torch.where(keep, torch.ones_like(s), s)


def quantize_activation_per_token(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Dynamic symmetric per-token fake quantization of activations (..., in), with the
    convention of compressed-tensors (the format's reference, which transformers applies when
    it loads a W8A8 artifact): ``s_t = max|x_t| / ((qmax - qmin) / 2)`` (127.5 for int8),
    ``x' = s_t * clamp(round(x / s_t), qmin, qmax)``."""
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / ((qmax - qmin) / 2)  # (..., 1)
    return (torch.clamp(torch.round(xf / s), qmin, qmax) * s).to(x.dtype)
