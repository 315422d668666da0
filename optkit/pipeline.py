"""run_recipe(recipe) -> QuantizeResult: each stage in order, with explicit values.

checkpoint -> calibration tokens -> layer plan -> quantize -> export (atomic) -> summary.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import resource
from dataclasses import dataclass, field
from pathlib import Path

import torch

from optkit import __version__
from optkit.calibration import build_calibration
from optkit.calibration.resume import ResumeStore
from optkit.calibration.sequential import SequentialReport, quantize_sequential
from optkit.checkpoint import load_checkpoint
from optkit.checkpoint.default import DEFAULT_MODEL_NAME
from optkit.errors import ArtifactError, QuantizationError
from optkit.export import ArtifactInfo, write_artifact
from optkit.hardware import resolve_compute_dtype
from optkit.progress import Reporter
from optkit.quantize.mixed import MixedPlan, Option, choose_precisions
from optkit.quantize.observers import get_observer
from optkit.quantize.plan import LayerPlan, apply_plan, output_head_name, plan_layers, replan, runtime_notes
from optkit.quantize.plan import matches as _matches
from optkit.quantize.scheme import QuantScheme
from optkit.quantize.sensitivity import SensitivityTable, measure_sensitivity
from optkit.recipe import QuantizationConfig, Recipe

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class QuantizeResult:
    """What a run did, for the summary screen and ``--summary-json``."""

    artifact: ArtifactInfo
    model_name: str
    source: dict
    scheme: QuantScheme
    algorithm: str
    plan: LayerPlan
    dtype: str
    params_total: int
    params_quantized: int
    bytes_16bit: int
    calibration: dict
    timings: dict[str, float] = field(default_factory=dict)
    calibrated: SequentialReport | None = None
    sensitivity: SensitivityTable | None = None
    mixed: MixedPlan | None = None
    peak_rss_bytes: int = 0
    notices: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "artifact": str(self.artifact.path),
            "model": self.model_name,
            "source": self.source,
            "scheme": self.scheme.label(),
            "algorithm": self.algorithm,
            "runtime_notes": runtime_notes(self.plan),
            "dtype": self.dtype,
            "layers_quantized": len(self.plan.linears) + len(self.plan.embeddings),
            "layers_skipped": self.plan.skipped,
            "layers_excluded": list(self.plan.excluded),
            "params_total": self.params_total,
            "params_quantized": self.params_quantized,
            "bytes_16bit": self.bytes_16bit,
            "artifact_bytes": self.artifact.total_bytes,
            "weight_bytes": self.artifact.weight_bytes,
            "size_ratio": self.artifact.weight_bytes / self.bytes_16bit,
            "bits_per_weight": 8 * self.artifact.weight_bytes / self.params_total,
            "calibration": self.calibration,
            "timings_s": {k: round(v, 3) for k, v in self.timings.items()},
            "peak_rss_mb": round(self.peak_rss_bytes / 1e6, 1),
            "warnings": list(self.calibrated.warnings) if self.calibrated else [],
            "notices": self.notices,
            "mixed_precision": None if self.mixed is None else {
                "bits_per_weight": self.mixed.bits_per_weight,
                "predicted_kl": self.mixed.predicted_kl,
                "choice": self.mixed.choice,
            },
            "most_sensitive": [] if self.sensitivity is None else most_sensitive(self.sensitivity, 10),
            "output_error": None if self.calibrated is None else mean_output_errors(self.calibrated),
        }


def most_sensitive(table: SensitivityTable, k: int) -> list[dict]:
    """The ``k`` layers with the largest KL divergence at their lowest measured precision."""
    rows = [(max(kl.values()), n, kl) for n, kl in table.kl.items() if kl]
    return [{"layer": n, "kl": kl} for _, n, kl in sorted(rows, reverse=True)[:k]]


def mean_output_errors(report: SequentialReport) -> dict:
    """Mean relative output error of the calibrated layers, and of round-to-nearest on the same inputs."""
    rows = [r for r in report.layers.values() if "output_error" in r]
    if not rows:
        return {}
    return {
        "layers": len(rows),
        "mean": sum(r["output_error"] for r in rows) / len(rows),
        "mean_rtn": sum(r["output_error_rtn"] for r in rows) / len(rows),
    }


def bits_per_weight(scheme: QuantScheme | None, in_features: int, scale_bits: int = 16) -> float:
    """Stored bits per weight of one Linear: codes, plus scales and zero points per group."""
    return 16.0 if scheme is None else scheme.bits_per_weight(in_features, scale_bits)


def run_fingerprint(recipe: Recipe, source_fingerprint: str, calibration_fingerprint: str, dtype: str) -> str:
    """What a resumed run must share with the interrupted one: model, recipe, calibration tokens."""
    q = recipe.quantization.model_dump(mode="json")
    q.pop("resume")
    data = {
        "optkit": __version__,
        "source": source_fingerprint,
        "model": recipe.model.model_dump(mode="json"),
        "calibration": recipe.calibration.model_dump(mode="json"),
        "calibration_tokens": calibration_fingerprint,
        "quantization": q,
        "dtype": dtype,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def resume_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.resume"


def _mixed_plan(model, plan: LayerPlan, q: QuantizationConfig, input_ids: torch.Tensor, dtype: torch.dtype,
                reporter: Reporter, store: ResumeStore | None) -> tuple[LayerPlan, SensitivityTable, MixedPlan]:
    mp = q.mixed_precision
    fixed = {n for n in plan.linears if any(_matches(n, lp.match) for lp in q.layers)}
    modules = dict(model.named_modules())
    head = output_head_name(model)
    names = [n for n in plan.linears if n not in fixed and n != head]
    measured = {lbl: q.precision_scheme(lbl) for lbl in mp.candidates if lbl != "16bit"}
    if mp.bits_per_weight is not None:  # fail before minutes of measuring when no plan can fit
        cheapest = {
            n: min(bits_per_weight(q.precision_scheme(lbl), modules[n].in_features) for lbl in mp.candidates
                   if lbl == "16bit" or q.precision_scheme(lbl).fits(modules[n].in_features))
            for n in names
        }
        total = sum(modules[n].weight.numel() for n in names)
        smallest = sum(modules[n].weight.numel() * b for n, b in cheapest.items()) / total
        if smallest > mp.bits_per_weight + 1e-9:
            raise QuantizationError(
                f"no plan fits {mp.bits_per_weight} bits/weight: the smallest plan needs {smallest:.3f} "
                f"(closest plan: every layer at its smallest candidate among {', '.join(mp.candidates)})",
                hint="raise mixed_precision.bits_per_weight, or add a smaller candidate precision",
            )
    cached = store.get_extra("sensitivity") if store is not None else None
    if cached is not None and set(cached["layers"]) == set(names):
        table = SensitivityTable.from_json(cached)
    else:
        ids = input_ids[: mp.num_samples, : mp.seq_len]
        with reporter.stage("sensitivity", f"Measuring sensitivity of {len(names)} layers "
                            f"({', '.join(measured)}; {ids.numel()} tokens)", total=len(names)) as advance:
            table = measure_sensitivity(
                model, ids, {n: {lbl: s for lbl, s in measured.items() if s.fits(modules[n].in_features)} for n in names},
                get_observer(q.resolved_observer()), dtype, on_layer=lambda _n: advance(), measure=mp.measure,
            )
        if store is not None:
            store.put_extra("sensitivity", table.to_json())
    options = {}
    for n in names:
        in_f = modules[n].in_features
        opts = [Option(lbl, bits_per_weight(s, in_f), table.kl[n][lbl]) for lbl, s in measured.items() if lbl in table.kl[n]]
        if "16bit" in mp.candidates:
            opts.append(Option("16bit", 16.0, 0.0))
        options[n] = opts
    params = {n: modules[n].weight.numel() for n in names}
    chosen = choose_precisions(options, params, mp.bits_per_weight, mp.max_kl)
    new_plan = replan(plan, {n: q.precision_scheme(lbl) for n, lbl in chosen.choice.items()})
    return new_plan, table, chosen


def source_name(source: str) -> str:
    if source == "default":
        return DEFAULT_MODEL_NAME
    name = Path(source.rstrip("/")).name
    return Path(name).stem if name.endswith(".gguf") else name


def default_out(recipe: Recipe) -> Path:
    q = recipe.quantization
    s = q.weight_scheme()
    parts = [source_name(recipe.model.source), q.scheme]
    if s.group_size is not None:
        parts.append(f"g{s.group_size}")
    if not s.symmetric:
        parts.append("asym")
    if q.smoothquant is not None:
        parts.append("sq")
    if q.algorithm != "rtn":
        parts.append(q.algorithm)
    if q.mixed_precision is not None:
        mp = q.mixed_precision
        parts.append("mixed" + (f"-{mp.bits_per_weight:g}bpw" if mp.bits_per_weight is not None else f"-kl{mp.max_kl:g}"))
    return Path("artifacts") / re.sub(r"[^\w.-]+", "_", "-".join(parts))


def export_dtype(choice: str, checkpoint_dtype: str | None) -> torch.dtype:
    """'auto' keeps a 16-bit checkpoint's dtype; a 32-bit (or unknown) one is stored as bfloat16."""
    if choice != "auto":
        return _DTYPES[choice]
    if checkpoint_dtype in ("bfloat16", "float16"):
        return _DTYPES[checkpoint_dtype]
    return torch.bfloat16


