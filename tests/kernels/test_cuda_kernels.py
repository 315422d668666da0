"""The CUDA kernels against the reference; skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from optkit.kernels import build_linear, kernel_candidates
from optkit.quantize.scheme import QuantScheme
from tests.kernels.util import assert_close_to_reference, random_qw

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

OUT, IN = 200, 512  # 200 rows: a multiple of 8, not of 64
MS = (1, 3, 17, 300)


def _run(scheme, dtype, expected, out_f=OUT, in_f=IN):
    dev = torch.device("cuda")
    for bias in (False, True):
        qw = random_qw(out_f, in_f, scheme, torch.bfloat16)
        b = torch.randn(out_f, generator=torch.Generator().manual_seed(1)) if bias else None
        k = build_linear(qw, None, b, dev, dtype)
        assert k.name == expected and not k.slow_path
        for m in MS:
            x = torch.randn(m, in_f, generator=torch.Generator().manual_seed(m)).to(dev, dtype)
            assert_close_to_reference(k, qw, b, x)
        assert k.weight_bytes() < out_f * in_f * 2 * 0.6


@pytest.mark.parametrize(
    "scheme",
    [QuantScheme(4, g, sym) for g in (32, 64, 128, 256, None) for sym in (True, False)],
    ids=lambda s: s.label(),
)
def test_int4_tinygemm_matches_reference(scheme):
    _run(scheme, torch.bfloat16, "cuda-int4-tinygemm")


def test_int4_tinygemm_pads_rows():
    _run(QuantScheme(4, 64, False), torch.bfloat16, "cuda-int4-tinygemm", out_f=100, in_f=256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_w8a8_intmm_matches_reference(dtype):
    _run(QuantScheme(8, None, True, 8), dtype, "cuda-w8a8-intmm")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_int8_weightonly_matches_reference(dtype):
    _run(QuantScheme(8, None, True), dtype, "cuda-int8-weightonly")


def test_auto_on_cuda():
    pick = lambda s, d, shape=(OUT, IN): next(n for n, r in kernel_candidates(s, "cuda", d, shape) if r is None)  # noqa: E731
    assert pick(QuantScheme(4, 128, True), torch.bfloat16) == "cuda-int4-tinygemm"
    assert pick(QuantScheme(4, 128, True), torch.float16) == "dequant"  # tinygemm is bf16 only
    assert pick(QuantScheme(8, None, True, 8), torch.bfloat16) == "cuda-w8a8-intmm"
    assert pick(QuantScheme(8, None, True), torch.bfloat16) == "cuda-int8-weightonly"
    assert pick(None, torch.bfloat16) == "dense"
