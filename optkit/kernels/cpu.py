"""CPU weight-only kernels: ``cpu-int4pack`` and ``cpu-int8pack``.

Both wrap torch's weight-only GEMV ops (``aten._weight_int4pack_mm_for_cpu``,
``aten._weight_int8pack_mm``), which are fast at decode but dequantize the weight again for
every few rows of ``x``: their time grows linearly with M. Above a threshold each kernel instead
rebuilds ``W`` from its packed storage in the compute dtype (per call, one fused compiled pass;
nothing 16-bit is kept between calls) and runs one dense matmul. Median ms on the dev machine
(2 cores AVX512+AMX, shared), 3072x576 weight, ``python -m optkit.kernels.bench --m 1,...,512``:

    bf16, 2 threads    M:   1      4      8     16     24     32     48     64    512
    dense F.linear        0.14   0.17   0.15   0.17   0.16   0.16   0.24   0.26   0.83
    int4pack op           0.050  0.087  0.18   0.35   0.51   0.64   0.98   1.30   10.1
    int4 rebuild+matmul   0.81   0.78   0.79   0.80   0.79   0.75   0.86   0.83   1.30
    int8pack op           0.055  0.094  0.22   0.43   0.58   0.75   1.16   1.51   12.0
    int8 rebuild+matmul   0.49   0.48   0.46   0.49   0.50   0.54   0.51   0.57   1.18
    W8A8 (_int_mm)        0.14   0.13   0.21   0.19   0.26   0.28   0.39   0.32   1.73

    fp32, 2 threads    M:   1     16     64    512
    dense F.linear        0.17   0.47   0.96   5.74
    int4pack op           1.50   24.3   96.2    768
    int4 rebuild+matmul   1.06   1.13   1.54   6.69
    int8pack op           0.56   8.34   35.1    264
    int8 rebuild+matmul   0.57   0.79   1.55   5.84

(single-threaded the crossovers sit lower: ~24 rows for int4, ~12 for int8.) Hence the
thresholds below: the op for ``M <= threshold``, rebuild + dense matmul above. In float32 and
float16 the ops have no fast path (10-100x slower than in bf16), so those dtypes always rebuild.
The thresholds are per dtype, not per shape: both sides scale with ``N * K``.

The int4pack CPU layout is not plain nibble packing: torch packs rows in blocks (64 rows with
AVX512, 32 otherwise), byte ``j`` of a block holding row ``j`` (low nibble) and row
``j + block/2`` (high) on AVX512/AVX2, or rows ``2j``/``2j+1`` without vector units.
:func:`cpu_int4_layout` finds which by packing a known pattern once, so the rebuild reads the
op's own buffer; rows are padded to a multiple of 64 so every block is full.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from optkit.kernels.base import LinearKernel, bias_buffer, build_per_channel, common_reason, per_channel_reason
from optkit.kernels.compiled import COMPILE_MIN_WEIGHTS, LazyCompiled
from optkit.kernels.int4 import group_reason, kernel_group, round_up, scales_and_zeros, unsigned_codes

#: Largest M (rows of x) the int4pack op serves; above it, rebuild + dense matmul. From the table
#: (bf16): op 0.64 vs 0.75 ms at M=32, 0.98 vs 0.86 ms at M=48.
OP_MAX_M: dict[torch.dtype, int] = {torch.bfloat16: 32, torch.float16: 0, torch.float32: 0}
#: Same for int8pack, whose rebuild is cheaper: op 0.43 vs 0.49 ms at M=16, 0.58 vs 0.50 at M=24.
INT8_OP_MAX_M: dict[torch.dtype, int] = {torch.bfloat16: 16, torch.float16: 0, torch.float32: 0}

_ROW_BLOCK = 64  # rows are padded to this: the widest CPU int4pack block (AVX512)


# -- int4pack layout and its rebuild ----------------------------------------------------------


def _rebuild_int4_core(pk: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, adjacent: bool) -> torch.Tensor:
    """``w = (u - 8) * scale + zero`` for every nibble, in the block order of the packed bytes.

    ``pk``: uint8 ``(G, g, NB, B/2)`` (a view of the packed buffer, k-major); ``scale``, ``zero``:
    ``(G, 1, NB, 2, B/2)`` (``(G, 1, NB, B/2, 2)`` if ``adjacent``). Returns ``(G, g, NB, 2, B/2)``
    (resp. ``(..., B/2, 2)``) contiguous in ``scale.dtype``: that is ``W^T`` ``(K, N)``.
    """
    shift = torch.tensor([0, 4], dtype=torch.uint8, device=pk.device)  # low, high nibble
    if adjacent:  # byte j = rows 2j (low), 2j+1 (high)
        u = (pk.unsqueeze(-1) >> shift) & 15
    else:  # byte j = rows j (low), j + B/2 (high)
        u = (pk.unsqueeze(-2) >> shift.view(2, 1)) & 15
    return ((u.float() - 8) * scale.float() + zero.float()).to(scale.dtype).contiguous()


_rebuild_int4_compiled = LazyCompiled(_rebuild_int4_core)


def _rebuild_int8_core(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 ``(N, K)`` x per-row ``scale`` ``(N,)`` -> ``W`` ``(N, K)`` in ``scale.dtype`` (one rounding)."""
    return (q.float() * scale.float().unsqueeze(1)).to(scale.dtype)


