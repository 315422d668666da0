"""``report.json``: the sign-off report's data model, its JSON schema, and the atomic writer.

One report covers one recipe run: every variant (the baseline and each quantized candidate)
measured on the same tokens and the same machine. Every number is a :class:`Metric`, which
carries its unit and the method that produced it (a reader of the JSON alone must be able to
tell how a figure was measured), and its spread over repeats where there were repeats (which
is what ``optkit report compare`` treats as noise).

A value of ``None`` means "not measured", never zero: gates on it fail with "not measured" and
the renderers print ``n/m``. Values must be finite: a diverged variant is recorded as
``status: failed`` with its error, not as an infinite perplexity (JSON has no infinity, and a
schema-valid file must stay loadable by any JSON reader).

The models are plain pydantic models with ``extra="forbid"`` (a misspelt field is an error,
not a silently dropped number) and ``schema_version`` on the root. They are not frozen so the
measurement loop can fill a report as it goes; the functions of this package never mutate
their input and return copies instead.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from optkit.errors import UserError

REPORT_SCHEMA_VERSION = 1

REPORT_FILES = ("report.json", "report.md", "report.html")


class _Model(BaseModel):
    # allow_inf_nan=False: NaN/inf have no JSON spelling (see the module docstring).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)


class Spread(_Model):
    """Range of the repeated measurements behind a median (``n`` repeats)."""

    min: float = Field(description="Smallest of the repeats.")
    max: float = Field(description="Largest of the repeats.")
    n: int = Field(ge=1, description="Number of repeats.")


class Metric(_Model):
    """One measured number with its unit and method. ``value=None``: not measured."""

    value: float | int | None = Field(None, description="Median (or the single measurement); null = not measured.")
    unit: str = Field("", description="Unit, e.g. 'tok/s', 'ms', 'bytes', 'nats', '%' or '' for ratios.")
    method: str = Field("", description="How it was measured (command, protocol, repeats), or why it is missing.")
    spread: Spread | None = Field(None, description="min/max over repeats; null for one-shot or deterministic figures.")

    @property
    def noise_pct(self) -> float | None:
        """Relative spread ``100 (max - min) / |value|`` (the same as ``optkit bench``'s
        ``spread_pct``); None without a spread or with a zero value."""
        if self.spread is None or self.value is None or self.value == 0:
            return None
        return 100.0 * (self.spread.max - self.spread.min) / abs(self.value)

    @classmethod
    def from_summary(cls, summary: dict, unit: str, method: str, scale: float = 1.0) -> Metric:
        """From ``optkit.serve.bench.summarize()`` output (``{median, min, max, n}``), scaled
        (e.g. ``scale=1e3`` for seconds to ms)."""
        return cls(
            value=summary["median"] * scale, unit=unit, method=method,
            spread=Spread(min=summary["min"] * scale, max=summary["max"] * scale, n=summary["n"]),
        )


def value_of(m: Metric | None) -> float | int | None:
    """The metric's value, or None when the metric is absent or not measured."""
    return None if m is None else m.value


class Engine(_Model):
    """Which engine produced the speed figures."""

    name: Literal["optkit-runner", "transformers-fallback"] = Field(description="The runner, or transformers' generate.")
    reason: str | None = Field(None, description="Why the fallback was used (required for transformers-fallback).")

    @model_validator(mode="after")
    def _reason_for_fallback(self) -> Engine:
        if self.name == "transformers-fallback" and not self.reason:
            raise ValueError("engine 'transformers-fallback' needs a reason (why the optkit runner could not be used)")
        return self


class Provenance(_Model):
    """Everything needed to reproduce the report and to tell two runs apart."""

    recipe: dict[str, Any] = Field(default_factory=dict, description="The resolved recipe, as run.")
    recipe_sha256: str | None = Field(None, description="SHA-256 of the canonical recipe JSON.")
    checkpoint_fingerprint: str | None = Field(None, description="Fingerprint of the source checkpoint's weights.")
    calibration_fingerprint: str | None = Field(None, description="Fingerprint of the calibration token batches.")
    artifact_hashes: dict[str, dict[str, str]] = Field(
        default_factory=dict, description="Per variant: artifact file name -> SHA-256."
    )
    packages: dict[str, str] = Field(default_factory=dict, description="Package name -> version (torch, transformers, ...).")
    hardware: dict[str, Any] = Field(default_factory=dict, description="CPU/GPU model, threads, platform.")
    date: str = Field(description="UTC time the run started, ISO 8601.")
    optkit_version: str = Field(description="optkit.__version__ that produced the report.")
    engine: Engine = Field(description="Engine behind the speed figures.")
    command: str | None = Field(None, description="Command line that produced this report.")
    wall_s: float | None = Field(None, description="Wall time of the whole run, seconds.")

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_name(cls, v: Any) -> Any:
        return {"name": v} if isinstance(v, str) else v  # "optkit-runner" is short for {name: optkit-runner}


