"""The calibrated algorithms as pure functions, on small layers with hand-built inputs."""

import pytest
import torch
from torch import nn

from optkit.errors import QuantizationError
from optkit.quantize.algorithms.awq import quadratic_error, search_clip, search_scales
from optkit.quantize.algorithms.gptq import (
    accumulate_hessian,
    correct_for_input_error,
    gptq_quantize,
    inverse_hessian_cholesky,
    output_error,
    refine_scales,
)
from optkit.quantize.algorithms.smoothquant import quantize_activation_per_token, smooth_scales
from optkit.quantize.mappings import block_mappings, fold_scales
from optkit.quantize.observers import minmax_observer, mse_observer
from optkit.quantize.primitives import compute_qparams, dequantize, quantize
from optkit.quantize.scheme import QuantScheme
from optkit.testing.tiny import tiny_llama

W4G16 = QuantScheme(4, 16, True)


def _correlated_inputs(n=2048, d=64, seed=0):
    """Activations as LLMs have them: channels strongly correlated (a few latent directions plus
    noise) and a handful of outlier channels much larger than the rest."""
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, 6, generator=g) @ torch.randn(6, d, generator=g)
    x = latent + 0.2 * torch.randn(n, d, generator=g)
    x[:, :: d // 4] *= 10
    return x


def _rtn(w, scheme):
    s, z = compute_qparams(w, scheme, torch.float32)
    return dequantize(quantize(w, s, z, scheme), s, z, scheme)


def test_accumulate_hessian_is_x_transpose_x():
    x = torch.randn(3, 5, 8)
    H = accumulate_hessian(None, x[:2])
    H = accumulate_hessian(H, x[2:])
    flat = x.reshape(-1, 8)
    torch.testing.assert_close(H, flat.T @ flat, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", [W4G16, QuantScheme(4, 16, False), QuantScheme(8, None, True), QuantScheme(4, None, True)])
def test_gptq_output_error_below_rtn_on_correlated_inputs(scheme):
    x = _correlated_inputs()
    w = torch.randn(48, 64)
    H = accumulate_hessian(None, x)
    res = gptq_quantize(w, H, scheme, torch.float32)
    err_gptq = output_error(w, res.weight.dequantize(), H)
    err_rtn = output_error(w, _rtn(w, scheme), H)
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)
    assert res.retries == 0 and res.damp == 0.01
    q = res.weight.q
    assert q.dtype == torch.int8 and int(q.min()) >= scheme.qmin and int(q.max()) <= scheme.qmax


def test_gptq_act_order_keeps_static_groups_and_beats_rtn():
    x = _correlated_inputs(seed=1)
    w = torch.randn(32, 64)
    H = accumulate_hessian(None, x)
    res = gptq_quantize(w, H, W4G16, torch.float32, act_order=True)
    # static groups: every scale comes from the original weights, in the original column order
    s_ref, _ = minmax_observer(w, W4G16, torch.float32)
    torch.testing.assert_close(res.weight.scale, s_ref)
    assert output_error(w, res.weight.dequantize(), H) < 0.8 * output_error(w, _rtn(w, W4G16), H)


def test_gptq_blocks_smaller_than_group_and_mse_observer_still_work():
    x = _correlated_inputs(seed=2)
    w = torch.randn(16, 64)
    H = accumulate_hessian(None, x)
    a = gptq_quantize(w, H, W4G16, torch.float32, block_size=8, observer=mse_observer)
    assert output_error(w, a.weight.dequantize(), H) < output_error(w, _rtn(w, W4G16), H)


def test_cholesky_failure_retries_with_more_dampening_and_says_so():
    n = 16
    e = torch.ones(n, 1) / n**0.5
    H = torch.eye(n) - 1.5 * (e @ e.T)  # eigenvalue -0.5: not positive definite
    U, damp, retries = inverse_hessian_cholesky(H, 0.01)
    assert retries == 2 and damp == pytest.approx(1.0)  # 0.01 and 0.1 fail, 1.0 succeeds
    assert torch.isfinite(U).all()
    res = gptq_quantize(torch.randn(4, n), H, QuantScheme(8, None, True), torch.float32)
    assert res.retries == 2
    with pytest.raises(QuantizationError, match="not positive definite"):
        inverse_hessian_cholesky(-1000 * torch.eye(n), 0.01)


def test_gptq_dead_inputs_do_not_produce_nan():
    x = _correlated_inputs(n=512, d=32)
    x[:, 5] = 0  # a channel that never fires
    H = accumulate_hessian(None, x)
    res = gptq_quantize(torch.randn(8, 32), H, QuantScheme(4, 16, True), torch.float32)
    assert torch.isfinite(res.weight.scale).all()


def test_mse_observer_never_worse_than_minmax_and_clips_outliers():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    w[:, ::37] *= 8  # outliers
    imp = torch.rand(128, generator=g) + 0.1
    for scheme in (W4G16, QuantScheme(4, 32, False), QuantScheme(8, None, True)):
        for importance in (None, imp):
            weights = torch.ones(128) if importance is None else importance
            errs = {}
            for name, obs in (("minmax", minmax_observer), ("mse", mse_observer)):
                s, z = obs(w, scheme, torch.float32, importance)
                errs[name] = float((((w - dequantize(quantize(w, s, z, scheme), s, z, scheme)) ** 2) * weights).sum())
            assert errs["mse"] <= errs["minmax"] * (1 + 1e-6)
            if scheme.bits == 4:
                assert errs["mse"] < errs["minmax"]


def test_awq_search_never_worse_than_unscaled_and_clip_beats_minmax():
    x = _correlated_inputs(seed=3)
    H = accumulate_hessian(None, x)
    ws = [torch.randn(24, 64), torch.randn(40, 64)]
    res = search_scales(ws, H, x.abs().mean(0), W4G16, torch.float32, grid=10)
    assert res.error <= res.error_unscaled
    assert res.alpha > 0 and res.error < 0.9 * res.error_unscaled  # salient channels exist: scaling helps
    w = ws[0]
    s, z = search_clip(w, H, W4G16, torch.float32)
    clipped = dequantize(quantize(w, s, z, W4G16), s, z, W4G16)
    assert quadratic_error(w - clipped, H) <= quadratic_error(w - _rtn(w, W4G16), H)


def _block_outputs(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("kind", ["random", "awq", "smoothquant"])
def test_scale_folding_leaves_the_float_model_unchanged(kind):
    torch.manual_seed(0)
    model = tiny_llama(128, hidden=64, intermediate=128, heads=4, kv_heads=4, layers=2).float().eval()
    ids = torch.randint(0, 128, (2, 16))
    before = _block_outputs(model, ids)
    for block in model.model.layers:
        mappings = block_mappings(model, block, "test")
        assert [m.prev for m in mappings] == ["input_layernorm", "self_attn.v_proj", "post_attention_layernorm", "mlp.up_proj"]
        for m in mappings:
            lins = [block.get_submodule(n) for n in m.linears]
            d = lins[0].in_features
            act = torch.rand(d) * 5 + 0.1
            if kind == "random":
                s = torch.rand(d) * 4 + 0.25
            elif kind == "awq":
                H = torch.diag(act**2)
                s = search_scales([lin.weight.data for lin in lins], H, act, W4G16, torch.float32, grid=5).scales
            else:
                s = smooth_scales(act, [lin.weight.data for lin in lins], 0.8)
            fold_scales(block.get_submodule(m.prev), lins, s)
    after = _block_outputs(model, ids)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_gqa_skips_v_to_o_mapping():
    model = tiny_llama(128, hidden=64, intermediate=128, heads=4, kv_heads=2, layers=1)
    prevs = [m.prev for m in block_mappings(model, model.model.layers[0], "test")]
    assert "self_attn.v_proj" not in prevs and "input_layernorm" in prevs


def test_smooth_scales_formula_and_outlier_reduction():
    act = torch.tensor([1.0, 100.0, 2.0, 0.0])
    w = [torch.tensor([[1.0, 0.5, 2.0, 1.0]]), torch.tensor([[0.5, 0.25, 1.0, 3.0]])]
    s = smooth_scales(act, w, 0.5)
    wmax = torch.tensor([1.0, 0.5, 2.0, 3.0])
    torch.testing.assert_close(s[:3], (act[:3] / wmax[:3]).sqrt())
    assert s[3] == 1.0  # a channel that never fires is left alone
    assert (act / s)[:3].max() / (act / s)[:3].min() < act[:3].max() / act[:3].min()


def test_per_token_activation_quantization():
    x = torch.tensor([[0.0, 1.0, -2.0, 0.5], [10.0, -10.0, 3.0, 0.01]])
    xq = quantize_activation_per_token(x)
    steps = x.abs().amax(-1, keepdim=True) / 127.5  # compressed-tensors' symmetric int8 step
    torch.testing.assert_close(xq, torch.clamp(torch.round(x / steps), -128, 127) * steps)
    assert ((xq - x).abs() <= steps / 2 + 1e-6).all()  # never more than half a step, even at the clamp


def test_fold_scales_with_linear_producer():
    prev, nxt = nn.Linear(8, 6), nn.Linear(6, 4)
    x = torch.randn(5, 8)
    y = nxt(prev(x))
    fold_scales(prev, [nxt], torch.rand(6) + 0.5)
    torch.testing.assert_close(nxt(prev(x)), y, rtol=1e-5, atol=1e-5)


def test_refine_scales_never_raises_the_output_error():
    x = _correlated_inputs(seed=4)
    H = accumulate_hessian(None, x)
    w = torch.randn(32, 64)
    for scheme in (W4G16, QuantScheme(4, 16, False), QuantScheme(8, None, True)):
        qw = gptq_quantize(w, H, scheme, torch.bfloat16).weight
        refined = refine_scales(w, qw, H)
        assert torch.equal(refined.q, qw.q)  # codes fixed, only scales move
        assert refined.scale.dtype == torch.bfloat16
        assert output_error(w, refined.dequantize(), H) <= output_error(w, qw.dequantize(), H)
    qw = gptq_quantize(w, H, W4G16, torch.float32).weight
    assert output_error(w, refine_scales(w, qw, H).dequantize(), H) < 0.99 * output_error(w, qw.dequantize(), H)


def test_error_correction_fits_the_float_outputs():
    g = torch.Generator().manual_seed(5)
    x_float = _correlated_inputs(seed=5)
    x_quant = x_float + 0.05 * torch.randn(x_float.shape, generator=g) * x_float.abs().mean(0)  # upstream error
    w = torch.randn(16, 64, generator=g)
    H = accumulate_hessian(None, x_quant)
    D = (x_float - x_quant).T @ x_quant
    target = x_float @ w.T

    def err(v):
        return float(((x_quant @ v.T) - target).pow(2).sum())

    full = correct_for_input_error(w, H, D, alpha=1.0, damp=1e-6)
    half = correct_for_input_error(w, H, D, alpha=0.5, damp=1e-6)
    assert err(full) < err(half) < err(w)  # moving towards the least-squares optimum
    torch.testing.assert_close(correct_for_input_error(w, H, torch.zeros_like(D), 1.0), w)  # no upstream error
