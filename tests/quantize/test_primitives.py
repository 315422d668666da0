import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

from optkit.export.compressed import pack_weight, unpack_weight
from optkit.quantize.primitives import compute_qparams, dequantize, quantize, sqnr_db
from optkit.quantize.rtn import quantize_weight_rtn
from optkit.quantize.scheme import QuantScheme

SCHEMES = [
    QuantScheme(4, 32, True),
    QuantScheme(4, 64, False),
    QuantScheme(4, None, True),
    QuantScheme(8, None, True),
    QuantScheme(8, 128, False),
]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.label())
def test_rtn_error_is_at_most_half_a_step(scheme):
    torch.manual_seed(0)
    w = torch.randn(48, 256) * torch.rand(48, 1) * 3
    qw = quantize_weight_rtn(w, scheme, torch.float32)
    assert qw.q.dtype == torch.int8
    assert int(qw.q.min()) >= scheme.qmin and int(qw.q.max()) <= scheme.qmax
    groups = 1 if scheme.group_size is None else 256 // scheme.group_size
    assert qw.scale.shape == (48, groups)
    err = (w - qw.dequantize()).abs().reshape(48, groups, -1)
    step = qw.scale.unsqueeze(-1)
    assert bool((err <= step / 2 + 1e-6).all())
    # the codes really use the range: an int4 grid that collapsed would fail this
    assert len(torch.unique(qw.q)) > (12 if scheme.bits == 4 else 200)


def test_asymmetric_beats_symmetric_on_shifted_weights():
    torch.manual_seed(0)
    w = torch.rand(32, 128)  # all positive: symmetric wastes half its grid
    sym = quantize_weight_rtn(w, QuantScheme(4, 32, True), torch.float32)
    asym = quantize_weight_rtn(w, QuantScheme(4, 32, False), torch.float32)
    assert sqnr_db(w, asym.dequantize()) > sqnr_db(w, sym.dequantize()) + 3
    assert asym.zero_point is not None and asym.zero_point.dtype == torch.int8


def test_zero_group_and_zero_are_exact():
    w = torch.randn(4, 64)
    w[1] = 0.0
    w[2, :32] = 0.0
    for scheme in (QuantScheme(4, 32, True), QuantScheme(4, 32, False), QuantScheme(8, None, False)):
        deq = quantize_weight_rtn(w, scheme, torch.bfloat16).dequantize()
        assert torch.equal(deq[1], torch.zeros(64))
        assert torch.equal(deq[2, :32], torch.zeros(32))


def test_scales_are_stored_in_storage_dtype_and_codes_use_them():
    torch.manual_seed(1)
    w = torch.randn(16, 64)
    scheme = QuantScheme(4, 32, True)
    scale, zp = compute_qparams(w, scheme, torch.bfloat16)
    assert scale.dtype == torch.bfloat16 and zp is None
    q = quantize(w, scale, zp, scheme)
    # the codes are the rounding of w against the *stored* (bf16) scale
    expected = torch.round(w.reshape(16, 2, 32) / scale.float().unsqueeze(-1)).clamp(-8, 7).reshape(16, 64)
    assert torch.equal(q.float(), expected)


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="not divisible"):
        quantize_weight_rtn(torch.randn(4, 96), QuantScheme(4, 64), torch.float32)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.label())
def test_pack_matches_compressed_tensors_and_round_trips(scheme):
    torch.manual_seed(2)
    qw = quantize_weight_rtn(torch.randn(40, 256), scheme, torch.bfloat16)
    packed = pack_weight(qw, "m.")
    assert packed["m.weight_packed"].dtype == torch.int32
    assert packed["m.weight_packed"].shape == (40, 256 * scheme.bits // 32)
    assert packed["m.weight_shape"].tolist() == [40, 256]
    # compressed-tensors' own unpacker (what transformers and vLLM run) reads our integers back
    assert torch.equal(unpack_from_int32(packed["m.weight_packed"], scheme.bits, torch.Size([40, 256])), qw.q)
    back = unpack_weight(packed, "m.", scheme)
    assert torch.equal(back.q, qw.q) and torch.equal(back.scale, qw.scale)
    if scheme.symmetric:
        assert "m.weight_zero_point" not in packed
    else:
        assert torch.equal(back.zero_point, qw.zero_point)


def test_dequantize_matches_compressed_tensors_reference():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

    torch.manual_seed(3)
    for scheme in (QuantScheme(4, 32, False), QuantScheme(8, None, True)):
        qw = quantize_weight_rtn(torch.randn(8, 64), scheme, torch.float32)
        args = QuantizationArgs(**scheme.to_compressed_tensors())
        ref = ct_dequantize(x_q=qw.q, scale=qw.scale, zero_point=qw.zero_point, args=args)
        torch.testing.assert_close(dequantize(qw.q, qw.scale, qw.zero_point, scheme), ref.float())


def test_sqnr():
    x = torch.ones(10)
    assert sqnr_db(x, x) == float("inf")
    assert abs(sqnr_db(x, x * 1.1) - 20.0) < 1e-4
