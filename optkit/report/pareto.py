"""Pareto frontiers of quality loss against cost (decode latency, or weight bytes).

Both axes are minimised. A variant is on the frontier when no other variant is at least as
good on both axes and strictly better on one. Variants with identical points do not dominate
each other, so ties are all on the frontier. Failed variants and variants missing either
figure are left out, each with a note saying why (a chart that silently drops a variant
would misstate the trade-off).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from optkit.report.schema import Report, VariantReport, value_of

XAxis = Literal["decode_latency", "size"]
YAxis = Literal["auto", "kl_divergence", "ppl_increase_pct"]

X_LABELS = {"decode_latency": "decode latency, ms/token at batch 1", "size": "weight bytes, MB"}
Y_LABELS = {"kl_divergence": "KL divergence vs baseline, nats", "ppl_increase_pct": "perplexity increase vs baseline, %"}


@dataclass
class ParetoResult:
    x: XAxis
    y: str
    points: dict[str, tuple[float, float]]  # variant -> (x, y)
    frontier: list[str]  # names on the frontier, by increasing x (then y, then name)
    excluded: dict[str, str] = field(default_factory=dict)  # variant -> why it is not plotted

    @property
    def notes(self) -> list[str]:
        return [f"{name}: {why}" for name, why in self.excluded.items()]


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """Names of the non-dominated points (minimising both coordinates), sorted by (x, y, name)."""

    def dominated(p: tuple[float, float]) -> bool:
        return any(q[0] <= p[0] and q[1] <= p[1] and q != p for q in points.values())

    front = [n for n, p in points.items() if not dominated(p)]
    return sorted(front, key=lambda n: (points[n][0], points[n][1], n))


def _x(v: VariantReport, x: XAxis) -> tuple[float | None, str]:
    if x == "decode_latency":
        d = v.speed.decode_at(1)
        tok = None if d is None else value_of(d.tok_s)
        if not tok:
            return None, "no decode tok/s at batch 1"
        return 1000.0 / tok, ""
    wb = value_of(v.memory.weight_bytes)
    return (None, "no weight_bytes") if wb is None else (wb / 1e6, "")


def choose_quality_axis(report: Report) -> str:
    """KL divergence when at least two usable variants have it (it sees every token's whole
    distribution, so it separates close variants better), else the perplexity increase."""
    n_kl = sum(1 for v in report.variants if v.status == "ok" and value_of(v.quality.kl_divergence) is not None)
    return "kl_divergence" if n_kl >= 2 else "ppl_increase_pct"


def frontier(report: Report, x: XAxis = "decode_latency", y: YAxis = "auto") -> ParetoResult:
    """The frontier over (``x``, quality loss ``y``) for the report's variants.

    Use on a report that went through ``fill_derived``/``evaluate_gates`` so the baseline's
    KL (0) and every ppl increase are present.
    """
    if x not in X_LABELS:
        raise ValueError(f"x must be one of {list(X_LABELS)}, got {x!r}")
    yk = choose_quality_axis(report) if y == "auto" else y
    if yk not in Y_LABELS:
        raise ValueError(f"y must be one of auto, {', '.join(Y_LABELS)}; got {y!r}")
    points: dict[str, tuple[float, float]] = {}
    excluded: dict[str, str] = {}
    for v in report.variants:
        if v.status != "ok":
            excluded[v.name] = "variant failed"
            continue
        xv, why = _x(v, x)
        yv = value_of(getattr(v.quality, yk))
        if xv is None:
            excluded[v.name] = why
        elif yv is None:
            excluded[v.name] = f"no {yk}"
        else:
            points[v.name] = (float(xv), float(yv))
    return ParetoResult(x=x, y=yk, points=points, frontier=pareto_front(points), excluded=excluded)


__all__ = ["ParetoResult", "X_LABELS", "Y_LABELS", "choose_quality_axis", "frontier", "pareto_front"]
