"""Budgeted mixed precision: pick each layer's precision from its measured sensitivity.

Each layer ``l`` has options ``(bits_l,k, kl_l,k)``: bits per weight (scales and zero points
included) and the KL divergence measured with that layer alone quantized (0 for 16-bit).
The plan minimizes the predicted KL ``sum_l kl_l`` subject to the average bits per weight
(weighted by the layers' weight counts) staying within the budget: a multiple-choice
knapsack. It is solved greedily on each layer's lower convex hull of (bits, kl): start every
layer at its cheapest option, then repeatedly take the upgrade with the largest KL reduction
per extra bit that still fits. With a ``max_kl`` target the upgrades stop as soon as the
prediction meets it, which gives the smallest plan that does.
"""

from __future__ import annotations

from dataclasses import dataclass

from optkit.errors import QuantizationError


@dataclass(frozen=True)
class Option:
    label: str
    bits: float  # per weight, scales and zero points included
    kl: float


@dataclass(frozen=True)
class MixedPlan:
    """``choice``: layer -> option label; ``bits_per_weight``: the weight-count-weighted average;
    ``predicted_kl``: sum of the chosen options' measured KL."""

    choice: dict[str, str]
    bits_per_weight: float
    predicted_kl: float

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for label in self.choice.values():
            counts[label] = counts.get(label, 0) + 1
        mix = ", ".join(f"{n} x {lbl}" for lbl, n in sorted(counts.items()))
        return f"{self.bits_per_weight:.3f} bits/weight, predicted KL {self.predicted_kl:.5f} ({mix})"


def _hull(options: list[Option]) -> list[Option]:
    """Options sorted by bits with strictly falling KL, on the lower convex hull."""
    pts = sorted(options, key=lambda o: (o.bits, o.kl))
    mono: list[Option] = []
    for o in pts:
        if mono and o.bits == mono[-1].bits:
            continue
        if not mono or o.kl < mono[-1].kl:
            mono.append(o)
    hull: list[Option] = []
    for o in mono:  # drop points above the segment joining their neighbours
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (b.kl - a.kl) * (o.bits - a.bits) >= (o.kl - a.kl) * (b.bits - a.bits):
                hull.pop()
            else:
                break
        hull.append(o)
    return hull


def _stats(choice: dict[str, Option], params: dict[str, int]) -> tuple[float, float]:
    total = sum(params[n] for n in choice)
    bits = sum(params[n] * o.bits for n, o in choice.items()) / total
    return bits, sum(o.kl for o in choice.values())


def choose_precisions(
    options: dict[str, list[Option]],
    params: dict[str, int],
    bits_per_weight: float | None = None,
    max_kl: float | None = None,
) -> MixedPlan:
    """The plan for the budget; a budget no plan meets raises an error naming the closest plan."""
    if bits_per_weight is None and max_kl is None:
        raise ValueError("give bits_per_weight, max_kl or both")
    hulls = {n: _hull(opts) for n, opts in options.items()}
    level = {n: 0 for n in hulls}
    choice = {n: h[0] for n, h in hulls.items()}
    total = sum(params[n] for n in hulls)
    budget_bits = None if bits_per_weight is None else bits_per_weight * total

    def plan() -> MixedPlan:
        b, k = _stats(choice, params)
        return MixedPlan({n: o.label for n, o in sorted(choice.items())}, b, k)

    used = sum(params[n] * o.bits for n, o in choice.items())
    if budget_bits is not None and used > budget_bits + 1e-9 * total:
        closest = plan()
        raise QuantizationError(
            f"no plan fits {bits_per_weight} bits/weight: the smallest plan needs {closest.bits_per_weight:.3f} "
            f"(closest plan: {closest.describe()})",
            hint="raise mixed_precision.bits_per_weight, or add a smaller candidate precision",
        )

    def met() -> bool:
        return max_kl is not None and sum(o.kl for o in choice.values()) <= max_kl

    while not met():
        best = None
        for n, h in hulls.items():
            i = level[n]
            if i + 1 >= len(h):
                continue
            cur, nxt = h[i], h[i + 1]
            extra = params[n] * (nxt.bits - cur.bits)
            if budget_bits is not None and used + extra > budget_bits + 1e-9 * total:
                continue
            gain = (cur.kl - nxt.kl) / extra
            if best is None or gain > best[0]:
                best = (gain, n, extra)
        if best is None:
            break
        _, n, extra = best
        level[n] += 1
        choice[n] = hulls[n][level[n]]
        used += extra
    result = plan()
    if max_kl is not None and result.predicted_kl > max_kl:
        limit = f"within {bits_per_weight} bits/weight" if bits_per_weight is not None else "with these candidates"
        raise QuantizationError(
            f"no plan reaches predicted KL <= {max_kl:g} {limit} (closest plan: {result.describe()})",
            hint="raise mixed_precision.max_kl or bits_per_weight, or allow 16bit among the candidates",
        )
    return result
