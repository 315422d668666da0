"""Round-to-nearest: min/max scales, every weight rounded independently."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optkit.quantize.primitives import compute_qparams, dequantize, quantize
from optkit.quantize.scheme import QuantScheme


@dataclass(frozen=True)
class QuantizedWeight:
    """Integer codes and their parameters, as an algorithm returns them.

    ``q``: int8 ``(out, in)``; ``scale``: ``(out, n_groups)`` in the storage dtype;
    ``zero_point``: int8 ``(out, n_groups)`` or ``None`` (symmetric).
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    scheme: QuantScheme

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.zero_point, self.scheme, dtype)


def quantize_weight_rtn(w: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype) -> QuantizedWeight:
    scale, zp = compute_qparams(w, scheme, scale_dtype)
    return QuantizedWeight(quantize(w, scale, zp, scheme), scale, zp, scheme)
