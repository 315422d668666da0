"""Recipe schema: one frozen config tree per run, recorded in the artifact.

Every field is documented where it is declared; those descriptions feed ``optkit schema``
(the JSON schema editors use to complete recipes). Unknown keys are errors, and every
error names the file, the dotted path of the field, the value and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from optkit.errors import RecipeError
from optkit.quantize.scheme import SUPPORTED_GROUP_SIZES, QuantScheme

RECIPE_VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelConfig(_Strict):
    """Which checkpoint to start from."""

    source: str = Field(
        "default",
        description=(
            "'default' (the embedded SmolLM2-135M-Instruct), a Hugging Face model directory, "
            "a single .gguf file, or a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct' "
            "(needs network access)."
        ),
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit); hub ids only.")
    trust_remote_code: bool = Field(
        False, description="Run model code shipped with the checkpoint. Off unless you trust its author."
    )
    allow_pickle: bool = Field(
        False,
        description=(
            "Accept pickle weight files (.bin/.pt/.pth). They are then loaded with "
            "torch.load(weights_only=True); safetensors is always preferred."
        ),
    )


class CalibrationConfig(_Strict):
    """Where calibration text comes from and how it is cut into token windows."""

    source: str = Field(
        "builtin",
        description=(
            "'builtin' (the project's varied set under calibration/builtin), a local .txt/.raw/.tokens, .jsonl "
            "or .parquet file, or 'hf:NAME' for a dataset loaded with datasets.load_dataset(NAME)."
        ),
    )
    dataset_config: str | None = Field(None, description="Dataset configuration name for 'hf:' sources.")
    split: str = Field("train", description="Dataset split for 'hf:' sources.")
    text_field: str = Field(
        "text", description="Column/key holding text in .jsonl, .parquet and datasets ('messages' is also read)."
    )
    num_samples: int = Field(128, ge=1, le=65536, description="Number of calibration windows.")
    seq_len: int = Field(512, ge=8, le=131072, description="Tokens per calibration window.")
    seed: int = Field(0, ge=0, description="Seed for document order and window choice.")
    batch_size: int = Field(
        8, ge=1, le=4096, description="Calibration windows run through a block at once (memory vs speed)."
    )
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description=(
            "dtype of the block forwards during layer-by-layer calibration. "
            "Weights, Hessians and the algorithms stay float32. 'auto': bfloat16 where the hardware has "
            "fast bfloat16 matmuls (CUDA, or CPUs with AVX512-BF16/AMX), else float32."
        ),
    )
    offload: bool = Field(
        False,
        description=(
            "Keep the block inputs of the layer-by-layer calibration on disk instead of in memory "
            "(for models whose activations do not fit in RAM)."
        ),
    )
    chat_template: Literal["auto", "on", "off"] = Field(
        "auto",
        description=(
            "Render conversation records ('messages') with the tokenizer's chat template: 'auto' uses it "
            "when the tokenizer has one, 'on' requires it, 'off' renders 'role: content' plain text."
        ),
    )


class GPTQConfig(_Strict):
    """GPTQ (Frantar et al., 2022): quantize columns in order, pushing each one's rounding error
    onto the columns not yet quantized through the inverse Hessian of the layer's inputs."""

    damp: float = Field(
        0.01, gt=0, le=1, description="Dampening added to the Hessian diagonal, as a fraction of its mean."
    )
    block_size: int = Field(128, ge=1, le=8192, description="Columns per lazy batch update.")
    act_order: bool = Field(
        True,
        description=(
            "Quantize columns in order of decreasing activation energy. Groups stay static (scales "
            "computed in the original column order), so the packed format and runtimes are unchanged."
        ),
    )
    true_sequential: bool = Field(
        True,
        description=(
            "Inside a block, quantize the linears in execution order, each calibrated on inputs that "
            "already went through the quantized linears before it."
        ),
    )
    refine_scales: bool = Field(
        True,
        description="After GPTQ, refit each group's scale by least squares on the calibration output error (codes fixed).",
    )
    error_correction: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "Asymmetric calibration (GPTAQ / QEP): fit each layer to the float model's output on the float "
            "model's inputs, not to its own float weights on the quantized model's inputs: W* = W + a W dX^T X' H'^-1. "
            "0 is plain GPTQ; 1 corrects the upstream error fully. Costs a second (float) stream of activations."
        ),
    )


