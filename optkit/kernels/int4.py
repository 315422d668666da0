"""Int4 packing shared by torch's tinygemm-style kernels (CPU ``int4pack`` and CUDA tinygemm).

Both dequantize an unsigned nibble ``u`` in ``[0, 15]`` as

    w = (u - 8) * scale + zero                       per (row, group of ``g`` columns)

and our codes are signed, ``c`` in ``[-8, 7]`` with an integer zero point ``z`` (reference:
``w = (c - z) * scale``). So ``u = c + 8`` and ``zero = -z * scale`` (0 when symmetric). The
``zero`` is rounded to the compute dtype: exact in float32; in bfloat16 it carries at most half
a bf16 ulp of ``|z| * scale`` (<= scale / 64), below the rounding the reference itself applies
when it casts ``w`` to bfloat16.

The kernels take group sizes 32/64/128/256. A wider group (or a whole row, per channel) is run
as the largest of those that divides it, with its scale repeated: the same numbers, a few more
bytes of scales.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from optkit.quantize.rtn import QuantizedWeight
from optkit.quantize.scheme import QuantScheme

#: Group sizes the int4 kernels implement, widest first.
KERNEL_GROUPS: tuple[int, ...] = (256, 128, 64, 32)


def kernel_group(scheme: QuantScheme, in_features: int) -> int | None:
    """The group size the kernel runs for ``scheme`` (``None`` if none fits)."""
    gs = scheme.group_size or in_features
    return next((g for g in KERNEL_GROUPS if gs % g == 0), None)


def group_reason(scheme: QuantScheme, shape: tuple[int, int] | None) -> str | None:
    if scheme.group_size is None and shape is None:
        return None  # per channel: depends on in_features, checked again at build time
    in_features = shape[1] if shape is not None else scheme.group_size
    if kernel_group(scheme, in_features) is None:
        what = f"group_size {scheme.group_size}" if scheme.group_size else f"a per-channel row of {in_features}"
        return f"{what} is not a multiple of 32 (int4 kernel groups are 32, 64, 128 or 256 wide)"
    return None


def unsigned_codes(q: torch.Tensor, n_pad: int) -> torch.Tensor:
    """Signed int4 codes ``(out, in)`` -> ``u = c + 8`` int32 ``(n_pad, in)``; padded rows are 8 (0)."""
    u = q.to(torch.int32) + 8
    return F.pad(u, (0, 0, 0, n_pad - q.shape[0]), value=8)


def scales_and_zeros(qw: QuantizedWeight, g: int, n_pad: int, dtype: torch.dtype) -> torch.Tensor:
    """``(in // g, n_pad, 2)`` in ``dtype``: ``[..., 0]`` the scale, ``[..., 1]`` ``zero = -z * scale``.

    Padded rows get scale 0 and zero 0, so their outputs are exactly 0 (and sliced off)."""
    out_f, in_f = qw.q.shape
    rep = (qw.scheme.group_size or in_f) // g  # kernel groups per stored group
    s = qw.scale.float().repeat_interleave(rep, dim=1)  # (out, in // g)
    if qw.zero_point is None:
        zero = torch.zeros_like(s)
    else:
        zero = -qw.zero_point.float().repeat_interleave(rep, dim=1) * s
    sz = torch.stack([s, zero], dim=-1)  # (out, in // g, 2)
    sz = F.pad(sz, (0, 0, 0, 0, 0, n_pad - out_f))  # (n_pad, in // g, 2)
    return sz.transpose(0, 1).contiguous().to(dtype)  # (in // g, n_pad, 2)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
