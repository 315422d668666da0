"""Sensitivity measurement and budgeted mixed precision."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from optkit.errors import QuantizationError
from optkit.export import load_dequantized_model, read_manifest
from optkit.pipeline import bits_per_weight, run_recipe
from optkit.quantize.mixed import Option, choose_precisions
from optkit.quantize.observers import minmax_observer
from optkit.quantize.primitives import dequantize, quantize
from optkit.quantize.scheme import QuantScheme
from optkit.quantize.sensitivity import measure_sensitivity
from optkit.recipe import recipe_from_dict
from optkit.testing.tiny import tiny_llama


def _table(seed=0, n=8):
    g = torch.Generator().manual_seed(seed)
    params = {f"l{i}": int(p) for i, p in enumerate(torch.randint(1000, 5000, (n,), generator=g))}
    options = {}
    for name in params:
        kl4 = float(torch.rand(1, generator=g)) * 0.1
        kl8 = kl4 * float(torch.rand(1, generator=g)) * 0.1
        options[name] = [Option("4bit", 4.25, kl4), Option("8bit", 8.03, kl8), Option("16bit", 16.0, 0.0)]
    return options, params


def _bits(choice, options, params):
    total = sum(params.values())
    return sum(params[n] * next(o.bits for o in options[n] if o.label == lbl) for n, lbl in choice.items()) / total


@pytest.mark.parametrize("budget", [4.25, 4.5, 5.0, 6.0, 9.0, 16.0])
def test_plan_respects_the_bit_budget_and_beats_uniform_plans(budget):
    options, params = _table()
    plan = choose_precisions(options, params, bits_per_weight=budget)
    assert plan.bits_per_weight <= budget + 1e-9
    assert plan.bits_per_weight == pytest.approx(_bits(plan.choice, options, params))
    kl = {lbl: sum(next(o.kl for o in options[n] if o.label == lbl) for n in params) for lbl in ("4bit", "8bit", "16bit")}
    for lbl, bits in (("4bit", 4.25), ("8bit", 8.03), ("16bit", 16.0)):
        if bits <= budget:
            assert plan.predicted_kl <= kl[lbl] + 1e-12


def test_plan_is_close_to_the_exhaustive_optimum():
    options, params = _table(seed=3, n=6)
    budget = 6.0
    best = min(
        (sum(o.kl for o in combo), combo)
        for combo in itertools.product(*options.values())
        if sum(params[n] * o.bits for n, o in zip(params, combo, strict=False)) <= budget * sum(params.values())
    )
    plan = choose_precisions(options, params, bits_per_weight=budget)
    assert plan.predicted_kl <= best[0] + 0.25 * (sum(o[0].kl for o in options.values()) - best[0])


def test_max_kl_gives_a_plan_that_meets_it():
    options, params = _table(seed=1)
    target = 0.5 * sum(o[0].kl for o in options.values())
    plan = choose_precisions(options, params, max_kl=target)
    assert plan.predicted_kl <= target
    assert plan.bits_per_weight < 16.0


def test_budget_that_no_plan_meets_names_the_closest_plan():
    options, params = _table()
    with pytest.raises(QuantizationError, match=r"no plan fits 4.0 bits/weight: the smallest plan needs 4.250 "
                       r"\(closest plan: 4.250 bits/weight, predicted KL [0-9.]+ \(8 x 4bit\)\)"):
        choose_precisions(options, params, bits_per_weight=4.0)
    no16 = {n: o[:2] for n, o in options.items()}
    with pytest.raises(QuantizationError, match=r"no plan reaches predicted KL <= 1e-09 with these candidates "
                       r"\(closest plan: 8.030 bits/weight"):
        choose_precisions(no16, params, max_kl=1e-9)


def test_sensitivity_equals_the_kl_of_quantizing_that_layer_in_the_whole_model():
    torch.manual_seed(0)
    model = tiny_llama(128, layers=2).float().eval()
    ids = torch.randint(0, 128, (3, 20))
    scheme = QuantScheme(4, 32, True)
    names = ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"]
    table = measure_sensitivity(model, ids, {n: {"4bit": scheme} for n in names}, minmax_observer, torch.float32)
    with torch.no_grad():
        ref = F.log_softmax(model(ids).logits.float(), -1)
        for n in names:
            lin = model.get_submodule(n)
            w = lin.weight.data.clone()
            s, z = minmax_observer(w, scheme, torch.float32, None)
            lin.weight.data = dequantize(quantize(w, s, z, scheme), s, z, scheme)
            logp = F.log_softmax(model(ids).logits.float(), -1)
            lin.weight.data = w
            expected = float((ref.exp() * (ref - logp)).sum(-1).mean())
            assert table.kl[n]["4bit"] == pytest.approx(expected, rel=1e-3, abs=1e-7)
            assert expected > 0
    assert table.tokens == 60 and table.params[names[0]] == model.get_submodule(names[0]).weight.numel()


def test_mixed_recipe_end_to_end_budget_and_saved_plan(tiny_ckpt, small_calib, tmp_path):
    out = tmp_path / "art"
    recipe = recipe_from_dict(
        {
            "model": {"source": str(tiny_ckpt)},
            "calibration": {"source": str(small_calib), "num_samples": 8, "seq_len": 64},
            "quantization": {
                "scheme": "w4a16", "group_size": 32, "algorithm": "gptq",
                "layers": [{"match": "*.0.mlp.down_proj", "precision": "16bit"}],
                "mixed_precision": {"bits_per_weight": 5.0, "num_samples": 2, "seq_len": 32},
            },
            "export": {"out": str(out)},
        }
    )
    res = run_recipe(recipe)
    manifest = read_manifest(out)
    mp = manifest["mixed_precision"]
    assert mp["bits_per_weight"] <= 5.0
    written = manifest["layers"]["quantized"]
    model = load_dequantized_model(out)
    params = manifest["sensitivity"]["layers"]
    total = bits = 0.0
    for name, label in mp["choice"].items():
        info = written.get(name)
        assert (label == "16bit") == (info is None), name  # what was written is what was planned
        scheme = None if info is None else QuantScheme(info["bits"], info["group_size"], info["symmetric"])
        if scheme is not None:
            assert scheme.bits == (4 if label == "4bit" else 8)
        total += params[name]["params"]
        bits += params[name]["params"] * bits_per_weight(scheme, model.get_submodule(name).in_features)
    assert bits / total == pytest.approx(mp["bits_per_weight"]) and bits / total <= 5.0
    assert {lbl for lbl in mp["choice"].values()} >= {"4bit", "8bit"}  # the budget bought some upgrades
    assert "model.layers.0.mlp.down_proj" not in mp["choice"]  # fixed by hand, not planned
    assert "model.layers.0.mlp.down_proj" not in written  # and left 16-bit
    assert res.mixed is not None and res.to_json()["most_sensitive"]


def test_higher_bit_kl_is_measured_or_scaled_from_the_lowest():
    torch.manual_seed(1)
    model = tiny_llama(128, layers=2).float().eval()
    ids = torch.randint(0, 128, (2, 16))
    name = "model.layers.1.mlp.up_proj"
    opts = {name: {"4bit": QuantScheme(4, 32, True), "8bit": QuantScheme(8, None, True)}}
    low = measure_sensitivity(model, ids, opts, minmax_observer, torch.float32, measure="lowest")
    full = measure_sensitivity(model, ids, opts, minmax_observer, torch.float32, measure="all")
    assert low.measured[name] == ["4bit"] and sorted(full.measured[name]) == ["4bit", "8bit"]
    assert low.kl[name]["4bit"] == pytest.approx(full.kl[name]["4bit"])
    w = model.get_submodule(name).weight.data
    e = {}
    for lbl, sch in opts[name].items():
        s, z = minmax_observer(w, sch, torch.float32, None)
        e[lbl] = float((dequantize(quantize(w, s, z, sch), s, z, sch) - w).pow(2).sum())
    assert low.kl[name]["8bit"] == pytest.approx(low.kl[name]["4bit"] * e["8bit"] / e["4bit"])
    # the estimate and the measurement agree to within a factor of a few (KL ~ quadratic)
    assert 0.2 < low.kl[name]["8bit"] / full.kl[name]["8bit"] < 5
