"""``auto`` selection, explicit choices, errors, the registry, and what a kernel stores."""

from __future__ import annotations

import logging

import pytest
import torch

from optkit.kernels import KERNELS, KernelUnavailableError, LinearKernel, build_linear, kernel_candidates, register_kernel, registry
from optkit.quantize.scheme import QuantScheme
from tests.kernels.util import random_qw

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize(
    ("scheme", "dtype", "shape", "expected"),
    [
        (QuantScheme(4, 64, True), BF16, (128, 256), "cpu-int4pack"),
        (QuantScheme(4, 128, False), FP32, (128, 256), "cpu-int4pack"),
        (QuantScheme(4, None, False), BF16, (128, 256), "cpu-int4pack"),
        (QuantScheme(8, None, True), BF16, (128, 256), "cpu-int8pack"),
        (QuantScheme(8, None, True, 8), BF16, (128, 256), "cpu-w8a8-intmm"),
        (QuantScheme(4, None, True, 8), FP32, (128, 256), "cpu-w8a8-intmm"),
        (None, BF16, (128, 256), "dense"),
        (QuantScheme(8, 64, False), BF16, (128, 256), "dequant"),  # grouped int8: no fast CPU kernel
        (QuantScheme(8, None, True), BF16, (128, 40), "dequant"),  # int8pack needs in % 16 == 0
        (QuantScheme(4, None, True), BF16, (128, 48), "dequant"),  # a row of 48 is no multiple of 32
        (QuantScheme(4, 64, True, 8), BF16, (128, 256), "dequant"),  # grouped W8A8
    ],
    ids=lambda v: v.label() if isinstance(v, QuantScheme) else str(v),
)
def test_auto_picks_the_expected_cpu_kernel(scheme, dtype, shape, expected):
    runnable = [n for n, r in kernel_candidates(scheme, "cpu", dtype, shape) if r is None]
    assert runnable[0] == expected
    if scheme is None:
        k = build_linear(None, torch.randn(shape), None, "cpu", dtype)
    else:
        k = build_linear(random_qw(*shape, scheme, torch.bfloat16), None, None, "cpu", dtype)
    assert k.name == expected and k.slow_path == (expected == "dequant")


def test_candidates_cover_every_kernel_in_preference_order():
    cands = kernel_candidates(QuantScheme(4, 64, True), torch.device("cpu"), BF16)
    assert [n for n, _ in cands] == list(KERNELS)
    assert list(KERNELS)[-1] == "dequant"
    reasons = dict(cands)
    assert "cuda" in reasons["cuda-int4-tinygemm"] and reasons["dequant"] is None


def test_cuda_kernels_declare_their_limits_without_a_gpu():
    int4 = dict(kernel_candidates(QuantScheme(4, 64, True), "cuda", FP32))["cuda-int4-tinygemm"]
    assert int4 is not None and "bfloat16" in int4
    w8a8 = dict(kernel_candidates(QuantScheme(8, None, True, 8), "cuda", BF16, (100, 256)))["cuda-w8a8-intmm"]
    assert w8a8 is not None  # 100 rows: not a multiple of 8 (or no CUDA kernel in this build)


def test_explicit_kernel_that_cannot_run_names_the_reason():
    qw = random_qw(64, 256, QuantScheme(8, 64, False), BF16)
    with pytest.raises(KernelUnavailableError) as e:
        build_linear(qw, None, None, "cpu", BF16, kernel="cpu-int8pack")
    msg = str(e.value)
    for part in ("cpu-int8pack", "int8-g64-asym", "cpu", "bfloat16", "per-channel symmetric", "dequant"):
        assert part in msg, (part, msg)


def test_explicit_quantized_kernel_on_a_float_weight_raises():
    with pytest.raises(KernelUnavailableError, match="needs a quantized weight"):
        build_linear(None, torch.randn(64, 256), None, "cpu", BF16, kernel="cpu-int4pack")


def test_unknown_kernel_lists_the_valid_names():
    with pytest.raises(KernelUnavailableError) as e:
        build_linear(None, torch.randn(8, 16), None, "cpu", BF16, kernel="marlin")
    for name in ("auto", *KERNELS):
        assert name in str(e.value)


