from __future__ import annotations

import copy

from optkit.report.compare import compare, direction, render_compare_markdown
from optkit.report.schema import Report


def _scale_decode(d: dict, variant: int, factor: float) -> None:
    m = d["variants"][variant]["speed"]["decode"][0]["tok_s"]
    m["value"] *= factor
    m["spread"] = {k: (v * factor if k != "n" else v) for k, v in m["spread"].items()}


def test_flags_20pct_regression_ignores_2pct_within_noise(report_dict):
    new = copy.deepcopy(report_dict)
    _scale_decode(new, 2, 0.8)   # w4a16-gptq decode b1 -20 %
    _scale_decode(new, 1, 0.98)  # w8a16 decode b1 -2 %, its runs spread 5 %
    res = compare(Report.model_validate(report_dict), Report.model_validate(new), threshold_pct=1.0)
    rows = {(r.variant, r.metric): r for r in res.rows}
    gptq = rows[("w4a16-gptq", "decode_tok_s@b1")]
    assert gptq.verdict == "worse" and gptq.regression and abs(gptq.delta_pct + 20) < 1e-9
    w8 = rows[("w8a16", "decode_tok_s@b1")]
    assert abs(w8.noise_pct - 5.0) < 1e-9 and w8.verdict == "same (within noise)" and not w8.regression
    assert rows[("w4a16-gptq", "decode_speedup")].regression  # the ratio to the same run's baseline moved too
    assert rows[("w8a16", "kl_divergence")].verdict == "same (within noise)"
    assert {(r.variant, r.metric) for r in res.regressions} == {("w4a16-gptq", "decode_tok_s@b1"), ("w4a16-gptq", "decode_speedup")}
    assert res.exit_code == 1
    md = render_compare_markdown(res)
    assert md.startswith("## optkit report compare: REGRESSION") and "w4a16-gptq" in md and "-20.0 %" in md


def test_improvement_added_removed_and_failed(report_dict):
    new = copy.deepcopy(report_dict)
    new["variants"][2]["quality"]["kl_divergence"]["value"] = 0.04  # -20 %: better
    new["variants"][3] = {"name": "w4a16-rtn", "status": "failed", "error": "OOM"}
    new["variants"].pop(4)  # w8a8 removed
    new["variants"].append({"name": "mixed-4.5", "status": "failed", "error": "x"})
    res = compare(Report.model_validate(report_dict), Report.model_validate(new))
    rows = {(r.variant, r.metric): r for r in res.rows}
    assert rows[("w4a16-gptq", "kl_divergence")].verdict == "better"
    assert res.added == ["mixed-4.5"] and res.removed == ["w8a8"]
    assert res.status_changes == ["w4a16-rtn: ok -> failed (OOM)"] and res.exit_code == 1
    assert not res.regressions


def test_same_report_no_regression(report):
    res = compare(report, report)
    assert res.exit_code == 0 and all(r.verdict in ("same (within noise)", "not comparable") for r in res.rows)
    assert render_compare_markdown(res).startswith("## optkit report compare: no regression")


def test_directions():
    assert direction("decode_tok_s@b1") == "higher" and direction("top1_agreement") == "higher"
    assert direction("task:arc") == "higher" and direction("decode_speedup") == "higher"
    for m in ("perplexity", "kl_divergence", "ttft_ms@512", "itl_ms_p99@b1", "weight_bytes", "task_accuracy_drop"):
        assert direction(m) == "lower"