_rebuild_int8_compiled = LazyCompiled(_rebuild_int8_core)


def rebuild_int4_weight_t(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, g: int, layout: tuple[int, bool], compiled: bool | None = None
) -> torch.Tensor:
    """``W^T`` ``(K, N)`` in ``scales_and_zeros.dtype`` from the int4pack CPU buffer ``packed``
    ``(N, K/2)`` and ``scales_and_zeros`` ``(K/g, N, 2)``. Views first, so the compiled part sees
    one graph for every shape (dynamic sizes: G, g, NB)."""
    block, adjacent = layout
    n, k = packed.shape[0], packed.shape[1] * 2
    groups, nb, half = k // g, n // block, block // 2
    pk = packed.view(nb, k, half).permute(1, 0, 2).view(groups, g, nb, half)
    sub = (nb, half, 2) if adjacent else (nb, 2, half)
    scale, zero = (t.contiguous().view(groups, 1, *sub) for t in scales_and_zeros.unbind(-1))
    if compiled is None:
        compiled = packed.numel() * 2 >= COMPILE_MIN_WEIGHTS
    fn = _rebuild_int4_compiled if compiled else _rebuild_int4_core
    return fn(pk, scale, zero, adjacent).view(k, n)


@functools.cache
def _layout_for(capability: str) -> tuple[int, bool] | None:
    gen = torch.Generator().manual_seed(0)
    n, k = 2 * _ROW_BLOCK, 64
    u = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 2)  # (n, k/2) uint8
    sz = torch.tensor([1.0, 8.0]).expand(1, n, 2)  # one group, scale 1, zero 8: w = (u - 8) + 8 = u
    for layout in ((64, False), (32, False), (32, True)):
        if torch.equal(rebuild_int4_weight_t(packed, sz, k, layout, compiled=False).t(), u.float()):
            return layout
    return None


def cpu_int4_layout() -> tuple[int, bool] | None:
    """``(rows per block, adjacent)`` of torch's int4pack CPU layout on this CPU, or ``None``
    if it is none this module can decode (then the op serves every M)."""
    if not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        return None
    return _layout_for(torch.backends.cpu.get_cpu_capability())


# -- kernels ----------------------------------------------------------------------------------


