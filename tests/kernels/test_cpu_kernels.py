"""Each CPU kernel against ``F.linear(x, dequantize(...), b)`` on random codes, on both paths
(the weight-only op for small M, rebuild + dense matmul for large M), with and without bias."""

from __future__ import annotations

import sys

import pytest
import torch

from optkit.kernels import build_linear
from optkit.kernels.cpu import OP_MAX_M, cpu_int4_layout, rebuild_int4_weight_t
from optkit.kernels.intmm import COMPILED_MIN_M, _w8a8_mm, _w8a8_mm_compiled, quantize_per_token
from optkit.quantize.algorithms.smoothquant import quantize_activation_per_token
from optkit.quantize.primitives import dequantize
from optkit.quantize.scheme import QuantScheme
from tests.kernels.util import assert_close_to_reference, random_qw

# 200 rows: not a multiple of 64, so the int4 row padding is exercised. 768 columns: every
# group size gives >= 3 groups, and no two dims of the compiled rebuild's first trace coincide
# (either would specialize the graph and cost one more compile for nothing).
OUT, IN = 200, 768
MS = (1, 3, 17, 300)  # crosses OP_MAX_M (bf16) for every kernel

INT4 = [  # g64 first: the first trace of the compiled rebuild then has no coinciding dims
    QuantScheme(4, 64, True),
    QuantScheme(4, 64, False),
    QuantScheme(4, 32, True),
    QuantScheme(4, 32, False),
    QuantScheme(4, 128, True),
    QuantScheme(4, 128, False),
    QuantScheme(4, 256, True),
    QuantScheme(4, 256, False),
    QuantScheme(4, None, True),
    QuantScheme(4, None, False),
]
DTYPES = [torch.bfloat16, torch.float32]


def _build(scheme, dtype, bias: bool, kernel: str = "auto", out_f: int = OUT, in_f: int = IN):
    qw = random_qw(out_f, in_f, scheme, torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    b = torch.randn(out_f, generator=torch.Generator().manual_seed(1)) if bias else None
    return build_linear(qw, None, b, "cpu", dtype, kernel), qw, b


def _x(m: int, dtype, in_f: int = IN) -> torch.Tensor:
    return torch.randn(m, in_f, generator=torch.Generator().manual_seed(m)).to(dtype)


def _check_both_paths(k, qw, b, dtype, in_f: int = IN):
    for m in MS:
        assert_close_to_reference(k, qw, b, _x(m, dtype, in_f))
    saved = k.op_max_m
    try:  # each path at an M where the threshold would not pick it
        k.op_max_m = sys.maxsize
        assert_close_to_reference(k, qw, b, _x(MS[-1], dtype, in_f))
        k.op_max_m = -1
        assert_close_to_reference(k, qw, b, _x(1, dtype, in_f))
    finally:
        k.op_max_m = saved


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scheme", INT4, ids=lambda s: s.label())
def test_int4pack_matches_reference(scheme, dtype):
    bias = not scheme.symmetric  # half with bias, half without
    k, qw, b = _build(scheme, dtype, bias)
    assert k.name == "cpu-int4pack" and not k.slow_path
    _check_both_paths(k, qw, b, dtype)


def test_int4pack_wider_group_runs_as_repeated_256():
    k, qw, b = _build(QuantScheme(4, 512, False), torch.bfloat16, True, out_f=128, in_f=1024)
    assert k.name == "cpu-int4pack" and k.group == 256
    _check_both_paths(k, qw, b, torch.bfloat16, in_f=1024)


@pytest.mark.parametrize("scheme", [QuantScheme(4, 32, False), QuantScheme(8, None, True)], ids=lambda s: s.label())
def test_small_weights_rebuild_eagerly(scheme):
    k, qw, b = _build(scheme, torch.bfloat16, True, out_f=48, in_f=128)  # < COMPILE_MIN_WEIGHTS
    _check_both_paths(k, qw, b, torch.bfloat16, in_f=128)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_int8pack_matches_reference(bias, dtype):
    k, qw, b = _build(QuantScheme(8, None, True), dtype, bias)
    assert k.name == "cpu-int8pack" and not k.slow_path
    _check_both_paths(k, qw, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scheme", [QuantScheme(8, None, True, 8), QuantScheme(4, None, True, 8)], ids=lambda s: s.label())
def test_w8a8_intmm_matches_fake_quant_reference(scheme, dtype):
    # float32 stays below COMPILED_MIN_M: the compiled path is the same code, one compile saved.
    ms = MS if dtype == torch.bfloat16 else tuple(m for m in MS if m < COMPILED_MIN_M)
    for bias in (False, True):
        k, qw, b = _build(scheme, dtype, bias)
        assert k.name == "cpu-w8a8-intmm" and not k.slow_path
        for m in ms:
            assert_close_to_reference(k, qw, b, _x(m, dtype))


def test_w8a8_activation_codes_are_the_references_and_compiled_is_eager():
    x = (torch.randn(300, IN) * torch.rand(300, 1) * 8).to(torch.bfloat16)
    xq, s = quantize_per_token(x)
    assert torch.equal((xq.float() * s).to(x.dtype), quantize_activation_per_token(x))
    qw = random_qw(OUT, IN, QuantScheme(8, None, True, 8), torch.float32)
    args = (x, qw.q, qw.scale[:, 0].contiguous())
    assert torch.equal(_w8a8_mm_compiled(*args), _w8a8_mm(*args))


@pytest.mark.parametrize(
    "scheme", [QuantScheme(8, 64, False), QuantScheme(4, 16, True), QuantScheme(8, 64, True, 8)], ids=lambda s: s.label()
)
def test_dequant_fallback_matches_reference(scheme):
    k, qw, b = _build(scheme, torch.bfloat16, True)
    assert k.name == "dequant" and k.slow_path
    for m in (1, 17):
        assert_close_to_reference(k, qw, b, _x(m, torch.bfloat16))


def test_dense_is_f_linear_and_keeps_the_callers_tensor():
    w = torch.randn(OUT, IN, dtype=torch.bfloat16)
    k = build_linear(None, w, None, "cpu", torch.bfloat16)
    assert k.name == "dense" and k.weight.data_ptr() == w.data_ptr()  # a tied embedding is not copied
    x = _x(5, torch.bfloat16)
    assert torch.equal(k(x), torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_leading_dims_are_kept_and_outputs_contiguous(bias):
    k, qw, b = _build(QuantScheme(4, 64, True), torch.bfloat16, bias)  # 200 rows: padded to 256
    x = _x(6, torch.bfloat16).view(2, 3, IN)
    y = k(x.view(6, IN))
    assert y.is_contiguous() and torch.equal(k(x), y.view(2, 3, OUT))


def test_int4pack_layout_is_found_and_rebuild_is_exact():
    layout = cpu_int4_layout()
    assert layout in {(64, False), (32, False), (32, True)}
    k, qw, _ = _build(QuantScheme(4, 64, False), torch.float32, False)
    w_t = rebuild_int4_weight_t(k.packed, k.scales_and_zeros, k.group, k.layout)[:, :OUT]
    ref = dequantize(qw.q, qw.scale, qw.zero_point, qw.scheme, torch.float32)
    assert torch.allclose(w_t.t(), ref, rtol=0, atol=1e-6)


def test_thresholds_send_float32_to_the_rebuild():
    assert OP_MAX_M[torch.float32] == 0 and OP_MAX_M[torch.bfloat16] > 0
