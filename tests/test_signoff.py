"""The sign-off run end to end: `optkit run` on a recipe with variants writes report.json/.md/.html
and its exit code follows the gates; failures are reported, not fatal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from optkit.report import report_json_schema

REPO = Path(__file__).resolve().parents[1]


def _optkit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "optkit.cli", *args], capture_output=True, text=True)


def _tiny_recipe(tmp_path, ckpt, calib, variants, gates, **report) -> Path:
    data = {
        "name": "tiny-signoff",
        "model": {"source": str(ckpt)},
        "calibration": {"source": str(calib), "num_samples": 4, "seq_len": 64},
        "export": {"out": str(tmp_path / "artifacts")},
        "variants": variants,
        "report": {
            "eval": {"source": str(calib), "seq_len": 64, "max_windows": 4},
            "max_task_items": 4,
            "samples": ["hello"],
            "speed": {"prompt_lens": [16], "batch_sizes": [1], "decode_tokens": 3, "repeats": 1},
            "memory_budget": "64MiB",
            "gates": gates,
            "out": str(tmp_path / "report"),
            **report,
        },
    }
    p = tmp_path / "signoff.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


VARIANTS = [
    {"name": "base"},
    {"name": "w8", "quantization": {"scheme": "w8a16"}},
    {"name": "w4-g256", "quantization": {"scheme": "w4a16", "group_size": 256}},  # does not fit hidden 64
]


def _check_formats(out: Path) -> dict:
    report = json.loads((out / "report.json").read_text())
    jsonschema.validate(report, report_json_schema())
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 2 and "https://" not in html
    assert "## " in (out / "report.md").read_text()
    return report


def test_failed_gate_exits_1_naming_it_and_failed_variant_is_reported(tiny_ckpt, small_calib, tmp_path):
    recipe = _tiny_recipe(tmp_path, tiny_ckpt, small_calib, VARIANTS, ["kl_divergence <= 0.0000001", "size_ratio <= 0.9"])
    res = _optkit("run", str(recipe))
    assert res.returncode == 1, res.stderr[-3000:]
    assert "kl_divergence <= 1e-07" in res.stdout and "FAIL" in res.stdout
    assert "variant w4-g256 FAILED" in res.stderr and "group" in res.stderr
    report = _check_formats(tmp_path / "report")
    status = {v["name"]: v["status"] for v in report["variants"]}
    assert status == {"base": "ok", "w8": "ok", "w4-g256": "failed"}
    w8 = next(v for v in report["variants"] if v["name"] == "w8")
    assert w8["quality"]["kl_divergence"]["value"] > 1e-7  # the gate failed on a measured value
    assert not report["verdict"]["passed"]


def test_passing_gates_exit_0_and_recommend_the_fastest(tiny_ckpt, small_calib, tmp_path):
    recipe = _tiny_recipe(tmp_path, tiny_ckpt, small_calib, VARIANTS[:2], ["size_ratio <= 0.9", "top1_agreement >= 0.1"])
    res = _optkit("run", str(recipe))
    assert res.returncode == 0, res.stderr[-3000:]
    report = _check_formats(tmp_path / "report")
    assert report["verdict"]["recommended"] == "w8" and report["verdict"]["passed"]
    w8 = next(v for v in report["variants"] if v["name"] == "w8")
    assert set(w8["quality"]["tasks"]) == {"optkit-facts", "optkit-cloze"}
    assert w8["memory"]["weight_bytes"]["value"] < report["variants"][0]["memory"]["weight_bytes"]["value"]
    assert report["provenance"]["checkpoint_fingerprint"] and report["provenance"]["calibration_fingerprint"]


@pytest.mark.parametrize(
    "gates,report_extra,message",
    [
        (["speediness >= 2"], {}, "speediness"),
        (["size_ratio <= 0.9"], {"eval": {"source": "SHORT", "seq_len": 512}}, "fewer than one window"),
    ],
)
def test_bad_signoff_input_exits_2_before_work(tiny_ckpt, small_calib, tmp_path, gates, report_extra, message):
    if report_extra:
        short = tmp_path / "short.txt"
        short.write_text("too short to hold a window")
        report_extra = {"eval": {**report_extra["eval"], "source": str(short)}}
    recipe = _tiny_recipe(tmp_path, tiny_ckpt, small_calib, VARIANTS[:2], gates, **report_extra)
    res = _optkit("run", str(recipe))
    assert res.returncode == 2, res.stderr[-3000:]
    assert message in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "report").exists()


@pytest.mark.real_model
def test_ci_recipe_signs_off_the_embedded_model(real_env, tmp_path):
    r = yaml.safe_load((REPO / "recipes" / "ci-signoff.yaml").read_text())
    r["report"]["eval"]["source"] = str(REPO / r["report"]["eval"]["source"])
    r["report"]["out"] = str(tmp_path / "report")
    r["export"] = {"out": str(tmp_path / "artifacts")}
    p = tmp_path / "ci.yaml"
    p.write_text(yaml.safe_dump(r))
    res = _optkit("run", str(p))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    report = _check_formats(tmp_path / "report")
    assert [v["status"] for v in report["variants"]] == ["ok", "ok", "ok"]
    assert report["verdict"]["passed"] and report["verdict"]["recommended"] != "bf16"


def test_eval_text_from_documents_and_stride(tmp_path, tokenizer):
    from optkit.errors import UserError
    from optkit.recipe import EvalTextConfig
    from optkit.signoff import eval_tokens

    p = tmp_path / "docs.jsonl"
    p.write_text(json.dumps({"body": "first document"}) + "\n" + json.dumps({"body": "second one"}) + "\n")
    ids = eval_tokens(EvalTextConfig(source=str(p), text_field="body", seq_len=16), tokenizer)
    assert ids.tolist() == tokenizer("first document\n\nsecond one", add_special_tokens=False)["input_ids"]
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(UserError, match="conversations"):
        eval_tokens(EvalTextConfig(source=str(chat), text_field="messages", seq_len=16), tokenizer)
    with pytest.raises(ValueError, match="stride"):
        EvalTextConfig(source="x.txt", seq_len=16, stride=32)
    from optkit.recipe import ReportConfig

    for bad in ("0.3", "lots"):  # a fraction of free memory means nothing in a committed report
        with pytest.raises(ValueError, match="memory_budget"):
            ReportConfig(eval={"source": "x.txt"}, memory_budget=bad)
