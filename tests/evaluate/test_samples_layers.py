"""Greedy side-by-side samples, and per-layer SQNR of artifacts made by the pipeline."""

import json
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from optkit.errors import UserError
from optkit.evaluate.layers import output_sqnr, per_layer_sqnr, rescaled_layers
from optkit.evaluate.samples import greedy_samples, prompt_ids
from optkit.export import load_dequantized_model, load_quantized_weights, read_manifest
from optkit.pipeline import run_recipe
from optkit.recipe import recipe_from_dict
from optkit.testing.tiny import tiny_llama, tiny_tokenizer

PROMPTS = ["Hello there", "Name three colours.", "x"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_llama(len(tok), seed=5)


def _hand_greedy(model, ids, max_new, eos):
    """Reference decoding: full forward each step, argmax of the last position."""
    ids = list(ids)
    new = []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if nxt == eos:
                break
            new.append(nxt)
            ids.append(nxt)
    return new


@pytest.mark.parametrize("mode", ["auto", "never"])
def test_greedy_samples_are_deterministic_and_equal_a_hand_greedy_loop(model, tok, mode):
    first = greedy_samples(model, tok, PROMPTS, max_new_tokens=12, chat_template=mode)
    again = greedy_samples(model, tok, PROMPTS, max_new_tokens=12, chat_template=mode)
    assert first == again
    assert [s["prompt"] for s in first] == PROMPTS and set(first[0]) == {"prompt", "text"}
    for prompt, sample in zip(PROMPTS, first, strict=True):
        want = _hand_greedy(model, prompt_ids(tok, prompt, mode), 12, tok.eos_token_id)
        assert sample["text"] == tok.decode(want, skip_special_tokens=True), prompt


def test_chat_template_modes(tok):
    chat = tok.decode(prompt_ids(tok, "hi", "auto"))
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_ids(tok, "hi", "always") == prompt_ids(tok, "hi", "auto")
    assert tok.decode(prompt_ids(tok, "hi", "never")) == "hi"
    plain = tiny_tokenizer()
    plain.chat_template = None
    assert prompt_ids(plain, "hi", "auto") == prompt_ids(plain, "hi", "never")
    with pytest.raises(UserError, match="no chat template"):
        prompt_ids(plain, "hi", "always")
    with pytest.raises(UserError, match="chat_template must be one of auto, always, never"):
        prompt_ids(tok, "hi", "yes")


# --------------------------------------------------------------------------- per-layer SQNR

VARIANTS = {
    "int8": {"scheme": "w8a16", "group_size": "channel"},
    "int4": {"scheme": "w4a16", "group_size": 32},
    "int4-awq": {"scheme": "w4a16", "group_size": 32, "algorithm": "awq"},
}


@pytest.fixture(scope="module")
def artifacts(tiny_ckpt, tmp_path_factory):
    """One artifact per variant, made by the pipeline from the tiny checkpoint."""
    root = tmp_path_factory.mktemp("layer-sqnr")
    calib = root / "calib.txt"
    words = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex junk".split()
    calib.write_text(" ".join(words[(i * 7) % len(words)] for i in range(3000)))
    out = {}
    with pytest.MonkeyPatch.context() as mp:  # the per-test isolation is not set up yet for a module fixture
        mp.chdir(root)
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_HOME", str(root / "hf-home"))
        mp.setenv("OPTKIT_CACHE", str(root / "optkit-cache"))
        for name, quant in VARIANTS.items():
            recipe = recipe_from_dict({
                "model": {"source": str(tiny_ckpt)},
                "calibration": {"source": str(calib), "num_samples": 4, "seq_len": 64},
                "quantization": quant,
                "export": {"out": str(root / name)},
            })
            run_recipe(recipe)
            out[name] = root / name
    return out


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    return AutoModelForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()


def test_per_layer_sqnr_is_finite_for_every_quantized_layer_and_int8_beats_int4(artifacts, reference):
    state = reference.state_dict()
    sqnr = {k: per_layer_sqnr(state, artifacts[k]) for k in ("int8", "int4")}
    for name, values in sqnr.items():
        assert set(values) == set(load_quantized_weights(artifacts[name])) and values
        assert all(math.isfinite(v) for v in values.values()), values
        assert list(values.values()) == sorted(values.values())  # worst first
        assert rescaled_layers(artifacts[name]).weights == frozenset()
    for layer, db in sqnr["int8"].items():
        assert db > sqnr["int4"][layer] + 15, layer  # ~6 dB per bit; 4 bits apart, less the int4 group scales' gain
    assert min(sqnr["int8"].values()) > 30 and min(sqnr["int4"].values()) > 10


def test_awq_rescaled_layers_are_left_out_of_weight_sqnr(artifacts, reference):
    path = artifacts["int4-awq"]
    rescaled = rescaled_layers(path)
    transforms = read_manifest(path)["calibrated"]["transforms"]
    assert "model.layers.0.self_attn.q_proj" in rescaled.weights and "model.layers.1.mlp.down_proj" in rescaled.weights
    assert "model.layers.0.mlp.up_proj" in rescaled.outputs  # up_proj -> down_proj: up_proj's rows were divided
    assert "model.layers.0.self_attn.q_proj" not in rescaled.outputs
    assert any(" -> " in key for block in transforms.values() for key in block)
    quantized = set(load_quantized_weights(path))
    values = per_layer_sqnr(reference.state_dict(), path)
    assert set(values) == quantized - rescaled.weights
    assert all(math.isfinite(v) for v in values.values())


def test_per_layer_sqnr_rejects_a_reference_of_another_model(artifacts, tok):
    other = tiny_llama(len(tok), hidden=32, intermediate=64).state_dict()
    with pytest.raises(UserError, match="reference shape"):
        per_layer_sqnr(other, artifacts["int8"])
    with pytest.raises(UserError, match="the reference weights have no"):
        per_layer_sqnr({}, artifacts["int8"])


def test_output_sqnr_per_linear(artifacts, reference):
    tokens = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))  # (W, L)
    linears = {n for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear)}
    same = output_sqnr(reference, reference, tokens)
    assert set(same) == linears and all(v == math.inf for v in same.values())
    per = {k: output_sqnr(reference, load_dequantized_model(artifacts[k]), tokens) for k in ("int8", "int4")}
    for values in per.values():
        assert set(values) == linears and all(math.isfinite(v) for v in values.values())
        assert list(values.values()) == sorted(values.values())
    better = sum(per["int8"][n] > per["int4"][n] for n in linears)
    assert better == len(linears)
    skip = rescaled_layers(artifacts["int4-awq"]).outputs
    awq = output_sqnr(reference, load_dequantized_model(artifacts["int4-awq"]), tokens[0], skip=skip)
    assert set(awq) == linears - skip and all(math.isfinite(v) for v in awq.values())
    json.dumps(per)


def test_output_sqnr_refuses_mismatched_models(reference, tok):
    other = tiny_llama(len(tok), layers=1)
    with pytest.raises(ValueError, match="model_q has no module"):
        output_sqnr(reference, other, torch.tensor([5, 6, 7]))


def test_rescaled_layers_of_an_unknown_architecture(artifacts, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(artifacts["int4-awq"], copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["architectures"] = ["MadeUpForCausalLM"]
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="has no layer spec"):
        rescaled_layers(copy)
