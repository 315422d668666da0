"""Random quantized weights and the reference every kernel is compared with."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from optkit.quantize.algorithms.smoothquant import quantize_activation_per_token
from optkit.quantize.primitives import dequantize
from optkit.quantize.rtn import QuantizedWeight
from optkit.quantize.scheme import QuantScheme

#: Relative error ||y - ref|| / ||ref|| allowed per compute dtype: bf16 rounds the weight, the
#: activations and the output (each ~2^-9 relative); fp32 sees only summation order.
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 1e-5}


def random_qw(out_f: int, in_f: int, scheme: QuantScheme, scale_dtype: torch.dtype, seed: int = 0) -> QuantizedWeight:
    """Uniform random codes over the whole range, positive scales, zero points over the whole range."""
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if scheme.group_size is None else in_f // scheme.group_size
    q = torch.randint(scheme.qmin, scheme.qmax + 1, (out_f, in_f), generator=gen, dtype=torch.int8)
    scale = (torch.rand(out_f, groups, generator=gen) * 0.02 + 0.001).to(scale_dtype)
    zp = None
    if not scheme.symmetric:
        zp = torch.randint(scheme.qmin, scheme.qmax + 1, (out_f, groups), generator=gen, dtype=torch.int8)
    return QuantizedWeight(q, scale, zp, scheme)


def reference(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 ``F.linear`` on the reference dequantization (and fake-quantized x for W8A8)."""
    if qw.scheme.act_bits is not None:
        x = quantize_activation_per_token(x, qw.scheme.act_bits)
    w = dequantize(qw.q, qw.scale, qw.zero_point, qw.scheme, torch.float32)
    return F.linear(x.float(), w, None if bias is None else bias.float())


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def assert_close_to_reference(kernel, qw, bias, x) -> None:
    y = kernel(x)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], qw.q.shape[0])
    err = rel_err(y.cpu(), reference(x.cpu(), qw, None if bias is None else bias.cpu()))
    assert err < TOL[x.dtype], f"{kernel.name} {qw.scheme.label()} M={x.shape[0]}: relative error {err:.2e}"