def run_recipe(recipe: Recipe, reporter: Reporter | None = None, preloaded: tuple | None = None) -> QuantizeResult:
    """Load, calibrate, quantize and export one artifact.

    ``preloaded``: ``(LoadedCheckpoint, Calibration)`` built once by a caller that runs several
    variants of one recipe (the sign-off report): the checkpoint is not read again, the
    calibration tokens are not rebuilt, and the model is deep-copied so every variant starts
    from the same float weights.
    """
    reporter = reporter or Reporter()
    out = Path(recipe.export.out) if recipe.export.out else default_out(recipe)
    # Fail before any work when the target is taken (the writer checks again at the end).
    if out.exists() and not recipe.export.overwrite:
        raise ArtifactError(f"output path {out} already exists", hint="choose another --out or pass --overwrite")

    if preloaded is not None:
        ck, calib = preloaded
        model = copy.deepcopy(ck.model)
    else:
        with reporter.stage("load", "Loading checkpoint"):
            ck = load_checkpoint(recipe.model)
        model = ck.model
        with reporter.stage("calibration", "Building calibration tokens"):
            calib = build_calibration(recipe.calibration, ck.tokenizer)

    q = recipe.quantization
    scheme = q.weight_scheme()
    plan = plan_layers(model, q, tied=bool(getattr(model.config, "tie_word_embeddings", False)))
    params_total = sum(p.numel() for p in model.parameters())  # parameters() counts a tied tensor once
    modules = dict(model.named_modules())
    params_quantized = sum(modules[n].weight.numel() for n in [*plan.linears, *plan.embeddings])
    dtype = export_dtype(recipe.export.dtype, ck.dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    calibration = {"fingerprint": calib.fingerprint, **calib.info}

    store = None
    notices: list[str] = []
    compute_dtype = resolve_compute_dtype(recipe.calibration.compute_dtype, next(model.parameters()).device)
    if q.needs_calibration_pass() or q.mixed_precision is not None:
        calibration["compute_dtype"] = str(compute_dtype).removeprefix("torch.")
    if q.resume and (q.needs_calibration_pass() or q.mixed_precision is not None):
        store = ResumeStore(resume_dir(out), run_fingerprint(recipe, ck.fingerprint, calib.fingerprint, dtype_name))
    sensitivity = mixed = None
    if q.mixed_precision is not None:
        with torch.no_grad():
            plan, sensitivity, mixed = _mixed_plan(model, plan, q, calib.input_ids, dtype, reporter, store)
        notices.append(f"mixed precision: {mixed.describe()}")
        params_quantized = sum(modules[n].weight.numel() for n in [*plan.linears, *plan.embeddings])

    calibrated = None
    observer = get_observer(q.resolved_observer())
    if q.needs_calibration_pass():
        from optkit.quantize.mappings import decoder_blocks

        n_blocks = len(decoder_blocks(model))
        label = q.algorithm + (" + smoothquant" if q.smoothquant else "")
        with reporter.stage("layerwise", f"Calibrating {n_blocks} blocks layer by layer ({label}, {scheme.label()})",
                            total=n_blocks) as advance:
            with torch.no_grad():
                calibrated = quantize_sequential(
                    model, calib.input_ids, dict(plan.linears), q, dtype,
                    batch_size=recipe.calibration.batch_size, offload=recipe.calibration.offload,
                    compute_dtype=compute_dtype,
                    resume=store, on_block=lambda _i, _n: advance(),
                )
        if store is not None and store.notice:
            notices.append(store.notice)
    n_layers = len(plan.linears) + len(plan.embeddings)
    with reporter.stage("quantize", f"Quantizing {n_layers} layers ({scheme.label()}, {q.algorithm})", total=n_layers) as advance:
        with torch.no_grad():
            apply_plan(model, plan, dtype, on_layer=lambda _name: advance(), observer=observer)

    manifest = {
        "recipe": recipe.model_dump(mode="json"),
        "source": ck.source,
        "source_fingerprint": ck.fingerprint,
        "calibration": calibration,
        "algorithm": q.algorithm,
        "dtype": dtype_name,
        "calibrated": None if calibrated is None else {
            "layers": calibrated.layers, "transforms": calibrated.transforms, "warnings": calibrated.warnings,
        },
        "sensitivity": None if sensitivity is None else sensitivity.to_json(),
        "mixed_precision": None if mixed is None else {
            "budget": q.mixed_precision.model_dump(mode="json"),
            "bits_per_weight": mixed.bits_per_weight,
            "predicted_kl": mixed.predicted_kl,
            "choice": mixed.choice,
        },
    }
    with reporter.stage("export", "Writing artifact"):
        info = write_artifact(
            model,
            ck.tokenizer,
            plan,
            out,
            dtype=dtype,
            manifest=manifest,
            overwrite=recipe.export.overwrite,
            max_shard_bytes=recipe.export.max_shard_bytes,
            actorder=q.algorithm == "gptq" and q.gptq.act_order,
        )
    if store is not None:
        store.clear()
    return QuantizeResult(
        artifact=info,
        model_name=ck.name,
        source=ck.source,
        scheme=scheme,
        algorithm=q.algorithm,
        plan=plan,
        dtype=dtype_name,
        params_total=params_total,
        params_quantized=params_quantized,
        bytes_16bit=2 * params_total,
        calibration=calibration,
        timings=dict(reporter.timings),
        calibrated=calibrated,
        sensitivity=sensitivity,
        mixed=mixed,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        notices=notices,
    )
