from __future__ import annotations

import re

from optkit.report import plots
from optkit.report.gates import evaluate_gates
from optkit.report.render import render_html, render_markdown
from optkit.report.schema import Report

PNG = b"\x89PNG\r\n\x1a\n"


def test_markdown_verdict_first_and_every_variant(report):
    r = evaluate_gates(report)
    md = render_markdown(r)
    first = md.splitlines()[0]
    assert first.startswith("## ") and "PASS: recommended `w4a16-gptq`" in first
    for v in r.variants:
        assert f"| {v.name}" in md
    for g in r.gates:
        assert g in md
    assert "FAIL 0.2" in md and "PASS 0.05" in md  # w4a16-rtn's KL, w4a16-gptq's KL at the limit
    assert "<details><summary>Provenance</summary>" in md and "report.html" in md
    assert "data:image" not in md and "![" not in md
    assert "failed: no int8 activation kernel" in md


def test_markdown_names_unmeasured_gates(report):
    md = render_markdown(evaluate_gates(report.model_copy(update={"gates": ["task_accuracy_drop <= 1"]})))
    assert "FAIL not measured" in md and "not measured, so the gate fails: w4a16-gptq" in md
    assert md.splitlines()[0].endswith("PASS: recommended `w8a16`")


def test_html_self_contained_with_plots(report):
    r = evaluate_gates(report)
    page = render_html(r)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "<script" not in page and "@import" not in page and "url(" not in page
    assert page.count("data:image/png;base64,") >= 3  # roofline + two Pareto plots
    for v in r.variants:
        assert v.name in page
    assert "Paris (w4a16-gptq)" in page and "Paris (bf16)" in page  # samples side by side
    assert "decode b1" in page and "prefill 512" in page


def test_html_escapes_and_optional_tables(report_dict):
    report_dict["variants"][2]["quality"]["per_layer_sqnr_db"] = {"model.layers.0.mlp.down_proj": 31.5}
    report_dict["variants"][2]["quality"]["sensitivity"] = {  # SensitivityTable.to_json()
        "tokens": 512, "layers": {"model.layers.0.mlp.down_proj": {"params": 1024, "kl": {"int4": 0.0123, "int8": 0.001},
                                                                   "measured": ["int4"]}}}
    report_dict["variants"][1]["quality"]["sensitivity"] = [{"layer": "model.layers.1.mlp.up_proj", "kl_4bit": 0.02}]
    report_dict["variants"][2]["quality"]["mixed_plan"] = {"model.layers.0.mlp.down_proj": "int8"}
    report_dict["variants"][1]["description"] = "x"
    report_dict["notes"] = ["<b>synthetic</b> weights"]
    page = render_html(evaluate_gates(Report.model_validate(report_dict)))
    assert "Per-layer weight SQNR" in page and "31.50" in page and "Sensitivity: w4a16-gptq" in page
    assert "KL int4" in page and "0.0123" in page and "Sensitivity: w8a16" in page and "model.layers.1.mlp.up_proj" in page
    assert "Mixed-precision plan" in page
    assert "<b>synthetic</b>" not in page and "&lt;b&gt;synthetic&lt;/b&gt;" in page


def test_plots_deterministic_and_show_decode(report):
    r = evaluate_gates(report)
    a, b = plots.roofline_png(r), plots.roofline_png(r)
    assert a.startswith(PNG) and a == b
    no_decode = r.model_copy(deep=True)
    for v in no_decode.variants:
        v.roofline.points = [p for p in v.roofline.points if p.phase != "decode"]
    assert plots.roofline_png(no_decode) != a  # the decode points are drawn
    for x in ("decode_latency", "size"):
        p = plots.pareto_png(r, x)
        assert p.startswith(PNG) and p == plots.pareto_png(r, x)
    assert b"Software" not in a


def test_render_without_gates_or_machine_peaks(report_dict):
    report_dict["gates"] = []
    report_dict["machine"] = {"peak_read_bandwidth": {"value": None, "unit": "GB/s", "method": "not measured"}}
    for v in report_dict["variants"]:
        v.pop("roofline", None)
    r = Report.model_validate(report_dict)
    assert "gates not evaluated" in render_markdown(r)
    r = evaluate_gates(r)
    assert r.verdict.recommended == "w4a16-rtn"  # no gates: the fastest quantized variant
    assert render_html(r).count("data:image/png;base64,") == 3
