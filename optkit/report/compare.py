"""``optkit report compare OLD NEW``: what changed between two runs, judged against their noise.

Each variant present in both runs is compared metric by metric. A row's noise is the larger
relative spread of its two measurements (``Metric.spread``; where a Metric carries none, the
run's ``noise`` entry for that metric). A change counts only beyond ``max(threshold, noise)``:
within it the row is "same (within noise)", beyond it "better" or "worse" by the metric's
direction. A "worse" row is a regression, and so is a variant that was ok and now failed.
Quality and size figures have no spread (same tokens, same bytes), so only the threshold
applies to them.

Speed is compared both raw (tok/s, ms) and as ratios to the baseline of the same run: when two
runs were on a machine of different speed, the raw rows move together and the ratio rows do
not, which tells a slower machine from a slower variant.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from optkit.report.derive import fill_derived, speed_metrics
from optkit.report.schema import Metric, Report, VariantReport

Direction = Literal["higher", "lower"]
RowVerdict = Literal["better", "worse", "same (within noise)", "not comparable"]

_HIGHER = ("decode_tok_s", "prefill_tok_s", "decode_speedup", "prefill_speedup", "top1_agreement", "task:",
           "max_context_tokens")


def direction(metric: str) -> Direction:
    """Whether a bigger value is better: throughput, speedups, agreement and accuracy are;
    perplexity, KL, latency and bytes are not."""
    return "higher" if metric.startswith(_HIGHER) else "lower"


class CompareRow(BaseModel):
    model_config = ConfigDict(extra="forbid")

    variant: str
    metric: str
    unit: str
    direction: Direction
    old: float | None
    new: float | None
    delta_pct: float | None  # 100 (new - old) / |old|; None when not comparable or old == 0 != new
    noise_pct: float
    verdict: RowVerdict
    regression: bool


class CompareResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    threshold_pct: float
    rows: list[CompareRow]
    added: list[str]  # variants only in the new run
    removed: list[str]  # variants only in the old run
    status_changes: list[str]  # "name: ok -> failed (error)"
    notes: list[str]

    @property
    def regressions(self) -> list[CompareRow]:
        return [r for r in self.rows if r.regression]

    @property
    def failed_variants(self) -> list[str]:
        return [s for s in self.status_changes if "-> failed" in s]

    @property
    def exit_code(self) -> int:
        """1 when anything regressed (a worse row, or a variant that now fails), else 0."""
        return 1 if self.regressions or self.failed_variants else 0


def _metrics(v: VariantReport) -> dict[str, Metric]:
    q, m = v.quality, v.memory
    out: dict[str, Metric | None] = {
        "perplexity": q.perplexity, "kl_divergence": q.kl_divergence, "top1_agreement": q.top1_agreement,
        "ppl_increase_pct": q.ppl_increase_pct, "task_accuracy_drop": q.task_accuracy_drop,
    }
    out.update({f"task:{t}": s.accuracy for t, s in sorted(q.tasks.items())})
    out.update(speed_metrics(v))
    for k in ("weight_bytes", "artifact_bytes", "kv_bytes_per_token", "peak_rss_bytes", "peak_cuda_bytes",
              "max_context_tokens"):
        out[k] = getattr(m, k)
    return {k: v for k, v in out.items() if v is not None}


def _row(variant: str, metric: str, old: Metric | None, new: Metric | None, old_noise: dict, new_noise: dict,
         threshold: float) -> CompareRow:
    o = None if old is None else old.value
    n = None if new is None else new.value
    unit = (new or old).unit
    d = direction(metric)
    noises = [x for x in (old and old.noise_pct, new and new.noise_pct) if x is not None]
    if old is not None and old.noise_pct is None and metric in old_noise:
        noises.append(old_noise[metric])
    if new is not None and new.noise_pct is None and metric in new_noise:
        noises.append(new_noise[metric])
    noise = max(noises, default=0.0)
    common = {"variant": variant, "metric": metric, "unit": unit, "direction": d, "old": o, "new": n, "noise_pct": noise}
    if o is None or n is None:
        return CompareRow(**common, delta_pct=None, verdict="not comparable", regression=False)
    if o == n:
        return CompareRow(**common, delta_pct=0.0, verdict="same (within noise)", regression=False)
    delta = None if o == 0 else 100.0 * (n - o) / abs(o)
    if delta is not None and abs(delta) <= max(threshold, noise):
        return CompareRow(**common, delta_pct=delta, verdict="same (within noise)", regression=False)
    better = (n > o) == (d == "higher")
    return CompareRow(**common, delta_pct=delta, verdict="better" if better else "worse", regression=not better)


def compare(old: Report, new: Report, threshold_pct: float = 5.0) -> CompareResult:
    """Rows per common variant x metric, variants added/removed, status changes, and notes on
    differences in the runs' conditions (hardware, engine, baseline, gates)."""
    if threshold_pct < 0:
        raise ValueError("threshold_pct must be >= 0")
    old, new = fill_derived(old), fill_derived(new)
    old_by, new_by = {v.name: v for v in old.variants}, {v.name: v for v in new.variants}
    notes = []
    if old.provenance.hardware != new.provenance.hardware:
        notes.append("the runs were on different hardware: compare the speedup rows, not raw tok/s and ms")
    if old.provenance.engine != new.provenance.engine:
        notes.append(f"engine changed: {old.provenance.engine.name} -> {new.provenance.engine.name}")
    if old.baseline != new.baseline:
        notes.append(f"baseline changed: {old.baseline} -> {new.baseline}")
    if old.gates != new.gates:
        notes.append("the declared gates differ between the runs")
    if old.verdict and new.verdict and old.verdict.recommended != new.verdict.recommended:
        notes.append(f"recommended variant changed: {old.verdict.recommended} -> {new.verdict.recommended}")
    rows, status = [], []
    for name in [n for n in old_by if n in new_by]:
        ov, nv = old_by[name], new_by[name]
        if ov.status != nv.status:
            status.append(f"{name}: {ov.status} -> {nv.status}" + (f" ({nv.error})" if nv.error else ""))
        if ov.status != "ok" or nv.status != "ok":
            continue
        om, nm = _metrics(ov), _metrics(nv)
        for metric in list(om) + [k for k in nm if k not in om]:
            rows.append(_row(name, metric, om.get(metric), nm.get(metric), old.noise, new.noise, threshold_pct))
    return CompareResult(
        threshold_pct=threshold_pct, rows=rows,
        added=[n for n in new_by if n not in old_by], removed=[n for n in old_by if n not in new_by],
        status_changes=status, notes=notes,
    )


