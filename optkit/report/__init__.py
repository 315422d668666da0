"""The sign-off report: schema (report.json), gates and verdict, Pareto frontiers, run-to-run
comparison, and rendering to Markdown and self-contained HTML.

The measurement loop (``optkit.pipeline``) fills a :class:`Report`; ``evaluate_gates`` adds
the derived ratios, gate results and verdict; ``write_report`` writes the three files.
matplotlib is imported only when HTML is rendered.
"""

from optkit.report.compare import CompareResult, compare, render_compare_markdown
from optkit.report.derive import fill_derived, measured_noise, roofline_point
from optkit.report.gates import METRICS, Gate, GateError, evaluate_gates, exit_code, exit_message, validate_gates
from optkit.report.pareto import frontier, pareto_front
from optkit.report.render import render_html, render_markdown
from optkit.report.schema import (
    REPORT_SCHEMA_VERSION,
    Metric,
    Report,
    VariantReport,
    load_report,
    report_json_schema,
    write_report,
)

__all__ = [
    "METRICS", "REPORT_SCHEMA_VERSION", "CompareResult", "Gate", "GateError", "Metric", "Report", "VariantReport",
    "compare", "evaluate_gates", "exit_code", "exit_message", "fill_derived", "frontier", "load_report",
    "measured_noise", "pareto_front", "render_compare_markdown", "render_html", "render_markdown",
    "report_json_schema", "roofline_point", "validate_gates", "write_report",
]
