"""AWQ (Lin et al., 2023, "AWQ: Activation-aware Weight Quantization") as pure functions.

Salient input channels (large mean ``|x|``) lose the most to rounding. Scaling channel ``j``
of the weights by ``s_j`` and of the input by ``1/s_j`` leaves ``x W^T`` unchanged in float
but shrinks the relative rounding error of the scaled-up channels. The scales are searched
on a grid (section 3.2 of the paper)::

    s = mean|x|^alpha / sqrt(max * min),   alpha in {0, 1/n, ..., (n-1)/n}
    alpha* = argmin  sum_layers tr(dW_a H dW_a^T),   dW_a = W - Q(W diag(s)) diag(s)^-1

where ``H = X^T X`` of the (unscaled) inputs, so the error is exactly the output error on
all calibration tokens without running the layer again. The ``1/s`` is folded into whatever
produces ``x`` (a norm's weight, or the rows of the previous linear), see
:mod:`optkit.quantize.mappings`.

After scaling, a clipping ratio per group is searched against the same output error
restricted to the group's diagonal block of ``H`` (AWQ's ``auto_clip``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optkit.quantize.primitives import _grouped, dequantize, qparams_for_range, quantize
from optkit.quantize.scheme import QuantScheme


@dataclass(frozen=True)
class ScaleSearch:
    """``scales`` (in,): multiply the weights' input channels, divide the input; ``alpha`` chosen;
    ``error`` / ``error_unscaled``: summed output error with and without the scales."""

    scales: torch.Tensor
    alpha: float
    error: float
    error_unscaled: float


def _rtn_dequant(w: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype) -> torch.Tensor:
    wg = _grouped(w, scheme)
    wmin = wg.amin(-1).clamp(max=0.0)
    wmax = wg.amax(-1).clamp(min=0.0)
    s, z = qparams_for_range(wmin, wmax, scheme, scale_dtype)
    return dequantize(quantize(w, s, z, scheme), s, z, scheme)


def quadratic_error(dW: torch.Tensor, H: torch.Tensor) -> float:
    """``tr(dW H dW^T)``: squared output error of a weight change over the inputs behind ``H``."""
    return float(((dW @ H) * dW).sum())


def search_scales(
    weights: list[torch.Tensor],
    H: torch.Tensor,
    act_mean_abs: torch.Tensor,
    scheme: QuantScheme,
    scale_dtype: torch.dtype,
    grid: int = 20,
) -> ScaleSearch:
    """Best AWQ scales for linears sharing one input (their weights (out_i, in), same ``in``)."""
    H = H.float()
    x = act_mean_abs.float().clamp(min=1e-8)  # (in,)
    ws = [w.float() for w in weights]
    best: tuple[float, float, torch.Tensor] | None = None
    unscaled = 0.0
    for k in range(grid):
        alpha = k / grid
        s = x.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1 (the paper's normalization)
        s = s.clamp(min=1e-4)
        err = 0.0
        for w in ws:
            w_hat = _rtn_dequant(w * s, scheme, scale_dtype) / s  # effective weight seen by x
            err += quadratic_error(w - w_hat, H)
        if k == 0:
            unscaled = err  # alpha = 0 gives s = 1
        if best is None or err < best[0]:
            best = (err, alpha, s)
    assert best is not None
    return ScaleSearch(best[2], best[1], best[0], unscaled)


def search_clip(
    w: torch.Tensor,
    H: torch.Tensor,
    scheme: QuantScheme,
    scale_dtype: torch.dtype,
    grid: int = 20,
    max_shrink: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-group scale / zero point: the range ``p * [min, max]`` minimizing the group's output
    error ``dw_g H_gg dw_g^T`` (``H_gg``: the group's diagonal block of ``H``)."""
    out_f, in_f = w.shape
    wg = _grouped(w.float(), scheme)  # (out, G, g)
    G, g = wg.shape[1], wg.shape[2]
    Hb = torch.stack([H[i * g : (i + 1) * g, i * g : (i + 1) * g] for i in range(G)]).float()  # (G, g, g)
    wmin = wg.amin(-1).clamp(max=0.0)  # (out, G)
    wmax = wg.amax(-1).clamp(min=0.0)

    def group_err(s: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:  # (out, G)
        sf = s.float().unsqueeze(-1)
        q = torch.round(wg / sf)
        if z is not None:
            zf = z.float().unsqueeze(-1)
            deq = (torch.clamp(q + zf, scheme.qmin, scheme.qmax) - zf) * sf
        else:
            deq = torch.clamp(q, scheme.qmin, scheme.qmax) * sf
        d = wg - deq  # (out, G, g)
        return torch.einsum("ogi,gij,ogj->og", d, Hb, d)

    best_s, best_z = qparams_for_range(wmin, wmax, scheme, scale_dtype)
    best_e = group_err(best_s, best_z)
    for p in torch.linspace(1.0, 1.0 - max_shrink, grid)[1:].tolist():
        s, z = qparams_for_range(wmin * p, wmax * p, scheme, scale_dtype)
        e = group_err(s, z)
        better = e < best_e
        best_e = torch.where(better, e, best_e)
        best_s = torch.where(better, s, best_s)
        if z is not None:
            best_z = torch.where(better, z, best_z)
    return best_s, best_z