def _f(x: float | None) -> str:
    from optkit.report.tables import fmt_num

    return fmt_num(x)


def _delta(r: CompareRow) -> str:
    if r.delta_pct is None:
        return "n/a"
    return f"{r.delta_pct:+.1f} %"


def render_compare_markdown(result: CompareResult) -> str:
    """GitHub-flavoured summary: a verdict line, the regressions, then every row in <details>."""
    from optkit.report.tables import md_table

    regs = result.regressions
    failed = result.failed_variants
    head = ("## optkit report compare: " + ("REGRESSION" if result.exit_code else "no regression")
            + f" (threshold {result.threshold_pct:g} %, or the measured noise where larger)")
    lines = [head, ""]
    if regs:
        lines.append(f"{len(regs)} metric(s) worse beyond noise:")
    for s in failed:
        lines.append(f"- variant now fails: {s}")
    for s in result.status_changes:
        if s not in failed:
            lines.append(f"- status change: {s}")
    if result.added:
        lines.append(f"- added variants: {', '.join(result.added)}")
    if result.removed:
        lines.append(f"- removed variants: {', '.join(result.removed)}")
    for n in result.notes:
        lines.append(f"- note: {n}")
    headers = ["variant", "metric", "old", "new", "delta", "noise", "verdict"]

    def cells(r: CompareRow) -> list[str]:
        return [r.variant, r.metric + (f" ({r.unit})" if r.unit else ""), _f(r.old), _f(r.new), _delta(r),
                f"{r.noise_pct:.1f} %", r.verdict]

    if regs:
        lines += ["", md_table(headers, [cells(r) for r in regs])]
    lines += ["", f"<details><summary>all {len(result.rows)} comparisons</summary>", "",
              md_table(headers, [cells(r) for r in result.rows]), "", "</details>", ""]
    return "\n".join(lines)


__all__ = ["CompareResult", "CompareRow", "compare", "direction", "render_compare_markdown"]
