from __future__ import annotations

import json
import os

import jsonschema
import pytest
from pydantic import ValidationError

from optkit.errors import UserError
from optkit.report import render
from optkit.report.gates import evaluate_gates
from optkit.report.schema import REPORT_FILES, Report, load_report, report_json_schema, write_report


def test_json_round_trip_and_schema(report):
    r = evaluate_gates(report)
    data = json.loads(r.to_json())
    jsonschema.Draft202012Validator(report_json_schema()).validate(data)
    assert Report.model_validate(data) == r
    assert Report.model_validate_json(r.to_json()) == r


def test_schema_rejects_bad_reports(report_dict):
    validator = jsonschema.Draft202012Validator(report_json_schema())
    bad = json.loads(json.dumps(report_dict))
    bad["variants"][0]["memory"]["weight_bytes"]["valu"] = 1
    assert not validator.is_valid(bad)
    with pytest.raises(ValidationError, match="valu"):
        Report.model_validate(bad)
    for mutate, match in [
        (lambda d: d.update(baseline="fp32"), "baseline 'fp32' is not a variant"),
        (lambda d: d["variants"].append(dict(d["variants"][1])), "repeated: w8a16"),
        (lambda d: d["variants"][4].pop("error"), "no error message"),
        (lambda d: d["provenance"].update(engine={"name": "transformers-fallback"}), "needs a reason"),
        (lambda d: d["variants"][0]["quality"]["perplexity"].update(value=float("nan")), "finite"),
    ]:
        d = json.loads(json.dumps(report_dict))
        mutate(d)
        with pytest.raises(ValidationError, match=match):
            Report.model_validate(d)


def test_write_report_new_and_existing_dir(report, tmp_path):
    r = evaluate_gates(report)
    out = write_report(r, tmp_path / "reports" / "run1")
    assert sorted(os.listdir(out)) == sorted(REPORT_FILES)
    assert os.listdir(tmp_path / "reports") == ["run1"]  # no temp dir left beside it
    assert load_report(out / "report.json") == r
    (out / "keep.txt").write_text("mine")
    write_report(r.model_copy(update={"title": "second"}), out)
    assert sorted(os.listdir(out)) == sorted(REPORT_FILES + ("keep.txt",))
    assert load_report(out / "report.json").title == "second"
    assert os.listdir(tmp_path / "reports") == ["run1"]


def test_write_report_leaves_nothing_when_rendering_fails(report, tmp_path, monkeypatch):
    def boom(_):
        raise RuntimeError("render failed")

    monkeypatch.setattr(render, "render_html", boom)
    with pytest.raises(RuntimeError):
        write_report(evaluate_gates(report), tmp_path / "out")
    assert os.listdir(tmp_path) == []


def test_load_report_errors(tmp_path, report):
    with pytest.raises(UserError, match="not found"):
        load_report(tmp_path / "missing.json")
    p = tmp_path / "r.json"
    p.write_text("{")
    with pytest.raises(UserError, match="cannot be read"):
        load_report(p)
    p.write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(UserError, match="schema_version 99"):
        load_report(p)
    d = json.loads(report.to_json())
    del d["baseline"]
    p.write_text(json.dumps(d))
    with pytest.raises(UserError, match="not a valid optkit report"):
        load_report(p)


def test_accepts_pipeline_shorthand(report_dict):
    report_dict["provenance"]["engine"] = "optkit-runner"  # a bare name is {name: ...}
    report_dict["provenance"]["wall_s"] = 12.5
    report_dict["variants"][1]["description"] = None
    r = Report.model_validate(report_dict)
    assert r.provenance.engine.name == "optkit-runner"
    assert json.loads(r.to_json())["provenance"]["engine"] == {"name": "optkit-runner", "reason": None}