class AWQConfig(_Strict):
    """AWQ (Lin et al., 2023): per-input-channel scales searched on a grid, folded into the
    preceding norm or linear so the float model is unchanged, plus a weight clipping search."""

    grid: int = Field(20, ge=2, le=200, description="Number of exponents alpha tried in s = mean|x|^alpha.")
    clip: bool = Field(True, description="Search a clipping ratio per group after scaling.")
    clip_grid: int = Field(20, ge=2, le=200, description="Clipping ratios tried between 1 and 1 - max_shrink.")
    max_shrink: float = Field(0.5, gt=0, lt=1, description="Largest fraction of the range clipping may cut.")


class SmoothQuantConfig(_Strict):
    """SmoothQuant (Xiao et al., 2022): divide activation channels by s and multiply the weights by s,
    s_j = max|X_j|^alpha / max|W_j|^(1-alpha), so int8 activations lose less to outliers."""

    alpha: float = Field(0.8, ge=0, le=1, description="Migration strength: 0 keeps activations, 1 moves all into weights.")


class LayerPrecision(_Strict):
    """A precision for every Linear whose name matches a pattern (first match wins)."""

    match: str = Field(description="Glob or 're:REGEX' of Linear module names.")
    precision: Literal["4bit", "8bit", "16bit"] = Field(
        description="'4bit' (the recipe's int4 group scheme), '8bit' (int8 per channel) or '16bit' (not quantized)."
    )


class MixedPrecisionConfig(_Strict):
    """Choose 4/8/16-bit per Linear from measured sensitivity to meet a budget."""

    bits_per_weight: float | None = Field(
        None,
        gt=0,
        le=16,
        description="Largest average bits per weight over the quantized Linear layers, scales and zero points included.",
    )
    max_kl: float | None = Field(
        None,
        ge=0,
        description=(
            "Largest predicted KL divergence (sum of the chosen layers' measured contributions); "
            "the smallest plan that meets it wins."
        ),
    )
    candidates: list[Literal["4bit", "8bit", "16bit"]] = Field(
        default_factory=lambda: ["4bit", "8bit", "16bit"], description="Precisions the plan may choose from."
    )
    num_samples: int = Field(4, ge=1, le=1024, description="Calibration windows used to measure sensitivity.")
    seq_len: int = Field(128, ge=8, le=131072, description="Tokens per sensitivity window (a prefix of each window).")
    measure: Literal["lowest", "all"] = Field(
        "lowest",
        description=(
            "'lowest': run each layer's lowest-bit option through the model and scale its KL by weight-error "
            "energy for the higher-bit options; 'all': run every option (twice the time with two options)."
        ),
    )

    @model_validator(mode="after")
    def _check_budget(self) -> MixedPrecisionConfig:
        if self.bits_per_weight is None and self.max_kl is None:
            raise ValueError("set bits_per_weight, max_kl, or both")
        if len(set(self.candidates)) < 2:
            raise ValueError("candidates needs at least two different precisions")
        return self


