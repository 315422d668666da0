"""The CLI as a user runs it: a real process, exit codes, messages, no tracebacks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def optkit(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "optkit.cli", *args], capture_output=True, text=True, cwd=cwd
    )


@pytest.fixture
def quant_args(tiny_ckpt, small_calib):
    return [str(tiny_ckpt), "--calib", str(small_calib), "--num-samples", "4", "--seq-len", "64"]


def test_quantize_end_to_end_then_verify(quant_args, tmp_path):
    out = tmp_path / "art"
    res = optkit("quantize", *quant_args, "--group-size", "32", "--out", str(out), "--summary-json", str(tmp_path / "s.json"))
    assert res.returncode == 0, res.stderr
    assert "int4-g32-sym" in res.stdout and "14 layers" in res.stdout and "optkit verify" in res.stdout
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["layers_quantized"] == 14 and summary["artifact"] == str(out)
    assert summary["artifact_bytes"] == sum(p.stat().st_size for p in out.iterdir())
    assert optkit("verify", str(out)).returncode == 0
    # out exists now: refused with exit 2, then replaced with --overwrite
    again = optkit("quantize", *quant_args, "--group-size", "32", "--out", str(out))
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr
    asym = optkit("quantize", *quant_args, "--group-size", "32", "--asym", "--out", str(out), "--overwrite")
    assert asym.returncode == 0 and "int4-g32-asym" in asym.stdout
    assert "WARNING" in asym.stdout and "#1618" in asym.stdout  # told at quantization time, not at deployment


def test_user_errors_exit_2_without_traceback_unless_debug(tmp_path):
    res = optkit("quantize", str(tmp_path / "missing"), "--out", str(tmp_path / "o"))
    assert res.returncode == 2
    assert "error: model" in res.stderr and "not found" in res.stderr and "Traceback" not in res.stderr
    dbg = optkit("--debug", "quantize", str(tmp_path / "missing"), "--out", str(tmp_path / "o"))
    assert dbg.returncode != 0 and "Traceback" in dbg.stderr
    assert not (tmp_path / "o").exists()


def test_group_size_that_does_not_fit_names_the_layer(tmp_path, small_calib):
    from optkit.testing.tiny import save_tiny_checkpoint

    ck = save_tiny_checkpoint(tmp_path / "wide", hidden=96, intermediate=192, heads=4, kv_heads=2)
    args = [str(ck), "--calib", str(small_calib), "--num-samples", "4", "--seq-len", "64"]
    res = optkit("quantize", *args, "--group-size", "64", "--out", str(tmp_path / "o"))
    assert res.returncode == 2
    assert "model.layers.0.self_attn.q_proj (group_size 64, in_features 96; group sizes that fit: 32" in res.stderr
    assert not (tmp_path / "o").exists()
    ok = optkit("quantize", *args, "--group-size", "64", "--allow-skip", "--out", str(tmp_path / "o"))
    assert ok.returncode == 0, ok.stderr
    assert "SKIPPED" in ok.stdout and "q_proj" in ok.stdout
    bad = optkit("quantize", *args, "--group-size", "sixty")
    assert bad.returncode == 2 and "--group-size: 'sixty' is not a number" in bad.stderr


def test_validate_and_schema(tmp_path):
    good = [str(p) for p in sorted(RECIPES.glob("*.yaml"))]
    res = optkit("validate", *good)
    assert res.returncode == 0 and res.stdout.count("ok:") == len(good)
    bad = tmp_path / "bad.yaml"
    bad.write_text("quantization:\n  scheme: w4a16\n  bits: 3\n")
    res = optkit("validate", good[0], str(bad))
    assert res.returncode == 2
    assert f"{bad}: quantization.bits: unknown key" in res.stderr and "Traceback" not in res.stderr
    schema = json.loads(optkit("schema").stdout)
    assert schema["title"] == "optkit recipe" and "quantization" in schema["properties"]


def test_run_recipe_with_out_override(tiny_ckpt, small_calib, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {{source: '{tiny_ckpt}'}}\n"
        f"calibration: {{source: '{small_calib}', num_samples: 4, seq_len: 64}}\n"
        "quantization: {scheme: w8a16}\n"
        "export: {out: ignored-by-override}\n"
    )
    res = optkit("run", str(recipe), "--out", str(tmp_path / "art"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "art" / "optkit.json").is_file() and not (tmp_path / "ignored-by-override").exists()


def test_verify_names_the_tampered_file(quant_args, tmp_path):
    out = tmp_path / "art"
    assert optkit("quantize", *quant_args, "--scheme", "w8a16", "--out", str(out)).returncode == 0
    cfg = out / "config.json"
    cfg.write_text(cfg.read_text().replace('"num_bits": 8', '"num_bits": 4'))
    res = optkit("verify", str(out))
    assert res.returncode == 1 and f"FAIL {out}/config.json: " in res.stderr
    missing = optkit("verify", str(tmp_path / "nothing-here"))
    assert missing.returncode == 2 and "not an artifact directory" in missing.stderr


def test_calibrated_flags_from_the_command_line(tiny_ckpt, small_calib, tmp_path):
    args = [str(tiny_ckpt), "--calib", str(small_calib), "--num-samples", "8", "--seq-len", "64", "--group-size", "32"]
    out = tmp_path / "gptq"
    res = optkit("quantize", *args, "--algorithm", "gptq", "--layer", "*.0.mlp.down_proj=8bit", "--out", str(out),
                 "--summary-json", str(tmp_path / "s.json"))
    assert res.returncode == 0, res.stderr
    assert "(gptq)" in res.stdout and "output error" in res.stdout and "peak memory" in res.stdout
    manifest = json.loads((out / "optkit.json").read_text())
    assert manifest["layers"]["quantized"]["model.layers.0.mlp.down_proj"]["bits"] == 8
    assert manifest["recipe"]["quantization"]["gptq"]["act_order"] is True
    # a budget below the smallest plan: exit 2, the closest plan named, nothing written
    bad = optkit("quantize", *args, "--bits-per-weight", "3", "--out", str(tmp_path / "mixed"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "no plan fits 3.0 bits/weight" in bad.stderr and "closest plan" in bad.stderr
    assert not (tmp_path / "mixed").exists()
    sq = optkit("quantize", *args, "--smoothquant", "0.5", "--out", str(tmp_path / "sq"))
    assert sq.returncode == 2 and "smoothquant applies to scheme w8a8 only" in sq.stderr
    w8a8 = optkit("quantize", *args[:-2], "--scheme", "w8a8", "--smoothquant", "0.5", "--out", str(tmp_path / "w8a8"))
    assert w8a8.returncode == 0, w8a8.stderr
    assert "int8-channel-sym-a8" in w8a8.stdout