class CpuInt4Pack(LinearKernel):
    """Int4 weight-only (any group multiple of 32, per channel, symmetric or not) on CPU.

    Buffers: ``packed`` uint8 ``(n_pad, in // 2)`` in torch's int4pack CPU layout (``n_pad`` =
    ``out`` rounded up to 64); ``scales_and_zeros`` ``(in // g, n_pad, 2)`` in the compute dtype
    (see :mod:`optkit.kernels.int4`); ``bias`` ``(out,)``.
    """

    name = "cpu-int4pack"

    @classmethod
    def unavailable_reason(cls, scheme, device, dtype, shape):
        reason = common_reason(scheme, device, dtype, device_type="cpu", bits=(4,))
        if reason:
            return reason
        for op in ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu"):
            if not hasattr(torch.ops.aten, op):
                return f"this torch build has no aten.{op}"
        reason = group_reason(scheme, shape)
        if reason:
            return reason
        if dtype != torch.bfloat16 and cpu_int4_layout() is None:
            cap = torch.backends.cpu.get_cpu_capability()
            return f"the int4pack op is slow outside bfloat16 and its {cap} layout cannot be rebuilt for a dense matmul"
        return None

    @classmethod
    def build(cls, qw, weight, bias, device, dtype):
        out_f, in_f = qw.q.shape
        k = cls(in_f, out_f, qw.scheme, dtype)
        k.group = kernel_group(qw.scheme, in_f)
        k.n_pad = round_up(out_f, _ROW_BLOCK)
        u = unsigned_codes(qw.q.to(device), k.n_pad)  # int32 (n_pad, in), transient
        k.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 2))
        k.register_buffer("scales_and_zeros", scales_and_zeros(qw, k.group, k.n_pad, dtype).to(device))
        k.register_buffer("bias", bias_buffer(bias, device, dtype))
        k.layout = cpu_int4_layout()
        k.op_max_m = OP_MAX_M[dtype] if k.layout is not None else sys.maxsize
        return k

    def dense_weight_t(self) -> torch.Tensor:
        """``W^T`` ``(in, n_pad)`` in the compute dtype, rebuilt from ``packed`` (transient)."""
        return rebuild_int4_weight_t(self.packed, self.scales_and_zeros, self.group, self.layout)

    def _mm(self, x):
        n = self.out_features
        if x.shape[0] <= self.op_max_m:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group, self.scales_and_zeros)
            y = y[:, :n]  # drop the padded rows' outputs (a no-op view when n_pad == n)
            return y.contiguous() if self.bias is None else y + self.bias
        w_t = self.dense_weight_t()[:, :n]  # (in, out)
        return x @ w_t if self.bias is None else torch.addmm(self.bias, x, w_t)


class CpuInt8Pack(LinearKernel):
    """Int8 weight-only, per-channel symmetric, on CPU.

    Buffers: ``qweight`` int8 ``(out, in)``; ``scales`` ``(out,)`` in the compute dtype; ``bias``.
    """

    name = "cpu-int8pack"

    @classmethod
    def unavailable_reason(cls, scheme, device, dtype, shape):
        reason = common_reason(scheme, device, dtype, device_type="cpu", bits=(8,))
        if reason:
            return reason
        if per_channel_reason(scheme):
            return per_channel_reason(scheme)
        if shape is not None and shape[1] % 16:
            # aten._weight_int8pack_mm returns wrong numbers (no error) when in % 16 != 0 (torch 2.13).
            return f"needs in_features % 16 == 0, got {shape[1]}"
        return None

    @classmethod
    def build(cls, qw, weight, bias, device, dtype):
        k = build_per_channel(cls, qw, bias, device, dtype)
        k.op_max_m = INT8_OP_MAX_M[dtype]
        return k

    def dense_weight(self) -> torch.Tensor:
        """``W`` ``(out, in)`` in the compute dtype, rebuilt from the codes (transient)."""
        big = self.qweight.numel() >= COMPILE_MIN_WEIGHTS
        return (_rebuild_int8_compiled if big else _rebuild_int8_core)(self.qweight, self.scales)

    def _mm(self, x):
        if x.shape[0] <= self.op_max_m:
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, self.scales)
            return y if self.bias is None else y.add_(self.bias)
        return F.linear(x, self.dense_weight(), self.bias)