def test_auto_fallback_warns_and_sets_slow_path(caplog):
    qw = random_qw(64, 256, QuantScheme(8, 64, False), BF16)
    with caplog.at_level(logging.WARNING, logger="optkit.kernels"):
        k = build_linear(qw, None, None, "cpu", BF16)
    assert k.name == "dequant" and k.slow_path
    [rec] = [r for r in caplog.records if r.name == "optkit.kernels"]
    assert rec.levelno == logging.WARNING
    for part in ("int8-g64-asym", "cpu", "slow dequantize"):
        assert part in rec.getMessage()


def test_fast_kernel_does_not_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="optkit.kernels"):
        k = build_linear(random_qw(64, 256, QuantScheme(4, 64, True), BF16), None, None, "cpu", BF16)
    assert not k.slow_path and not [r for r in caplog.records if r.name == "optkit.kernels"]


def test_exactly_one_weight_is_required():
    qw = random_qw(64, 256, QuantScheme(4, 64, True), BF16)
    with pytest.raises(ValueError, match="exactly one"):
        build_linear(qw, torch.randn(64, 256), None, "cpu", BF16)
    with pytest.raises(ValueError, match="exactly one"):
        build_linear(None, None, None, "cpu", BF16)


def test_registry_rejects_duplicates_and_appends_new_kernels(monkeypatch):
    monkeypatch.setattr(registry, "KERNELS", dict(registry.KERNELS))
    with pytest.raises(ValueError, match="already registered"):
        register_kernel(registry.KERNELS["cpu-int4pack"])

    class Mine(LinearKernel):
        name = "mine"

        @classmethod
        def unavailable_reason(cls, scheme, device, dtype, shape):
            return None

    register_kernel(Mine)
    assert list(registry.KERNELS)[-1] == "mine"
    with pytest.raises(TypeError):
        register_kernel(object)


# -- storage: packed bytes only, no 16-bit copy of the weight ---------------------------------

OUT, IN = 256, 512


@pytest.mark.parametrize(
    ("scheme", "expected_name", "expected_bytes"),
    [
        # packed nibbles + (scale, zero) bf16 per 64-group and row + bias bf16
        (QuantScheme(4, 64, True), "cpu-int4pack", OUT * IN // 2 + (IN // 64) * OUT * 2 * 2 + OUT * 2),
        # per channel on a 512 row: kernel groups of 256, the scale repeated
        (QuantScheme(4, None, False), "cpu-int4pack", OUT * IN // 2 + (IN // 256) * OUT * 2 * 2 + OUT * 2),
        (QuantScheme(8, None, True), "cpu-int8pack", OUT * IN + OUT * 2 + OUT * 2),  # codes + scale + bias
        (QuantScheme(8, None, True, 8), "cpu-w8a8-intmm", OUT * IN + OUT * 4 + OUT * 2),  # fp32 weight scale
        # codes int8 + stored scales bf16 + zero points int8 + bias
        (QuantScheme(8, 64, False), "dequant", OUT * IN + OUT * (IN // 64) * (2 + 1) + OUT * 2),
    ],
    ids=lambda v: v.label() if isinstance(v, QuantScheme) else str(v),
)
def test_weight_bytes_is_the_storage_and_nothing_is_16_bit(scheme, expected_name, expected_bytes):
    qw = random_qw(OUT, IN, scheme, BF16)
    k = build_linear(qw, None, torch.randn(OUT), "cpu", BF16)
    assert k.name == expected_name
    buffers = dict(k.named_buffers())
    assert k.weight_bytes() == expected_bytes == sum(b.numel() * b.element_size() for b in buffers.values())
    assert not list(k.parameters())
    assert not [v for v in vars(k).values() if isinstance(v, torch.Tensor)]  # nothing outside buffers
    for name, b in buffers.items():  # at most one byte per weight in any buffer (bf16 would be two)
        assert b.numel() * b.element_size() <= OUT * IN * scheme.bits // 8, name
    assert k.weight_bytes() < OUT * IN * 2 * 0.6  # well under a bf16 copy


def test_dense_weight_bytes():
    k = build_linear(None, torch.randn(OUT, IN), torch.randn(OUT), "cpu", BF16)
    assert k.weight_bytes() == OUT * IN * 2 + OUT * 2