class QuantizationConfig(_Strict):
    """What to quantize and how."""

    scheme: Literal["w8a16", "w4a16", "w8a8"] = Field(
        "w4a16",
        description=(
            "Weight bits / activation bits: w8a16 and w4a16 are weight-only (activations stay 16-bit); "
            "w8a8 also quantizes every quantized Linear's input to int8, dynamically per token."
        ),
    )
    group_size: int | Literal["channel"] | None = Field(
        None,
        description=(
            f"Weights per scale along the input dimension: one of {list(SUPPORTED_GROUP_SIZES)}, or "
            "'channel' for one scale per output channel. Default: 'channel' for w8a16 and w8a8, 128 for w4a16."
        ),
    )
    symmetric: bool = Field(True, description="Symmetric (no zero point) or asymmetric (integer zero point).")
    algorithm: Literal["rtn", "gptq", "awq"] = Field(
        "rtn",
        description=(
            "How scales and rounding are chosen: 'rtn' round-to-nearest, 'gptq' error-compensating rounding "
            "with the inputs' Hessian, 'awq' activation-aware scaling and clipping, then round-to-nearest."
        ),
    )
    observer: Literal["auto", "minmax", "mse"] = Field(
        "auto",
        description=(
            "How each group's scale (and zero point) is chosen: 'minmax' covers the full range, 'mse' searches "
            "a clipping ratio that minimizes the rounding error (weighted by activation energy when "
            "'importance' is on). 'auto': mse for gptq, minmax otherwise."
        ),
    )
    importance: bool | None = Field(
        None,
        description=(
            "Weight the 'mse' observer's error by each input channel's activation energy (mean x^2 over the "
            "calibration tokens, llama.cpp's importance matrix). Needs a calibration pass. Default: on for "
            "gptq with the mse observer, off otherwise."
        ),
    )
    gptq: GPTQConfig = Field(default_factory=GPTQConfig, description="GPTQ settings (algorithm: gptq).")
    awq: AWQConfig = Field(default_factory=AWQConfig, description="AWQ settings (algorithm: awq).")
    smoothquant: SmoothQuantConfig | None = Field(
        None, description="Apply SmoothQuant before quantizing (scheme w8a8 only)."
    )
    layers: list[LayerPrecision] = Field(
        default_factory=list, description="Precision per Linear name pattern, overriding the scheme (first match wins)."
    )
    mixed_precision: MixedPrecisionConfig | None = Field(
        None, description="Choose each Linear's precision from measured sensitivity to meet a budget."
    )
    resume: bool = Field(
        True,
        description=(
            "Checkpoint the layer-by-layer calibration after each block and resume an interrupted run from "
            "the last finished block (after checking model, recipe and calibration fingerprints)."
        ),
    )
    include: list[str] = Field(
        default_factory=lambda: ["*"],
        description="Glob patterns (or 're:REGEX') of Linear module names to quantize.",
    )
    exclude: list[str] = Field(
        default_factory=list, description="Glob patterns (or 're:REGEX') of Linear module names to keep in 16-bit."
    )
    lm_head: Literal["16bit", "int8"] = Field(
        "16bit", description="Precision of the output projection (untied from the embeddings when int8)."
    )
    embeddings: Literal["16bit", "int8"] = Field(
        "16bit", description="Precision of the input embeddings (int8: one scale per vocabulary row)."
    )
    allow_skip: bool = Field(
        False,
        description=(
            "Keep a layer in 16-bit when its width does not fit the group size, instead of failing. "
            "Every skipped layer is listed in the summary and the manifest."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> QuantizationConfig:
        gs = self.group_size
        if isinstance(gs, int) and gs not in SUPPORTED_GROUP_SIZES:
            raise ValueError(
                f"group_size {gs} is not supported; allowed: {', '.join(map(str, SUPPORTED_GROUP_SIZES))} or 'channel'"
            )
        if self.scheme == "w8a8":
            if isinstance(gs, int):
                raise ValueError(f"scheme w8a8 quantizes weights per channel; group_size must be 'channel', got {gs}")
            if not self.symmetric:
                raise ValueError("scheme w8a8 needs symmetric weights (int8 GEMM kernels take no weight zero point)")
            if self.algorithm == "awq":
                raise ValueError("algorithm awq is for weight-only schemes; for w8a8 use smoothquant with rtn or gptq")
            bad = [lp.precision for lp in self.layers if lp.precision == "4bit"]
            if bad or (self.mixed_precision and "4bit" in self.mixed_precision.candidates):
                raise ValueError("scheme w8a8 cannot mix in 4bit layers; use precisions '8bit' and '16bit'")
        elif self.smoothquant is not None:
            raise ValueError(f"smoothquant applies to scheme w8a8 only (got scheme {self.scheme})")
        if self.importance and self.resolved_observer() != "mse":
            raise ValueError("importance weights the 'mse' observer; set observer: mse")
        return self

    def resolved_observer(self) -> str:
        """The observer 'auto' stands for: mse under GPTQ (measured better on every setting we ran), else minmax."""
        if self.observer != "auto":
            return self.observer
        return "mse" if self.algorithm == "gptq" else "minmax"

    def resolved_importance(self) -> bool:
        if self.importance is not None:
            return self.importance
        return self.algorithm == "gptq" and self.resolved_observer() == "mse"

    def weight_scheme(self) -> QuantScheme:
        """The scheme applied to the selected Linear layers."""
        bits = 4 if self.scheme == "w4a16" else 8
        gs = self.group_size
        if gs is None:
            gs = "channel" if bits == 8 else 128
        return QuantScheme(
            bits=bits,
            group_size=None if gs == "channel" else gs,
            symmetric=self.symmetric,
            act_bits=8 if self.scheme == "w8a8" else None,
        )

    def precision_scheme(self, precision: str) -> QuantScheme | None:
        """The scheme a per-layer precision stands for (None: 16-bit, left unquantized)."""
        if precision == "16bit":
            return None
        base = self.weight_scheme()
        if precision == "8bit":
            if base.bits == 8:
                return base
            return QuantScheme(bits=8, group_size=None, symmetric=True)
        if base.bits == 4:
            return base
        gs = self.group_size if isinstance(self.group_size, int) else 128
        return QuantScheme(bits=4, group_size=gs, symmetric=self.symmetric)

    def needs_calibration_pass(self) -> bool:
        """Whether the layer-by-layer calibration runs (anything beyond plain min/max RTN)."""
        return self.algorithm != "rtn" or self.smoothquant is not None or self.resolved_importance()


class ExportConfig(_Strict):
    """Where and how the artifact is written."""

    out: str | None = Field(
        None, description="Artifact directory. Default: artifacts/<model name>-<scheme>[-g<group>]."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="dtype of unquantized tensors and scales; 'auto' keeps a 16-bit checkpoint's dtype, else bfloat16.",
    )
    overwrite: bool = Field(False, description="Replace an existing artifact at 'out'.")
    max_shard_bytes: int = Field(
        5 * 1024**3, ge=1024, description="Largest safetensors shard; bigger artifacts are split with an index."
    )


class VariantConfig(_Strict):
    """One variant of a sign-off report: a quantization of the recipe's model, or the baseline."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Short unique name (also the artifact folder).")
    description: str | None = Field(None, description="Free text shown in the report.")
    quantization: QuantizationConfig | None = Field(
        None, description="How to quantize this variant; absent = the unquantized baseline (served from the checkpoint)."
    )


class EvalTextConfig(_Strict):
    """Text that perplexity and KL divergence are measured on (the same tokens for every variant)."""

    source: str = Field(
        ...,
        description="A local .txt/.raw/.jsonl/.parquet file or hf:DATASET; documents joined by blank lines, "
        "tokenized whole, no BOS. Never the calibration text.",
    )
    split: str = Field("test", description="Dataset split for 'hf:' sources.")
    text_field: str = Field("text", description="Text column/key for .jsonl, .parquet and 'hf:' sources.")
    seq_len: int = Field(512, ge=16, description="Tokens per window.")
    stride: int | None = Field(
        None, ge=1, description="Start a window every this many tokens (default seq_len: no overlap); "
        "with overlap each token is scored once, with seq_len - stride tokens of extra context.",
    )
    max_windows: int | None = Field(40, ge=1, description="Use at most this many windows (None: all).")

    @model_validator(mode="after")
    def _stride_fits(self) -> EvalTextConfig:
        if self.stride is not None and self.stride > self.seq_len:
            raise ValueError(f"stride {self.stride} is larger than seq_len {self.seq_len}; allowed: 1..seq_len")
        return self


class SpeedConfig(_Strict):
    """The runner's speed measurement per variant (a short optkit bench)."""

    prompt_lens: list[int] = Field([128, 512], min_length=1, description="Prompt lengths for TTFT.")
    batch_sizes: list[int] = Field([1, 8], min_length=1, description="Decode batch sizes; 1 must be among them.")
    decode_tokens: int = Field(32, ge=2, description="Tokens generated per request in the decode runs.")
    repeats: int = Field(3, ge=1, description="Timed repeats (after one warm-up).")
    compile: bool = Field(False, description="Compile the decode step (faster decode, about a minute per variant).")
    threads: int | None = Field(None, ge=1, description="CPU threads (default: torch's choice).")


class ReportConfig(_Strict):
    """The sign-off report: what is measured on every variant and the gates a release must pass."""

    eval: EvalTextConfig
    tasks: list[str] = Field(
        ["optkit-facts", "optkit-cloze"], description="Built-in task names or .jsonl paths (multiple choice by log-likelihood)."
    )
    max_task_items: int | None = Field(None, ge=1, description="Use at most this many items per task.")
    samples: list[str] = Field(
        ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):"],
        description="Prompts for side-by-side greedy samples.",
    )
    speed: SpeedConfig = Field(default_factory=SpeedConfig)
    memory_budget: str = Field("1GiB", description="Budget for the 'largest context that fits' figure (weights + KV), e.g. 1GiB.")
    gates: list[str] = Field([], description="Limits each variant must meet, e.g. 'kl_divergence <= 0.05'.")
    out: str | None = Field(None, description="Report directory (report.json, report.md, report.html). Default: reports/<name>.")

    @field_validator("memory_budget")
    @classmethod
    def _budget_in_bytes(cls, v: str) -> str:  # a fraction of free memory means nothing in a report
        from optkit.errors import UserError
        from optkit.serve.engine import parse_memory

        try:
            size = parse_memory(v, 0)
        except UserError:
            size = 0
        if size <= 0:
            raise ValueError(f"memory_budget {v!r} must be a size with a unit, e.g. 512MiB or 2GiB (not a fraction)")
        return v

    @field_validator("gates", mode="before")
    @classmethod
    def _gates(cls, v: Any) -> Any:  # canonical text; an unknown metric is a recipe error before any work
        from optkit.report.gates import validate_gates

        return [g.text for g in validate_gates(v or [])]


class Recipe(_Strict):
    """A full quantization run, or with ``variants`` and ``report``, a sign-off of several."""

    version: Literal[1] = Field(RECIPE_VERSION, description="Recipe format version.")
    name: str | None = Field(None, description="Free-form name, recorded in the manifest.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    variants: list[VariantConfig] = Field(
        [], description="Sign-off: build and evaluate each variant (one without quantization is the baseline)."
    )
    report: ReportConfig | None = Field(None, description="Sign-off report settings (needed with variants).")

    @model_validator(mode="after")
    def _check_signoff(self) -> Recipe:
        if not self.variants and self.report is None:
            return self
        if not self.variants or self.report is None:
            raise ValueError("'variants' and 'report' go together: a sign-off needs both")
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"variant names must be unique, got {names}")
        baselines = [v.name for v in self.variants if v.quantization is None]
        if len(baselines) != 1:
            raise ValueError(f"exactly one variant must have no 'quantization' (the baseline); found {baselines or 'none'}")
        if 1 not in self.report.speed.batch_sizes:
            raise ValueError("report.speed.batch_sizes must include 1 (decode_speedup is measured at batch 1)")
        return self


