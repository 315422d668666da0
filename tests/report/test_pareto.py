from __future__ import annotations

from optkit.report.gates import evaluate_gates
from optkit.report.pareto import frontier, pareto_front
from optkit.report.schema import Report


def test_hand_case_with_ties():
    pts = {"a": (1.0, 1.0), "b": (2.0, 0.5), "c": (2.0, 2.0), "d": (1.0, 1.0), "e": (3.0, 0.5), "f": (0.5, 3.0)}
    # c is dominated by a, e by b (same y, larger x); a and d tie and both stay
    assert pareto_front(pts) == ["f", "a", "d", "b"]
    assert pareto_front({}) == []


def test_report_frontiers_and_exclusions(report_dict):
    report_dict["variants"][1]["quality"]["kl_divergence"] = None  # w8a16: KL not measured
    r = evaluate_gates(Report.model_validate(report_dict))
    lat = frontier(r, "decode_latency")
    assert lat.y == "kl_divergence"
    # latency 1000/tok_s: bf16 50, w4a16-gptq 22.2, w4a16-rtn 21.7; KL 0, 0.05, 0.2
    assert lat.frontier == ["w4a16-rtn", "w4a16-gptq", "bf16"]
    assert lat.excluded == {"w8a16": "no kl_divergence", "w8a8": "variant failed"}
    size = frontier(r, "size")
    # w4a16-gptq and w4a16-rtn have the same size; gptq has the lower KL, so rtn is dominated
    assert size.frontier == ["w4a16-gptq", "bf16"]
    ppl = frontier(r, "size", "ppl_increase_pct")
    assert ppl.frontier == ["w4a16-gptq", "w8a16", "bf16"]