class Machine(_Model):
    """Peaks of the machine, measured in this run: the roofs of the roofline."""

    peak_read_bandwidth: Metric = Field(description="Peak memory read bandwidth, GB/s.")
    peak_matmul: dict[str, Metric] = Field(default_factory=dict, description="Peak matmul throughput per dtype, TFLOP/s.")


class MemoryReport(_Model):
    artifact_bytes: Metric | None = Field(None, description="All files of the artifact.")
    weight_bytes: Metric | None = Field(None, description="Weight files only (codes, scales, zero points, 16-bit tensors).")
    bits_per_weight: Metric | None = Field(None, description="Stored bits per quantized-Linear weight, scales included.")
    kv_bytes_per_token: Metric | None = Field(None, description="KV-cache bytes per token (all layers).")
    peak_rss_bytes: Metric | None = Field(None, description="Peak resident memory of the measurement process.")
    peak_cuda_bytes: Metric | None = Field(None, description="Peak CUDA memory allocated.")
    max_context_tokens: Metric | None = Field(None, description="Tokens of KV that fit a memory budget (method states it).")


class TaskScore(_Model):
    accuracy: Metric = Field(description="Accuracy in [0, 1].")
    n: int = Field(ge=0, description="Number of scored examples.")


class Sample(_Model):
    prompt: str
    text: str


class QualityReport(_Model):
    perplexity: Metric | None = None
    nll: Metric | None = Field(None, description="Mean negative log-likelihood, nats per token.")
    kl_divergence: Metric | None = Field(None, description="Mean KL(P_baseline || P_variant), nats, same positions.")
    top1_agreement: Metric | None = Field(None, description="Fraction of positions whose argmax matches the baseline.")
    ppl_increase_pct: Metric | None = Field(None, description="100 (ppl / baseline ppl - 1).")
    tasks: dict[str, TaskScore] = Field(default_factory=dict, description="Task name -> accuracy and example count.")
    task_accuracy_drop: Metric | None = Field(None, description="Largest accuracy drop vs baseline over the tasks, points.")
    per_layer_sqnr_db: dict[str, float] | None = Field(None, description="Layer -> weight SQNR in dB.")
    sensitivity: dict[str, Any] | list[dict[str, Any]] | None = Field(
        None,
        description="Per-layer sensitivity: SensitivityTable.to_json() ({tokens, layers: {name: {params, kl: {option: kl}}}}) "
        "or a list of row dicts.",
    )
    mixed_plan: dict[str, Any] | None = Field(None, description="The mixed-precision plan chosen.")
    samples: list[Sample] = Field(default_factory=list, description="Greedy generations on fixed prompts.")


class PrefillPoint(_Model):
    prompt_tokens: int = Field(ge=1)
    ttft_ms: Metric
    tok_s: Metric


class DecodePoint(_Model):
    batch: int = Field(ge=1)
    tok_s: Metric = Field(description="Decoded tokens per second, summed over the batch.")
    itl_ms_p50: Metric | None = None
    itl_ms_p99: Metric | None = None


class SpeedReport(_Model):
    prefill: list[PrefillPoint] = Field(default_factory=list)
    decode: list[DecodePoint] = Field(default_factory=list)
    decode_speedup: Metric | None = Field(None, description="Decode tok/s at batch 1 over the baseline's, same run.")
    prefill_speedup: Metric | None = Field(None, description="Baseline TTFT over this TTFT at the longest common prompt.")

    def decode_at(self, batch: int) -> DecodePoint | None:
        return next((d for d in self.decode if d.batch == batch), None)

    def prefill_at(self, prompt_tokens: int) -> PrefillPoint | None:
        return next((p for p in self.prefill if p.prompt_tokens == prompt_tokens), None)


class RooflinePoint(_Model):
    phase: Literal["prefill", "decode"]
    label: str = Field(description="e.g. 'decode b1' or 'prefill 512'.")
    intensity_flop_per_byte: float = Field(gt=0, description="FLOPs per byte moved from memory.")
    achieved_tflops: float = Field(ge=0)
    achieved_gb_s: float = Field(ge=0)
    dtype: str | None = Field(None, description="Compute dtype, i.e. which matmul roof applies.")


class Roofline(_Model):
    points: list[RooflinePoint] = Field(default_factory=list)


class GateResult(_Model):
    gate: str = Field(description="Canonical gate text, e.g. 'kl_divergence <= 0.05'.")
    metric: str
    op: Literal["<=", "<", ">=", ">"]
    limit: float
    value: float | None = Field(None, description="The variant's value; null = not measured.")
    passed: bool
    reason: str


