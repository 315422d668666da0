"""Layer-by-layer calibration: capture, propagation, the calibrated pipeline, resume, bad input."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from optkit.calibration.capture import capture_first_inputs, execution_groups, propagate
from optkit.calibration.resume import ResumeStore
from optkit.errors import CalibrationError, QuantizationError
from optkit.export import load_dequantized_model, read_manifest
from optkit.pipeline import resume_dir, run_recipe
from optkit.recipe import recipe_from_dict
from optkit.testing.tiny import tiny_llama


def _recipe(ckpt, calib, out, num_samples=8, seq_len=64, **quant):
    return recipe_from_dict(
        {
            "model": {"source": str(ckpt)},
            "calibration": {"source": str(calib), "num_samples": num_samples, "seq_len": seq_len, "batch_size": 3},
            "quantization": {"scheme": "w4a16", "group_size": 32, **quant},
            "export": {"out": str(out)},
        }
    )


@pytest.mark.parametrize("offload", [False, True])
def test_block_by_block_float_run_reproduces_the_model(offload):
    torch.manual_seed(0)
    model = tiny_llama(128, layers=3).float().eval()
    ids = torch.randint(0, 128, (5, 24))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states  # embeddings, then each block (last one normed)
        inputs = capture_first_inputs(model, model.model.layers, ids, batch_size=2, offload=offload)
        assert len(inputs) == 3  # batches of 2, 2, 1
        torch.testing.assert_close(inputs.all_hidden(), ref[0])
        for i, block in enumerate(model.model.layers[:-1]):
            inputs = propagate(block, inputs)
            torch.testing.assert_close(inputs.all_hidden(), ref[i + 1], rtol=1e-5, atol=1e-5)


def test_execution_groups_follow_the_shared_inputs():
    model = tiny_llama(128, layers=1).float()
    ids = torch.randint(0, 128, (2, 16))
    inputs = capture_first_inputs(model, model.model.layers, ids, batch_size=2)
    names = [n for n, m in model.model.layers[0].named_modules() if isinstance(m, torch.nn.Linear)]
    groups = execution_groups(model.model.layers[0], names, inputs)
    assert groups == [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        ["self_attn.o_proj"],
        ["mlp.gate_proj", "mlp.up_proj"],
        ["mlp.down_proj"],
    ]


METHODS = {
    "gptq": {"algorithm": "gptq"},
    "gptq-actorder-ec": {"algorithm": "gptq", "gptq": {"act_order": True, "error_correction": 0.5}},
    "awq": {"algorithm": "awq"},
    "rtn-mse-importance": {"observer": "mse", "importance": True},
    "w8a8-sq-gptq": {"scheme": "w8a8", "group_size": "channel", "algorithm": "gptq", "smoothquant": {"alpha": 0.8}},
    "w8a8-sq-rtn": {"scheme": "w8a8", "group_size": "channel", "smoothquant": {"alpha": 0.5}},
}


@pytest.mark.parametrize("method", list(METHODS))
def test_calibrated_methods_beat_rtn_on_output_error_and_record_it(tiny_ckpt, small_calib, tmp_path, method):
    out = tmp_path / "art"
    res = run_recipe(_recipe(tiny_ckpt, small_calib, out, **METHODS[method]))
    summary = res.to_json()
    oe = summary["output_error"]
    assert oe["layers"] == 14  # 2 blocks x 7 linears
    if METHODS[method].get("scheme") != "w8a8" or METHODS[method].get("algorithm") == "gptq":
        assert oe["mean"] < oe["mean_rtn"], oe
    manifest = read_manifest(out)
    assert manifest["calibrated"]["layers"].keys() == {n for n in manifest["layers"]["quantized"]}
    assert not resume_dir(out).exists()  # the resume state is removed once the artifact is in place
    if "smoothquant" in METHODS[method]:
        tr = manifest["calibrated"]["transforms"]["0"]
        assert "input_layernorm -> self_attn.q_proj,self_attn.k_proj,self_attn.v_proj" in tr
        assert all(t["absmax_after"] < t["absmax_before"] for t in tr.values())
        assert manifest["layers"]["quantized"]["model.layers.0.mlp.down_proj"]["act_bits"] == 8


def test_too_few_calibration_tokens_is_an_error_not_a_nan(tiny_ckpt, small_calib, tmp_path):
    with pytest.raises(CalibrationError, match=r"saw 16 calibration tokens; it needs at least \d+ \(its input width"):
        run_recipe(_recipe(tiny_ckpt, small_calib, tmp_path / "a", num_samples=2, seq_len=8, algorithm="gptq"))
    assert not (tmp_path / "a").exists()


def test_awq_on_an_architecture_without_mappings_names_what_is_missing(small_calib, tmp_path):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from optkit.testing.tiny import tiny_tokenizer

    cfg = GPTNeoXConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    ckpt = tmp_path / "neox"
    GPTNeoXForCausalLM(cfg).save_pretrained(ckpt)
    tiny_tokenizer().save_pretrained(ckpt)
    with pytest.raises(QuantizationError, match=r"AWQ needs to know which norm or linear feeds which linears, "
                       r"and architecture GPTNeoXForCausalLM has no mappings; known: LlamaForCausalLM"):
        run_recipe(_recipe(ckpt, small_calib, tmp_path / "a", algorithm="awq"))
    # GPTQ needs no mappings: it finds the blocks and quantizes every linear in them
    res = run_recipe(_recipe(ckpt, small_calib, tmp_path / "b", algorithm="gptq"))
    assert res.to_json()["output_error"]["layers"] == 8


_KILL_MIDWAY = textwrap.dedent(
    """
    import os, signal, sys
    import optkit.calibration.sequential as seq
    from optkit.pipeline import run_recipe
    from optkit.recipe import load_recipe
    real = seq.gptq_quantize
    calls = 0
    def gptq_then_die(*a, **kw):
        global calls
        calls += 1
        if calls == int(sys.argv[2]):  # in the middle of block 1, after block 0 was checkpointed
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **kw)
    seq.gptq_quantize = gptq_then_die
    run_recipe(load_recipe(sys.argv[1]))
    """
)


def _write_recipe(path, ckpt, calib, out, **quant):
    data = {
        "model": {"source": str(ckpt)},
        "calibration": {"source": str(calib), "num_samples": 8, "seq_len": 64, "batch_size": 3},
        "quantization": {"scheme": "w4a16", "group_size": 32, "algorithm": "gptq", **quant},
        "export": {"out": str(out)},
    }
    path.write_text(json.dumps(data))  # JSON is YAML
    return path


@pytest.mark.parametrize("quant", [{}, {"gptq": {"error_correction": 1.0}}], ids=["gptq", "gptq-error-correction"])
def test_killed_run_resumes_and_gives_the_same_artifact(tiny_ckpt, small_calib, tmp_path, quant):
    script = tmp_path / "die.py"
    script.write_text(_KILL_MIDWAY)
    killed_out = tmp_path / "resumed"
    recipe = _write_recipe(tmp_path / "r.yaml", tiny_ckpt, small_calib, killed_out, **quant)
    proc = subprocess.run([sys.executable, str(script), str(recipe), "10"], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]  # SIGKILL: no cleanup ran
    assert not killed_out.exists()
    state = json.loads((resume_dir(killed_out) / "state.json").read_text())
    assert state["blocks_done"] == 1

    resumed = run_recipe(_recipe_from_file(recipe))
    assert resumed.calibrated.resumed_from == 1
    assert any("resumed from" in n for n in resumed.notices)
    assert not resume_dir(killed_out).exists()

    fresh_out = tmp_path / "fresh"
    run_recipe(_recipe_from_file(_write_recipe(tmp_path / "f.yaml", tiny_ckpt, small_calib, fresh_out, **quant)))
    for f in sorted(os.listdir(fresh_out)):
        if f == "optkit.json":
            a, b = json.loads((fresh_out / f).read_text()), json.loads((killed_out / f).read_text())
            a["recipe"]["export"].pop("out"), b["recipe"]["export"].pop("out")
            assert a == b
        else:
            assert (fresh_out / f).read_bytes() == (killed_out / f).read_bytes(), f


def _recipe_from_file(path):
    from optkit.recipe import load_recipe

    return load_recipe(path)


def test_resume_state_of_another_run_is_ignored(tiny_ckpt, small_calib, tmp_path):
    out = tmp_path / "art"
    store = ResumeStore(resume_dir(out), "0" * 64)
    store.put_extra("sensitivity", {"stale": True})
    res = run_recipe(_recipe(tiny_ckpt, small_calib, out, algorithm="gptq"))
    assert res.calibrated.resumed_from == 0
    assert not resume_dir(out).exists()


def test_resume_off_writes_no_state(tiny_ckpt, small_calib, tmp_path, monkeypatch):
    saved = []
    monkeypatch.setattr(ResumeStore, "save", lambda self, *a, **k: saved.append(a))
    run_recipe(_recipe(tiny_ckpt, small_calib, tmp_path / "a", algorithm="gptq", resume=False))
    assert saved == []


def test_w8a8_artifact_quantizes_activations_when_read_back(tiny_ckpt, small_calib, tmp_path):
    out = tmp_path / "art"
    run_recipe(_recipe(tiny_ckpt, small_calib, out, **METHODS["w8a8-sq-rtn"]))
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "int-quantized"
    group = cfg["config_groups"]["group_0"]
    assert group["input_activations"] == {**group["input_activations"], "num_bits": 8, "strategy": "token", "dynamic": True}
    model = load_dequantized_model(out)
    from optkit.quantize.modules import QuantizedLinear

    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantizedLinear) and q.scheme.act_bits == 8
    x = torch.randn(3, q.in_features)
    with torch.no_grad():
        w = q.dequantize()
        assert not torch.allclose(q(x), x @ w.T)  # inputs are quantized...
        assert (q(x) - x @ w.T).abs().max() < 0.05 * (x @ w.T).abs().max()  # ...to int8, per token


def test_offloaded_run_matches_in_memory_and_leaves_no_scratch(tiny_ckpt, small_calib, tmp_path):
    import glob
    import tempfile

    before = set(glob.glob(f"{tempfile.gettempdir()}/optkit-offload-*"))
    mem = run_recipe(_recipe(tiny_ckpt, small_calib, tmp_path / "mem", algorithm="gptq"))
    recipe = _recipe(tiny_ckpt, small_calib, tmp_path / "disk", algorithm="gptq")
    recipe = recipe.model_copy(update={"calibration": recipe.calibration.model_copy(update={"offload": True})})
    disk = run_recipe(recipe)
    assert set(glob.glob(f"{tempfile.gettempdir()}/optkit-offload-*")) == before
    assert disk.calibrated.layers == mem.calibrated.layers
    assert (tmp_path / "disk" / "model.safetensors").read_bytes() == (tmp_path / "mem" / "model.safetensors").read_bytes()
