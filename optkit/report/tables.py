"""The report's tables as plain data, shared by the Markdown and HTML renderers.

Keeping the content here (and only the markup in ``render.py``) means the two formats can not
drift apart: a column added for one is in both. Cells are already-formatted strings; ``n/m``
marks a figure that was not measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from optkit.report.derive import size_ratio
from optkit.report.pareto import X_LABELS, Y_LABELS, frontier
from optkit.report.schema import GateResult, Metric, Report, VariantReport, value_of

NM = "n/m"


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)


def fmt_num(v: float | int | None) -> str:
    """Four significant figures or so, thousands separators for big numbers, ``n/m`` for None."""
    if v is None:
        return NM
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 10:
        return f"{v:.2f}"
    if a >= 1:
        return f"{v:.3f}"
    return f"{v:.4g}"


def fmt_metric(m: Metric | None, scale: float = 1.0, spread: bool = True) -> str:
    """``61.1 (58.2..63.0)`` with the spread over repeats when there is one."""
    v = value_of(m)
    if v is None:
        return NM
    text = fmt_num(v * scale if scale != 1.0 else v)
    if spread and m.spread is not None and m.spread.n > 1:
        text += f" ({fmt_num(m.spread.min * scale)}..{fmt_num(m.spread.max * scale)})"
    return text


def fmt_mb(m: Metric | None) -> str:
    return fmt_metric(m, 1e-6, spread=False)


def gate_cell(g: GateResult) -> str:
    if g.passed:
        return f"PASS {fmt_num(g.value)}"
    return f"FAIL {fmt_num(g.value)}" if g.value is not None else ("FAIL not measured" if g.reason.startswith("not measured")
                                                                     else "FAIL (variant failed)")


def verdict_line(r: Report) -> str:
    if r.verdict is None:
        return "gates not evaluated"
    if r.verdict.passed:
        return f"PASS: recommended `{r.verdict.recommended}`"
    return "FAIL: no variant passes every gate"


def _name(r: Report, v: VariantReport) -> str:
    tags = [t for t, on in (("baseline", v.name == r.baseline),
                            ("recommended", r.verdict is not None and v.name == r.verdict.recommended)) if on]
    return v.name + (f" ({', '.join(tags)})" if tags else "")


def summary_table(r: Report) -> Table:
    base = r.baseline_variant
    headers = ["variant", "status", "scheme", "bits/w", "weights MB", "size ratio", "perplexity", "ppl +%", "KL",
               "top-1", "task drop (pts)", "decode tok/s b1", "decode speedup", "prefill speedup"] + list(r.gates)
    rows = []
    for v in r.variants:
        q, s = v.quality, v.speed
        d1 = s.decode_at(1)
        ratio = size_ratio(v, base) if v.status == "ok" else None
        row = [_name(r, v), v.status if v.status == "ok" else f"failed: {v.error}", v.scheme or "-",
               fmt_metric(v.memory.bits_per_weight), fmt_mb(v.memory.weight_bytes), fmt_num(ratio),
               fmt_metric(q.perplexity), fmt_metric(q.ppl_increase_pct), fmt_metric(q.kl_divergence),
               fmt_metric(q.top1_agreement), fmt_metric(q.task_accuracy_drop),
               fmt_metric(d1.tok_s if d1 else None), fmt_metric(s.decode_speedup, spread=False),
               fmt_metric(s.prefill_speedup, spread=False)]
        by_gate = {g.gate: g for g in v.gates}
        row += [gate_cell(by_gate[g]) if g in by_gate else "-" for g in r.gates]
        rows.append(row)
    notes = [f"{v.name}: {g.gate}: {g.reason}" for v in r.variants for g in v.gates
             if not g.passed and g.value is None and v.status == "ok"]
    return Table("Variants", headers, rows, [f"not measured, so the gate fails: {n}" for n in notes])


def _wide(r: Report, title: str, keys: list, label, cell) -> Table:
    rows = [[v.name] + [cell(v, k) for k in keys] for v in r.variants if v.status == "ok"]
    return Table(title, ["variant"] + [label(k) for k in keys], rows)


def prefill_table(r: Report) -> Table:
    lens = sorted({p.prompt_tokens for v in r.variants for p in v.speed.prefill})

    def cell(v, n):
        p = v.speed.prefill_at(n)
        return NM if p is None else f"{fmt_metric(p.ttft_ms)} / {fmt_num(value_of(p.tok_s))}"

    t = _wide(r, "Prefill: TTFT ms (min..max) / prefill tok/s", lens, lambda n: f"{n} tokens", cell)
    return t


def decode_table(r: Report) -> Table:
    batches = sorted({d.batch for v in r.variants for d in v.speed.decode})

    def cell(v, b):
        d = v.speed.decode_at(b)
        if d is None:
            return NM
        if d.itl_ms_p50 is None and d.itl_ms_p99 is None:
            return fmt_metric(d.tok_s)
        return f"{fmt_metric(d.tok_s)}; ITL {fmt_metric(d.itl_ms_p50)} / {fmt_metric(d.itl_ms_p99)} ms"

    return _wide(r, "Decode: tok/s (min..max); inter-token latency p50 / p99", batches, lambda b: f"batch {b}", cell)


def memory_table(r: Report) -> Table:
    headers = ["variant", "artifact MB", "weights MB", "bits/w", "KV bytes/token", "max context tokens", "peak RSS MB",
               "peak CUDA MB"]
    rows, budgets = [], set()
    for v in r.variants:
        m = v.memory
        if m.max_context_tokens is not None and m.max_context_tokens.method:
            budgets.add(m.max_context_tokens.method)
        rows.append([v.name, fmt_mb(m.artifact_bytes), fmt_mb(m.weight_bytes), fmt_metric(m.bits_per_weight),
                     fmt_metric(m.kv_bytes_per_token), fmt_metric(m.max_context_tokens), fmt_mb(m.peak_rss_bytes),
                     fmt_mb(m.peak_cuda_bytes)])
    return Table("Memory", headers, rows, [f"max context: {b}" for b in sorted(budgets)])


def roofline_table(r: Report) -> Table:
    bw = value_of(r.machine.peak_read_bandwidth)
    headers = ["variant", "point", "FLOP/byte", "TFLOP/s", "GB/s", "of peak bandwidth"]
    rows = []
    for v in r.variants:
        for p in v.roofline.points:
            frac = f"{100 * p.achieved_gb_s / bw:.0f} %" if bw else NM
            rows.append([v.name, p.label, fmt_num(p.intensity_flop_per_byte), fmt_num(p.achieved_tflops),
                         fmt_num(p.achieved_gb_s), frac])
    roofs = [f"peak read bandwidth {fmt_metric(r.machine.peak_read_bandwidth)} GB/s ({r.machine.peak_read_bandwidth.method})"]
    roofs += [f"peak matmul {k}: {fmt_metric(m)} TFLOP/s ({m.method})" for k, m in r.machine.peak_matmul.items()]
    return Table("Roofline", headers, rows, roofs)


def tasks_table(r: Report) -> Table | None:
    tasks = sorted({t for v in r.variants for t in v.quality.tasks})
    if not tasks:
        return None

    def cell(v, t):
        s = v.quality.tasks.get(t)
        return NM if s is None else f"{fmt_metric(s.accuracy)} (n={s.n})"

    return _wide(r, "Task accuracy", tasks, str, cell)


def pareto_lines(r: Report) -> list[str]:
    out = []
    for x in X_LABELS:
        res = frontier(r, x)
        line = f"Pareto frontier, {Y_LABELS[res.y]} vs {X_LABELS[x]}: " + (", ".join(res.frontier) or "none")
        if res.excluded:
            line += " (left out: " + "; ".join(res.notes) + ")"
        out.append(line)
    return out


def provenance_table(r: Report) -> Table:
    p = r.provenance
    eng = p.engine.name + (f" ({p.engine.reason})" if p.engine.reason else "")
    rows = [["date", p.date], ["optkit", p.optkit_version], ["engine", eng], ["command", p.command or "-"],
            ["recipe sha256", p.recipe_sha256 or "-"], ["checkpoint", p.checkpoint_fingerprint or "-"],
            ["calibration", p.calibration_fingerprint or "-"]]
    rows += [[f"hardware: {k}", str(v)] for k, v in sorted(p.hardware.items())]
    rows += [[f"package: {k}", v] for k, v in sorted(p.packages.items())]
    for name, files in sorted(p.artifact_hashes.items()):
        rows += [[f"artifact {name}: {f}", h] for f, h in sorted(files.items())]
    return Table("Provenance", ["what", "value"], rows)


def methods_table(r: Report) -> Table:
    """How each figure was measured, once per figure (from the first quantized variant, then the
    baseline: every variant is measured the same way, so one description stands for all)."""
    seen: dict[str, str] = {}
    others = [v for v in r.variants if v.name != r.baseline and v.status == "ok"]
    for v in others[:1] + [r.baseline_variant]:  # the baseline's KL/top-1 are definitions, not methods
        q, m = v.quality, v.memory
        cands = {"perplexity": q.perplexity, "KL divergence": q.kl_divergence, "top-1 agreement": q.top1_agreement,
                 "weight bytes": m.weight_bytes, "bits/weight": m.bits_per_weight, "peak RSS": m.peak_rss_bytes}
        cands.update({f"decode b{d.batch}": d.tok_s for d in v.speed.decode[:1]})
        cands.update({f"prefill {p.prompt_tokens}": p.ttft_ms for p in v.speed.prefill[:1]})
        for k, met in cands.items():
            if met is not None and met.method and k not in seen:
                seen[k] = met.method
    return Table("How each figure was measured", ["figure", "method"], [[k, v] for k, v in seen.items()])


def sensitivity_table(v: VariantReport) -> Table | None:
    """Rows of the sensitivity measurement: ``SensitivityTable.to_json()`` (layer -> params and
    KL per precision option, most sensitive first) or a plain list of row dicts."""
    sens = v.quality.sensitivity
    if not sens:
        return None
    title = f"Sensitivity: {v.name}"
    if isinstance(sens, dict):
        layers = sens.get("layers", {})
        options = sorted({o for row in layers.values() for o in row.get("kl", {})})
        worst = sorted(layers, key=lambda n: -max(layers[n].get("kl", {}).values(), default=0.0))
        rows = [[n, fmt_num(layers[n].get("params"))] + [fmt_num(layers[n].get("kl", {}).get(o)) for o in options]
                for n in worst]
        notes = [f"KL divergence when this layer alone is quantized, over {sens['tokens']:,} tokens"] if "tokens" in sens else []
        return Table(title, ["layer", "params"] + [f"KL {o}" for o in options], rows, notes)
    keys = list(dict.fromkeys(k for row in sens for k in row))
    rows = [[fmt_num(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else "-" if x is None else str(x)
             for x in (row.get(k) for k in keys)] for row in sens]
    return Table(title, keys, rows)


def md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(md_escape(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(md_escape(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


__all__ = [
    "NM", "Table", "decode_table", "fmt_metric", "fmt_num", "gate_cell", "md_table", "memory_table", "methods_table",
    "pareto_lines", "prefill_table", "provenance_table", "roofline_table", "sensitivity_table", "summary_table", "tasks_table",
    "verdict_line",
]
