import pytest
import torch

from optkit.errors import QuantizationError
from optkit.quantize.modules import QuantizedEmbedding, QuantizedLinear
from optkit.quantize.plan import INT8_PER_ROW, apply_plan, matches, plan_layers, runtime_notes
from optkit.quantize.scheme import QuantScheme
from optkit.recipe import QuantizationConfig
from optkit.testing.tiny import tiny_llama

W4G32 = QuantScheme(4, 32, True)


def _plan(model, scheme=W4G32, **kw):
    cfg = QuantizationConfig(
        scheme="w4a16" if scheme.bits == 4 else "w8a16",
        group_size=scheme.group_size or "channel",
        symmetric=scheme.symmetric,
        **kw,
    )
    assert cfg.weight_scheme() == scheme
    return plan_layers(model, cfg, tied=model.config.tie_word_embeddings)


def test_default_plan_quantizes_every_linear_but_lm_head():
    model = tiny_llama(64, layers=2)
    plan = _plan(model)
    assert len(plan.linears) == 2 * 7
    assert "lm_head" not in plan.linears and plan.excluded == ("lm_head",)
    assert not plan.embeddings and not plan.untie


def test_patterns_glob_and_regex():
    assert matches("model.layers.0.mlp.up_proj", "*mlp*")
    assert matches("model.layers.0.mlp.up_proj", "re:.*\\.(up|down)_proj")
    assert not matches("model.layers.0.mlp.gate_proj", "re:.*\\.(up|down)_proj")
    model = tiny_llama(64, layers=2)
    plan = _plan(model, include=["*.mlp.*"], exclude=["model.layers.1.*"])
    assert sorted(plan.linears) == [f"model.layers.0.mlp.{p}_proj" for p in ("down", "gate", "up")]
    assert "model.layers.1.mlp.up_proj" in plan.excluded


def test_pattern_matching_nothing_is_an_error():
    with pytest.raises(QuantizationError, match="'nothing.*' matches no Linear layer"):
        _plan(tiny_llama(64), exclude=["nothing.*"])
    with pytest.raises(QuantizationError, match="invalid regular expression"):
        _plan(tiny_llama(64), include=["re:(("])


def test_excluding_everything_is_an_error():
    with pytest.raises(QuantizationError, match="nothing to quantize"):
        _plan(tiny_llama(64), exclude=["*"])


def test_runtime_notes_flag_what_standard_runtimes_cannot_load():
    model = tiny_llama(64)
    assert runtime_notes(_plan(model)) == []
    assert "llm-compressor issue #1618" in runtime_notes(_plan(model, scheme=QuantScheme(4, 32, False)))[0]
    assert "int8 embeddings" in runtime_notes(_plan(model, embeddings="int8"))[0]


def test_group_misfit_names_layer_and_fitting_sizes():
    model = tiny_llama(64, hidden=96, intermediate=160, heads=4, kv_heads=2)
    with pytest.raises(QuantizationError) as exc:
        _plan(model, scheme=QuantScheme(4, 64, True))
    msg = str(exc.value)
    # q_proj has in_features 96: 32 fits, 64 does not; down_proj has 160: only 32 fits
    assert "model.layers.0.self_attn.q_proj (group_size 64, in_features 96; group sizes that fit: 32, 'channel')" in msg
    assert "model.layers.0.mlp.down_proj (group_size 64, in_features 160; group sizes that fit: 32, 'channel')" in msg
    assert "allow_skip" in msg


def test_allow_skip_lists_every_skipped_layer():
    model = tiny_llama(64, hidden=128, intermediate=96, heads=4, kv_heads=2, layers=2)
    plan = _plan(model, scheme=QuantScheme(4, 64, True), allow_skip=True)
    assert sorted(plan.skipped) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert "in_features 96 is not divisible by group_size 64" in plan.skipped["model.layers.0.mlp.down_proj"]
    assert len(plan.linears) == 2 * 6


def test_int8_head_and_embeddings_untie_and_quantize():
    model = tiny_llama(64)
    emb_before = model.model.embed_tokens.weight.detach().clone()
    plan = _plan(model, lm_head="int8", embeddings="int8")
    assert plan.linears["lm_head"] == INT8_PER_ROW and plan.embeddings == {"model.embed_tokens": INT8_PER_ROW}
    assert plan.untie
    apply_plan(model, plan, torch.float32)
    assert isinstance(model.lm_head, QuantizedLinear) and isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert model.config.tie_word_embeddings is False
    ids = torch.tensor([[0, 5, 63]])
    got = model.model.embed_tokens(ids)
    step = model.model.embed_tokens.weight_scale[ids.flatten()].reshape(1, 3, 1)
    assert bool(((got - emb_before[ids]).abs() <= step / 2 + 1e-6).all())


def _relative_logit_error(scheme, seen=None):
    model = tiny_llama(64)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        plan = _plan(model, scheme=scheme)
        apply_plan(model, plan, torch.float32, on_layer=None if seen is None else seen.append)
        out = model(ids).logits
    assert all(isinstance(model.get_submodule(n), QuantizedLinear) for n in plan.linears)
    return float((out - ref).norm() / ref.norm()), plan


def test_apply_plan_replaces_modules_and_keeps_outputs_close():
    seen = []
    err8, plan = _relative_logit_error(QuantScheme(8, None, True), seen)
    err4, _ = _relative_logit_error(QuantScheme(4, 32, True))
    assert seen == list(plan.linears)
    # int8 per channel barely moves the logits (a wrong scale or layout would give ~1),
    # and int4 moves them several times more.
    assert err8 < 0.05, err8
    assert err4 > 3 * err8, (err4, err8)
