from __future__ import annotations

import pytest

from optkit.errors import UserError
from optkit.report.gates import GateError, evaluate_gates, exit_code, exit_message, parse_gate, validate_gates
from optkit.report.schema import Report


def _results(report: Report, gates: list[str]) -> dict[str, dict[str, bool]]:
    r = evaluate_gates(report.model_copy(update={"gates": gates}))
    return {v.name: {g.gate: g.passed for g in v.gates} for v in r.variants}


@pytest.mark.parametrize(("gate", "variant", "passed"), [
    ("kl_divergence <= 0.05", "w4a16-gptq", True),     # == limit passes for <=
    ("kl_divergence < 0.05", "w4a16-gptq", False),     # strict: equality fails
    ("kl_divergence <= 0.0499", "w4a16-gptq", False),  # just over the limit
    ("top1_agreement >= 0.9", "w4a16-gptq", True),     # == limit passes for >=
    ("top1_agreement > 0.9", "w4a16-gptq", False),
    ("top1_agreement >= 0.9000001", "w4a16-gptq", False),
    ("decode_speedup >= 1.5", "w8a16", True),          # 30 / 20 computed, exactly 1.5
    ("decode_speedup > 1.5", "w8a16", False),
    ("size_ratio <= 0.35", "w4a16-gptq", True),        # 70e6 / 200e6, exactly 0.35
    ("size_ratio < 0.35", "w4a16-gptq", False),
])
def test_gate_boundaries(report, gate, variant, passed):
    assert _results(report, [gate])[variant][gate] is passed


def test_floats_compare_exactly(report):
    # documented: no tolerance. w8a16's task drop is 100 x (0.5 - 0.495) = 0.5000000000000004 in
    # binary, so a limit of 0.5 fails and the message shows the exact value.
    r = evaluate_gates(report.model_copy(update={"gates": ["task_accuracy_drop <= 0.5"]}))
    g = r.variant("w8a16").gates[0]
    assert not g.passed and g.value == 100 * (0.5 - 0.495) and g.reason.endswith("> 0.5")


def test_dict_form_and_canonical_text(report):
    g = parse_gate({"metric": "kl_divergence", "op": "<=", "limit": 0.05})
    assert g.text == "kl_divergence <= 0.05" and parse_gate("  kl_divergence<=5e-2 ").text == g.text
    assert parse_gate({"metric": "decode_speedup", "op": ">=", "limit": 2}).text == "decode_speedup >= 2"
    r = evaluate_gates(report.model_copy(update={"gates": [g.text]}))
    assert r.variant("w4a16-gptq").gates[0].passed
    for bad in ({"metric": "kl_divergence", "op": "=<", "limit": 1}, {"metric": "kl_divergence", "op": "<=", "limit": True},
                {"metric": "kl_divergence", "op": "<=", "limit": 1, "extra": 1}, {"metric": "kl_divergence", "op": "<="},
                "kl_divergence <= abc", "kl_divergence == 1", 3):
        with pytest.raises(GateError):
            parse_gate(bad)


def test_unknown_metric_names_known_ones():
    with pytest.raises(UserError) as err:
        validate_gates(["ppl_increase_pct <= 2", "kl_div <= 0.05"])
    msg = str(err.value)
    assert "'kl_div'" in msg and "known metrics" in msg
    for known in ("kl_divergence", "ppl_increase_pct", "top1_agreement", "decode_speedup", "size_ratio", "task_accuracy_drop"):
        assert known in msg
    assert "did you mean 'kl_divergence'" in msg
    assert isinstance(err.value, ValueError)  # a pydantic validator turns it into a field error
    with pytest.raises(UserError, match="known metrics"):
        validate_gates([{"metric": "speed", "op": ">=", "limit": 1}])


def test_unmeasured_metric_fails_and_is_named(report):
    r = evaluate_gates(report.model_copy(update={"gates": ["task_accuracy_drop <= 1", "prefill_speedup >= 0.5"]}))
    g = r.variant("w4a16-gptq").gates[0]  # w4a16-gptq has no task scores
    assert not g.passed and g.value is None and g.reason.startswith("not measured")
    assert r.variant("w8a16").gates[0].passed  # 0.5 points
    assert not r.variant("w4a16-gptq").passed
    failed = r.variant("w8a8")
    assert not failed.passed and all("variant failed" in g.reason for g in failed.gates)


def test_verdict_picks_fastest_passing(report):
    r = evaluate_gates(report)
    passed = {v.name: v.passed for v in r.variants}
    # baseline fails decode_speedup; w4a16-rtn is fastest but fails KL; w8a16 and w4a16-gptq pass
    assert passed == {"bf16": False, "w8a16": True, "w4a16-gptq": True, "w4a16-rtn": False, "w8a8": False}
    assert r.verdict.recommended == "w4a16-gptq" and r.verdict.passed
    assert exit_code(r) == 0 and exit_message(r).startswith("PASS: recommended w4a16-gptq")


def test_verdict_tie_goes_to_smaller_weights(report_dict):
    report_dict["variants"][1]["speed"]["decode"][0]["tok_s"]["value"] = 45.0  # w8a16 as fast as w4a16-gptq
    r = evaluate_gates(Report.model_validate(report_dict))
    assert r.verdict.recommended == "w4a16-gptq"


def test_baseline_only_when_nothing_else_passes(report):
    r = evaluate_gates(report.model_copy(update={"gates": ["kl_divergence <= 0"]}))
    assert r.verdict.recommended == "bf16" and r.verdict.passed and "unquantized" in r.verdict.reason


def test_exit_code_names_failing_gate_and_value(report):
    r = evaluate_gates(report.model_copy(update={"gates": ["kl_divergence <= 0.001", "decode_speedup >= 1.2"]}))
    assert r.verdict.recommended is None and not r.verdict.passed
    assert exit_code(r) == 1
    msg = exit_message(r)
    # every candidate fails only KL; the closest is the fastest of them
    assert msg.startswith("FAIL") and "w4a16-rtn" in msg and "kl_divergence <= 0.001 (value 0.2)" in msg
    assert "\n" not in msg


def test_evaluate_does_not_mutate_input(report):
    before = report.model_dump()
    evaluate_gates(report)
    assert report.model_dump() == before