class VariantReport(_Model):
    name: str = Field(min_length=1)
    description: str | None = None
    status: Literal["ok", "failed"] = "ok"
    error: str | None = Field(None, description="Why the variant failed (required when status is 'failed').")
    scheme: str | None = None
    algorithm: str | None = None
    memory: MemoryReport = Field(default_factory=MemoryReport)
    quality: QualityReport = Field(default_factory=QualityReport)
    speed: SpeedReport = Field(default_factory=SpeedReport)
    roofline: Roofline = Field(default_factory=Roofline)
    gates: list[GateResult] = Field(default_factory=list, description="Filled by evaluate_gates().")
    passed: bool = Field(False, description="Every gate passed (filled by evaluate_gates()).")

    @model_validator(mode="after")
    def _error_for_failed(self) -> VariantReport:
        if self.status == "failed" and not self.error:
            raise ValueError(f"variant {self.name!r} has status 'failed' but no error message")
        return self


class Verdict(_Model):
    recommended: str | None = Field(None, description="The variant to ship, or null when none passes every gate.")
    passed: bool
    reason: str


class Report(_Model):
    """The root of ``report.json``."""

    schema_version: Literal[1] = Field(REPORT_SCHEMA_VERSION, description="Bumped on any incompatible change.")
    title: str = "optkit sign-off report"
    provenance: Provenance
    machine: Machine
    baseline: str = Field(description="Name of the baseline variant (the quality reference and the speed denominator).")
    variants: list[VariantReport] = Field(min_length=1)
    gates: list[str] = Field(default_factory=list, description="Declared gates, canonical text ('METRIC OP LIMIT').")
    verdict: Verdict | None = Field(None, description="Filled by evaluate_gates().")
    noise: dict[str, float] = Field(
        default_factory=dict, description="Metric -> largest relative spread (%) seen in this run; used by compare."
    )
    notes: list[str] = Field(default_factory=list, description="Caveats a reader must see (synthetic weights, fallbacks).")

    @model_validator(mode="after")
    def _names(self) -> Report:
        names = [v.name for v in self.variants]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"variant names must be unique; repeated: {', '.join(dup)}")
        if self.baseline not in names:
            raise ValueError(f"baseline {self.baseline!r} is not a variant; variants: {', '.join(names)}")
        return self

    def variant(self, name: str) -> VariantReport:
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(name)

    @property
    def baseline_variant(self) -> VariantReport:
        return self.variant(self.baseline)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"


def report_json_schema() -> dict:
    """JSON Schema of ``report.json`` (draft 2020-12, from the pydantic models)."""
    schema = Report.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "optkit report"
    return schema


def load_report(path: str | Path) -> Report:
    """Read and validate a report.json; a missing, unreadable or invalid file is a UserError."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"report {p} not found", hint="pass the report.json written by optkit") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"report {p} cannot be read as JSON: {err}") from None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version != REPORT_SCHEMA_VERSION:
        raise UserError(
            f"report {p} has schema_version {version!r}; this optkit reads version {REPORT_SCHEMA_VERSION}",
            hint="re-render it with the optkit version that wrote it",
        )
    try:
        return Report.model_validate(data)
    except ValidationError as err:
        raise UserError(f"report {p} is not a valid optkit report:\n{err}") from None


def write_report(report: Report, out_dir: str | Path) -> Path:
    """Write report.json, report.md and report.html into ``out_dir``; returns ``out_dir``.

    All three are rendered in memory first, so a rendering error writes nothing. They are then
    written into a temporary directory beside ``out_dir`` (same file system, so renames are
    atomic). A new ``out_dir`` is created by renaming that directory; into an existing one each
    file is renamed over its old version. Either way no file is ever half-written, and the
    temporary directory is removed on any error.
    """
    from optkit.report.render import render_html, render_markdown  # render imports this module

    out = Path(out_dir)
    contents = {
        "report.json": report.to_json(),
        "report.md": render_markdown(report),
        "report.html": render_html(report),
    }
    if out.exists() and not out.is_dir():
        raise UserError(f"report output {out} exists and is not a directory", hint="pass a directory path")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for name, text in contents.items():
            with open(tmp / name, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        if out.exists():
            for name in contents:
                os.replace(tmp / name, out / name)
        else:
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a report directory is for reading
            os.rename(tmp, out)
    except OSError as err:
        raise UserError(f"cannot write the report to {out}: {err}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


__all__ = [
    "REPORT_SCHEMA_VERSION", "REPORT_FILES", "DecodePoint", "Engine", "GateResult", "Machine", "MemoryReport", "Metric",
    "PrefillPoint", "Provenance", "QualityReport", "Report", "Roofline", "RooflinePoint", "Sample", "SpeedReport",
    "Spread", "TaskScore", "VariantReport", "Verdict", "load_report", "report_json_schema", "value_of", "write_report",
]
