"""run_recipe(recipe) -> QuantizeResult: each stage in order, with explicit values.

checkpoint -> calibration tokens -> layer plan -> quantize -> export (atomic) -> summary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from optkit.calibration import build_calibration
from optkit.checkpoint import load_checkpoint
from optkit.checkpoint.default import DEFAULT_MODEL_NAME
from optkit.errors import ArtifactError
from optkit.export import ArtifactInfo, write_artifact
from optkit.progress import Reporter
from optkit.quantize.plan import LayerPlan, apply_plan, plan_layers, runtime_notes
from optkit.quantize.scheme import QuantScheme
from optkit.recipe import Recipe

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
        }


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
    return Path("artifacts") / re.sub(r"[^\w.-]+", "_", "-".join(parts))


def export_dtype(choice: str, checkpoint_dtype: str | None) -> torch.dtype:
    """'auto' keeps a 16-bit checkpoint's dtype; a 32-bit (or unknown) one is stored as bfloat16."""
    if choice != "auto":
        return _DTYPES[choice]
    if checkpoint_dtype in ("bfloat16", "float16"):
        return _DTYPES[checkpoint_dtype]
    return torch.bfloat16


def run_recipe(recipe: Recipe, reporter: Reporter | None = None) -> QuantizeResult:
    reporter = reporter or Reporter()
    out = Path(recipe.export.out) if recipe.export.out else default_out(recipe)
    # Fail before any work when the target is taken (the writer checks again at the end).
    if out.exists() and not recipe.export.overwrite:
        raise ArtifactError(f"output path {out} already exists", hint="choose another --out or pass --overwrite")

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

    n_layers = len(plan.linears) + len(plan.embeddings)
    with reporter.stage("quantize", f"Quantizing {n_layers} layers ({scheme.label()}, {q.algorithm})", total=n_layers) as advance:
        with torch.no_grad():
            apply_plan(model, plan, dtype, on_layer=lambda _name: advance())

    manifest = {
        "recipe": recipe.model_dump(mode="json"),
        "source": ck.source,
        "source_fingerprint": ck.fingerprint,
        "calibration": calibration,
        "algorithm": q.algorithm,
        "dtype": dtype_name,
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
        )
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
    )
