"""report.md (a PR comment or ``$GITHUB_STEP_SUMMARY``) and report.html (one offline file).

Markdown: the verdict line first, then the variants table with one PASS/FAIL column per gate,
speed per phase, memory, roofline figures, the Pareto frontiers as text, and provenance folded
in ``<details>``. No images: a step summary cannot embed local files, so it points at the HTML.

HTML: the same tables plus the roofline and both Pareto plots as ``data:image/png;base64``
images, generated samples side by side, and per-layer SQNR, sensitivity and mixed-precision
tables when present. Inline CSS, no script, no external URL: it opens offline and survives
being attached to a CI run. Every string from the report is HTML-escaped.
"""

from __future__ import annotations

import base64
import html
import json

from optkit.report import tables as T
from optkit.report.schema import Report

_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1400px;padding:0 1em;color:#1f2328}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.8em;border-bottom:1px solid #d0d7de}
table{border-collapse:collapse;margin:.6em 0;font-size:.86em}
th,td{border:1px solid #d0d7de;padding:3px 7px;text-align:right;vertical-align:top}
th{background:#f6f8fa}td:first-child,th:first-child{text-align:left}
.verdict{padding:.7em 1em;border-radius:6px;font-size:1.1em;font-weight:600}
.pass{background:#dafbe1;border:1px solid #1a7f37}.fail{background:#ffebe9;border:1px solid #cf222e}
.cell-pass{color:#1a7f37}.cell-fail{color:#cf222e;font-weight:600}
.note{color:#57606a;font-size:.85em;margin:.2em 0}
.samples td{text-align:left;white-space:pre-wrap;max-width:40em}
img{max-width:100%;border:1px solid #d0d7de;margin:.5em 0}
pre{background:#f6f8fa;padding:.6em;overflow:auto;font-size:.8em}
"""


def _main_tables(r: Report) -> list[T.Table]:
    out = [T.summary_table(r), T.prefill_table(r), T.decode_table(r), T.memory_table(r), T.roofline_table(r)]
    tasks = T.tasks_table(r)
    if tasks is not None:
        out.insert(1, tasks)
    return out


# -- Markdown ---------------------------------------------------------------------------------

def render_markdown(report: Report) -> str:
    r = report
    lines = [f"## {T.md_escape(r.title)}: {T.verdict_line(r)}", ""]
    if r.verdict is not None:
        lines += [r.verdict.reason, ""]
    if r.gates:
        lines += ["Gates: " + ", ".join(f"`{g}`" for g in r.gates), ""]
    for n in r.notes:
        lines.append(f"> **Note:** {n}")
    if r.notes:
        lines.append("")
    for t in _main_tables(r):
        lines += [f"### {t.title}", "", T.md_table(t.headers, t.rows) if t.rows else "_none measured_", ""]
        lines += [f"- {n}" for n in t.notes]
        if t.notes:
            lines.append("")
    lines += ["### Trade-offs", ""] + [f"- {p}" for p in T.pareto_lines(r)] + [""]
    lines += [f"`{T.NM}` = not measured. Plots (roofline, Pareto), samples and per-layer tables are in "
              "`report.html` next to this file; every figure's method is in `report.json`.", ""]
    for t in (T.methods_table(r), T.provenance_table(r)):
        lines += [f"<details><summary>{t.title}</summary>", "", T.md_table(t.headers, t.rows), "", "</details>", ""]
    return "\n".join(lines)


# -- HTML -------------------------------------------------------------------------------------

def _e(s: object) -> str:
    return html.escape(str(s), quote=True)


def _cell(c: str) -> str:
    cls = ' class="cell-pass"' if c.startswith("PASS") else ' class="cell-fail"' if c.startswith("FAIL") else ""
    return f"<td{cls}>{_e(c)}</td>"


def _html_table(t: T.Table, cls: str = "") -> str:
    parts = [f"<h2>{_e(t.title)}</h2>"]
    if not t.rows:
        parts.append('<p class="note">none measured</p>')
    else:
        attr = f' class="{cls}"' if cls else ""
        parts.append(f"<table{attr}><thead><tr>" + "".join(f"<th>{_e(h)}</th>" for h in t.headers) + "</tr></thead><tbody>")
        parts += ["<tr>" + "".join(_cell(c) for c in row) + "</tr>" for row in t.rows]
        parts.append("</tbody></table>")
    parts += [f'<p class="note">{_e(n)}</p>' for n in t.notes]
    return "\n".join(parts)


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def _samples(r: Report) -> str:
    ok = [v for v in r.variants if v.quality.samples]
    if not ok:
        return ""
    prompts: list[str] = []
    for v in ok:
        prompts += [s.prompt for s in v.quality.samples if s.prompt not in prompts]
    head = "<tr><th>prompt</th>" + "".join(f"<th>{_e(v.name)}</th>" for v in ok) + "</tr>"
    rows = []
    for p in prompts:
        cells = []
        for v in ok:
            text = next((s.text for s in v.quality.samples if s.prompt == p), T.NM)
            cells.append(f"<td>{_e(text)}</td>")
        rows.append(f"<tr><td>{_e(p)}</td>{''.join(cells)}</tr>")
    return f'<h2>Samples</h2><table class="samples"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>'


def _per_layer(r: Report) -> str:
    parts = []
    sq = [v for v in r.variants if v.quality.per_layer_sqnr_db]
    if sq:
        layers = sorted({k for v in sq for k in v.quality.per_layer_sqnr_db})
        rows = [[layer] + [T.fmt_num(v.quality.per_layer_sqnr_db.get(layer)) for v in sq] for layer in layers]
        parts.append(_html_table(T.Table("Per-layer weight SQNR, dB", ["layer"] + [v.name for v in sq], rows)))
    for v in r.variants:
        sens = T.sensitivity_table(v)
        if sens is not None:
            parts.append(_html_table(sens))
        if v.quality.mixed_plan:
            parts.append(f"<h2>Mixed-precision plan: {_e(v.name)}</h2>{_json_pre(v.quality.mixed_plan)}")
    return "\n".join(parts)


def _json_pre(data: object) -> str:
    return f"<pre>{_e(json.dumps(data, indent=2, sort_keys=True, default=str))}</pre>"


def render_html(report: Report) -> str:
    from optkit.report.plots import pareto_png, roofline_png  # matplotlib only when rendering HTML

    r = report
    passed = r.verdict is not None and r.verdict.passed
    body = [f"<h1>{_e(r.title)}</h1>",
            f'<div class="verdict {"pass" if passed else "fail"}">{_e(T.verdict_line(r).replace("`", ""))}'
            + (f'<div class="note">{_e(r.verdict.reason)}</div>' if r.verdict else "") + "</div>"]
    if r.gates:
        body.append("<p>Gates: " + ", ".join(f"<code>{_e(g)}</code>" for g in r.gates) + "</p>")
    body += [f'<p class="note"><b>Note:</b> {_e(n)}</p>' for n in r.notes]
    body += [_html_table(t) for t in _main_tables(r)]  # the last is the roofline table: its plot follows
    body.append(_img(roofline_png(r), "roofline"))
    body.append("<h2>Trade-offs</h2>" + "".join(f'<p class="note">{_e(p)}</p>' for p in T.pareto_lines(r)))
    body.append(_img(pareto_png(r, "decode_latency"), "quality loss vs decode latency"))
    body.append(_img(pareto_png(r, "size"), "quality loss vs weight size"))
    body += [_samples(r), _per_layer(r)]
    body.append(f'<p class="note">{T.NM} = not measured.</p>')
    body += [_html_table(T.methods_table(r)), _html_table(T.provenance_table(r))]
    if r.provenance.recipe:
        body.append(f"<details><summary>recipe</summary>{_json_pre(r.provenance.recipe)}</details>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(r.title)}</title><style>{_CSS}</style></head><body>\n" + "\n".join(b for b in body if b)
            + "\n</body></html>\n")


__all__ = ["render_html", "render_markdown"]
