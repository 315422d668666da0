"""Gates: declared limits on report metrics, their evaluation, the verdict and the exit code.

A gate is ``METRIC OP LIMIT`` (``"kl_divergence <= 0.05"``) or the same as a dict
(``{metric: kl_divergence, op: "<=", limit: 0.05}``). ``OP`` is one of ``<=  <  >=  >``.

Comparison rules (exact, so a gate's outcome never depends on a tolerance nobody declared):
- ``<=`` and ``>=`` pass at equality; ``<`` and ``>`` do not;
- values are compared as stored floats, exactly: ``0.05 <= 0.05`` passes, ``0.0500001 <= 0.05``
  fails. Round in the gate's limit, not in the comparison.
- a metric that was not measured for a variant fails that gate with reason "not measured";
  a failed variant fails every gate with its error as the reason. Nothing passes silently.

Verdict rule: among variants that pass every gate, the baseline excepted, recommend the
fastest (highest decode tok/s at batch 1; a variant without that figure ranks last); ties go
to the smaller weight_bytes, then to the name (so the choice is deterministic). When no
quantized variant passes but the baseline does, the baseline is recommended and the verdict
passes ("ship the unquantized model"); add a gate the baseline cannot meet, such as
``size_ratio <= 0.9``, to make that a failure. When nothing passes, the verdict fails.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from optkit.errors import RecipeError
from optkit.report.derive import fill_derived, size_ratio
from optkit.report.schema import GateResult, Report, VariantReport, Verdict, value_of

OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": lambda v, lim: v <= lim,
    "<": lambda v, lim: v < lim,
    ">=": lambda v, lim: v >= lim,
    ">": lambda v, lim: v > lim,
}


def _decode_b1(v: VariantReport) -> float | None:
    d = v.speed.decode_at(1)
    return None if d is None else value_of(d.tok_s)


Getter = Callable[[VariantReport, VariantReport], "float | None"]

# metric name -> (what it is, how to read it from a variant given the baseline)
METRICS: dict[str, tuple[str, Getter]] = {
    "perplexity": ("perplexity on the evaluation tokens", lambda v, b: value_of(v.quality.perplexity)),
    "nll": ("mean negative log-likelihood, nats", lambda v, b: value_of(v.quality.nll)),
    "kl_divergence": ("KL(baseline || variant), nats", lambda v, b: value_of(v.quality.kl_divergence)),
    "top1_agreement": ("fraction of argmax matches with the baseline", lambda v, b: value_of(v.quality.top1_agreement)),
    "ppl_increase_pct": ("perplexity increase over the baseline, %", lambda v, b: value_of(v.quality.ppl_increase_pct)),
    "task_accuracy_drop": ("largest task accuracy drop vs baseline, points", lambda v, b: value_of(v.quality.task_accuracy_drop)),
    "decode_speedup": ("decode tok/s at batch 1 / baseline's", lambda v, b: value_of(v.speed.decode_speedup)),
    "prefill_speedup": ("baseline TTFT / variant TTFT", lambda v, b: value_of(v.speed.prefill_speedup)),
    "decode_tok_s": ("decode tok/s at batch 1", lambda v, b: _decode_b1(v)),
    "size_ratio": ("weight_bytes / baseline weight_bytes", size_ratio),
    "weight_bytes": ("bytes of weight files", lambda v, b: value_of(v.memory.weight_bytes)),
    "artifact_bytes": ("bytes of all artifact files", lambda v, b: value_of(v.memory.artifact_bytes)),
    "bits_per_weight": ("stored bits per quantized weight", lambda v, b: value_of(v.memory.bits_per_weight)),
    "peak_rss_bytes": ("peak resident memory", lambda v, b: value_of(v.memory.peak_rss_bytes)),
    "peak_cuda_bytes": ("peak CUDA memory", lambda v, b: value_of(v.memory.peak_cuda_bytes)),
    "kv_bytes_per_token": ("KV-cache bytes per token", lambda v, b: value_of(v.memory.kv_bytes_per_token)),
    "max_context_tokens": ("tokens of KV within the stated budget", lambda v, b: value_of(v.memory.max_context_tokens)),
}

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_GATE_RE = re.compile(rf"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(<=|>=|<|>)\s*({_NUMBER})\s*$")
_HINT = "write a gate as 'METRIC OP NUMBER' (OP: <=, <, >=, >), e.g. 'kl_divergence <= 0.05'"


class GateError(RecipeError, ValueError):
    """An invalid gate. Also a ValueError so a pydantic validator that calls
    :func:`validate_gates` reports it as a validation error of the ``gates`` field."""


def _num(x: float) -> str:
    """Shortest text that reads back as the same float; integers without '.0'."""
    return str(int(x)) if x.is_integer() and abs(x) < 1e15 else repr(x)


@dataclass(frozen=True)
class Gate:
    metric: str
    op: str
    limit: float

    @property
    def text(self) -> str:
        return f"{self.metric} {self.op} {_num(self.limit)}"

    def __str__(self) -> str:
        return self.text

    def check(self, value: float) -> bool:
        return OPS[self.op](value, self.limit)


def _known() -> str:
    return ", ".join(METRICS)


def _check_metric(name: str, where: str) -> None:
    if name not in METRICS:
        close = difflib.get_close_matches(name, METRICS, n=1)
        hint = f"did you mean {close[0]!r}?" if close else _HINT
        raise GateError(f"{where}: unknown metric {name!r}; known metrics: {_known()}", hint=hint)


def parse_gate(item: str | dict) -> Gate:
    """One gate from its text or dict form; a GateError names the bad part."""
    if isinstance(item, str):
        m = _GATE_RE.match(item)
        if not m:
            name = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)", item)
            if name and name.group(1) not in METRICS:
                _check_metric(name.group(1), f"gate {item!r}")
            raise GateError(f"gate {item!r} is not 'METRIC OP NUMBER'", hint=_HINT)
        metric, op, limit = m.group(1), m.group(2), float(m.group(3))
        _check_metric(metric, f"gate {item!r}")
    elif isinstance(item, dict):
        keys = set(item)
        if keys != {"metric", "op", "limit"}:
            raise GateError(f"gate {item!r} must have exactly the keys metric, op, limit "
                            f"(missing: {sorted({'metric', 'op', 'limit'} - keys)}, unknown: {sorted(keys - {'metric', 'op', 'limit'})})",
                            hint="e.g. {metric: kl_divergence, op: '<=', limit: 0.05}")
        metric, op, limit = item["metric"], item["op"], item["limit"]
        if not isinstance(metric, str):
            raise GateError(f"gate {item!r}: metric must be a string; known metrics: {_known()}")
        _check_metric(metric, f"gate {item!r}")
        if op not in OPS:
            raise GateError(f"gate {item!r}: op {op!r} is not one of {', '.join(OPS)}")
        if isinstance(limit, bool) or not isinstance(limit, (int, float)):
            raise GateError(f"gate {item!r}: limit {limit!r} must be a number")
        limit = float(limit)
    else:
        raise GateError(f"gate {item!r} must be a string or a mapping", hint=_HINT)
    if not math.isfinite(limit):
        raise GateError(f"gate {item!r}: limit must be a finite number")
    return Gate(metric, op, limit)


def validate_gates(items: Iterable[str | dict]) -> list[Gate]:
    """Parse every gate (recipe validation time); the first bad one raises GateError."""
    return [parse_gate(i) for i in items]


def _result(gate: Gate, v: VariantReport, base: VariantReport) -> GateResult:
    common = {"gate": gate.text, "metric": gate.metric, "op": gate.op, "limit": gate.limit}
    if v.status != "ok":
        return GateResult(**common, value=None, passed=False, reason=f"variant failed: {v.error}")
    value = METRICS[gate.metric][1](v, base)
    if value is None:
        return GateResult(**common, value=None, passed=False, reason=f"not measured: no {gate.metric} for {v.name}")
    ok = gate.check(value)
    rel = gate.op if ok else {"<=": ">", "<": ">=", ">=": "<", ">": "<="}[gate.op]
    return GateResult(**common, value=float(value), passed=ok,
                      reason=f"{gate.metric} = {_num(float(value))} {rel} {_num(gate.limit)}")


def _speed_key(v: VariantReport) -> tuple:
    """Sort key, best first: highest decode b1, then fewest weight bytes, then name."""
    tok = _decode_b1(v)
    wb = value_of(v.memory.weight_bytes)
    return (tok is None, -(tok or 0.0), math.inf if wb is None else wb, v.name)


def _verdict(r: Report) -> Verdict:
    passing = [v for v in r.variants if v.passed]
    candidates = sorted((v for v in passing if v.name != r.baseline), key=_speed_key)
    if candidates:
        best = candidates[0]
        speed = value_of(best.speed.decode_speedup)
        why = f"fastest of {len(candidates)} variant(s) passing all {len(r.gates)} gate(s)"
        if speed is not None:
            why += f"; decode {speed:.2f}x the baseline at batch 1"
        return Verdict(recommended=best.name, passed=True, reason=why)
    if any(v.name == r.baseline for v in passing):
        return Verdict(recommended=r.baseline, passed=True,
                       reason="no quantized variant passes every gate; the baseline does (ship it unquantized)")
    close = closest_candidate(r)
    reason = "no variant passes every gate"
    if close is not None:
        reason += f"; closest: {close.name} fails " + "; ".join(_fail_text(g) for g in close.gates if not g.passed)
    return Verdict(recommended=None, passed=False, reason=reason)


def _fail_text(g: GateResult) -> str:
    return f"{g.gate} (value {_num(g.value)})" if g.value is not None else f"{g.gate} ({g.reason})"


def closest_candidate(r: Report) -> VariantReport | None:
    """The non-baseline variant with the fewest failed gates (ties: the faster); the baseline
    when it is the only variant."""
    others = [v for v in r.variants if v.name != r.baseline] or r.variants
    return min(others, key=lambda v: (sum(not g.passed for g in v.gates), *_speed_key(v))) if others else None


def evaluate_gates(report: Report) -> Report:
    """A copy of ``report`` with derived figures filled, every variant's GateResults and
    ``passed``, and the verdict. Gates are re-parsed from ``report.gates`` (a GateError if one
    is invalid) and stored back in canonical text."""
    r = fill_derived(report)
    gates = validate_gates(r.gates)
    r.gates = [g.text for g in gates]
    base = r.baseline_variant
    for v in r.variants:
        v.gates = [_result(g, v, base) for g in gates]
        v.passed = v.status == "ok" and all(g.passed for g in v.gates)
    r.verdict = _verdict(r)
    return r


def exit_code(report: Report) -> int:
    """0 when the verdict passes, 1 when gates failed (evaluates the gates if not done yet)."""
    r = report if report.verdict is not None else evaluate_gates(report)
    return 0 if r.verdict.passed else 1


def exit_message(report: Report) -> str:
    """One line for the terminal/CI log: the recommendation, or the failing gate and value of
    the closest candidate."""
    r = report if report.verdict is not None else evaluate_gates(report)
    if r.verdict.passed:
        return f"PASS: recommended {r.verdict.recommended} ({r.verdict.reason})"
    return f"FAIL: {r.verdict.reason}"


__all__ = [
    "METRICS", "OPS", "Gate", "GateError", "closest_candidate", "evaluate_gates", "exit_code", "exit_message",
    "parse_gate", "validate_gates",
]