# --------------------------------------------------------------------------- loading


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of silently keeping the last one."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def format_validation_error(err: ValidationError, where: str) -> str:
    """One line per problem: ``where: dotted.path: message (got: value)``."""
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<top level>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key; allowed keys here: " + ", ".join(_allowed_keys(e["loc"][:-1]))
        got = e.get("input")
        got_s = "" if e["type"] == "extra_forbidden" or isinstance(got, dict) else f" (got: {got!r})"
        lines.append(f"{where}: {path}: {msg}{got_s}")
    return "\n".join(lines)


def _allowed_keys(loc: tuple) -> list[str]:
    model: type[BaseModel] = Recipe
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return sorted(model.model_fields)


def recipe_from_dict(data: Any, where: str = "<recipe>") -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe must be a mapping of keys to values, got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(format_validation_error(err, where)) from None


def load_recipe(path: str | Path) -> Recipe:
    """Parse and validate a recipe YAML file; every failure is a :class:`RecipeError`."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"recipe file not found: {p}")
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 - safe loader subclass
    except yaml.YAMLError as err:
        raise RecipeError(f"{p}: not valid YAML: {err}") from None
    except UnicodeDecodeError as err:
        raise RecipeError(f"{p}: not UTF-8 text: {err}") from None
    return recipe_from_dict(data, str(p))


def recipe_json_schema() -> dict:
    schema = Recipe.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "optkit recipe"
    return schema
