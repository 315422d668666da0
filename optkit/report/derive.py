"""Figures computed from other figures: ratios against the baseline, run noise, roofline points.

The measurement loop fills raw measurements (perplexity, tok/s, bytes); :func:`fill_derived`
adds what follows from them and the baseline of the same run, so that the ratios are always
computed one way. A derived figure the loop already filled with a value is kept as is; one
that is absent or has ``value: null`` is (re)computed when its inputs are there.

Ratios of two medians get a conservative spread: ``[v.min / b.max, v.max / b.min]`` (the
widest the ratio could be given both ranges), so ``compare`` never treats a ratio as less
noisy than the measurements behind it.
"""

from __future__ import annotations

from optkit.report.schema import Metric, Report, RooflinePoint, Spread, VariantReport, value_of


def _ratio(num: Metric | None, den: Metric | None, method: str) -> Metric | None:
    """num / den with a conservative spread; None when either is missing or den is 0."""
    n, d = value_of(num), value_of(den)
    if n is None or d is None or d == 0:
        return None
    spread = None
    if num.spread is not None and den.spread is not None and den.spread.min > 0:
        spread = Spread(min=num.spread.min / den.spread.max, max=num.spread.max / den.spread.min,
                        n=min(num.spread.n, den.spread.n))
    return Metric(value=n / d, unit="x", method=method, spread=spread)


def _longest_common_prompt(v: VariantReport, base: VariantReport) -> int | None:
    common = {p.prompt_tokens for p in v.speed.prefill} & {p.prompt_tokens for p in base.speed.prefill}
    return max(common) if common else None


def _fill_variant(v: VariantReport, base: VariantReport) -> None:
    q, bq = v.quality, base.quality
    is_base = v.name == base.name
    if is_base:  # the reference against itself: exact by definition, not measured
        ref = "baseline: the reference itself"
        if value_of(q.kl_divergence) is None:
            q.kl_divergence = Metric(value=0.0, unit="nats", method=ref)
        if value_of(q.top1_agreement) is None:
            q.top1_agreement = Metric(value=1.0, unit="", method=ref)
    if value_of(q.ppl_increase_pct) is None and value_of(q.perplexity) is not None and value_of(bq.perplexity):
        q.ppl_increase_pct = Metric(
            value=100.0 * (q.perplexity.value / bq.perplexity.value - 1.0), unit="%",
            method="100 (perplexity / baseline perplexity - 1), same tokens",
        )
    if value_of(q.task_accuracy_drop) is None and q.tasks:
        common = [t for t in q.tasks if t in bq.tasks and value_of(q.tasks[t].accuracy) is not None
                  and value_of(bq.tasks[t].accuracy) is not None]
        if common:
            drop = max(bq.tasks[t].accuracy.value - q.tasks[t].accuracy.value for t in common)
            q.task_accuracy_drop = Metric(
                value=100.0 * drop, unit="points",
                method=f"largest accuracy drop vs the baseline over {len(common)} task(s) ({', '.join(sorted(common))}), x 100",
            )
    s, bs = v.speed, base.speed
    if value_of(s.decode_speedup) is None:
        d, bd = s.decode_at(1), bs.decode_at(1)
        s.decode_speedup = _ratio(d and d.tok_s, bd and bd.tok_s, "decode tok/s at batch 1 / baseline's, same run") or s.decode_speedup
    n = _longest_common_prompt(v, base)
    if value_of(s.prefill_speedup) is None and n is not None:
        s.prefill_speedup = _ratio(
            bs.prefill_at(n).ttft_ms, s.prefill_at(n).ttft_ms, f"baseline TTFT / this TTFT at {n} prompt tokens, same run"
        ) or s.prefill_speedup


def fill_derived(report: Report) -> Report:
    """A copy of ``report`` with ratios to the baseline and ``noise`` filled where missing.

    Failed variants are left alone (their figures, if any, are not trusted).
    """
    r = report.model_copy(deep=True)
    base = r.baseline_variant
    for v in r.variants:
        if v.status == "ok":
            _fill_variant(v, base)
    if not r.noise:
        r.noise = measured_noise(r)
    return r


def size_ratio(v: VariantReport, base: VariantReport) -> float | None:
    """weight_bytes / baseline weight_bytes (None when either is not measured)."""
    w, bw = value_of(v.memory.weight_bytes), value_of(base.memory.weight_bytes)
    return None if w is None or not bw else w / bw


def speed_metrics(v: VariantReport) -> dict[str, Metric]:
    """Every speed figure of a variant under a stable key (``decode_tok_s@b4``, ``ttft_ms@512``)."""
    out: dict[str, Metric] = {}
    for d in v.speed.decode:
        out[f"decode_tok_s@b{d.batch}"] = d.tok_s
        if d.itl_ms_p50 is not None:
            out[f"itl_ms_p50@b{d.batch}"] = d.itl_ms_p50
        if d.itl_ms_p99 is not None:
            out[f"itl_ms_p99@b{d.batch}"] = d.itl_ms_p99
    for p in v.speed.prefill:
        out[f"ttft_ms@{p.prompt_tokens}"] = p.ttft_ms
        out[f"prefill_tok_s@{p.prompt_tokens}"] = p.tok_s
    for k in ("decode_speedup", "prefill_speedup"):
        if getattr(v.speed, k) is not None:
            out[k] = getattr(v.speed, k)
    return out


def measured_noise(report: Report) -> dict[str, float]:
    """Per speed metric, the largest relative spread (%) over the run's variants.

    Quality and size figures are deterministic (same tokens, same bytes), so only metrics with
    repeats appear. ``compare`` uses this for a metric whose own Metric carries no spread.
    """
    noise: dict[str, float] = {}
    for v in report.variants:
        if v.status != "ok":
            continue
        for key, m in speed_metrics(v).items():
            pct = m.noise_pct
            if pct is not None:
                noise[key] = max(noise.get(key, 0.0), pct)
    return dict(sorted(noise.items()))


def roofline_point(phase: str, label: str, flops: float, bytes_moved: float, seconds: float,
                   dtype: str | None = None) -> RooflinePoint:
    """A roofline point from work done and time taken.

    For the weight-bound phases of a decoder, use ``flops = 2 x matmul parameters x tokens``
    and ``bytes_moved = weight bytes read`` (decode step: every weight once per step, so the
    intensity is ``2 x batch x params / weight_bytes``; prefill of T tokens: weights once for
    all T). Attention FLOPs and KV/activation traffic are left out, which understates both
    (small for short contexts; say so in the method text if it matters).
    """
    return RooflinePoint(
        phase=phase, label=label, intensity_flop_per_byte=flops / bytes_moved,
        achieved_tflops=flops / seconds / 1e12, achieved_gb_s=bytes_moved / seconds / 1e9, dtype=dtype,
    )


__all__ = ["fill_derived", "measured_noise", "roofline_point", "size_ratio", "speed_metrics"]
