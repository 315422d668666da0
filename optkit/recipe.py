"""Recipe schema: one frozen config tree per run, recorded in the artifact.

Every field is documented where it is declared; those descriptions feed ``optkit schema``
(the JSON schema editors use to complete recipes). Unknown keys are errors, and every
error names the file, the dotted path of the field, the value and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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
            "'builtin' (the project's varied set under calibration/builtin), a local .txt, .jsonl "
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
    chat_template: Literal["auto", "on", "off"] = Field(
        "auto",
        description=(
            "Render conversation records ('messages') with the tokenizer's chat template: 'auto' uses it "
            "when the tokenizer has one, 'on' requires it, 'off' renders 'role: content' plain text."
        ),
    )


class QuantizationConfig(_Strict):
    """What to quantize and how."""

    scheme: Literal["w8a16", "w4a16"] = Field(
        "w4a16", description="Weight bits / activation bits. Activations stay in 16-bit for both."
    )
    group_size: int | Literal["channel"] | None = Field(
        None,
        description=(
            f"Weights per scale along the input dimension: one of {list(SUPPORTED_GROUP_SIZES)}, or "
            "'channel' for one scale per output channel. Default: 'channel' for w8a16, 128 for w4a16."
        ),
    )
    symmetric: bool = Field(True, description="Symmetric (no zero point) or asymmetric (integer zero point).")
    algorithm: Literal["rtn"] = Field("rtn", description="How scales and rounding are chosen: round-to-nearest.")
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
    def _check_group_size(self) -> QuantizationConfig:
        gs = self.group_size
        if isinstance(gs, int) and gs not in SUPPORTED_GROUP_SIZES:
            raise ValueError(
                f"group_size {gs} is not supported; allowed: {', '.join(map(str, SUPPORTED_GROUP_SIZES))} or 'channel'"
            )
        return self

    def weight_scheme(self) -> QuantScheme:
        """The scheme applied to the selected Linear layers."""
        bits = 8 if self.scheme == "w8a16" else 4
        gs = self.group_size
        if gs is None:
            gs = "channel" if bits == 8 else 128
        return QuantScheme(bits=bits, group_size=None if gs == "channel" else gs, symmetric=self.symmetric)


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


class Recipe(_Strict):
    """A full quantization run."""

    version: Literal[1] = Field(RECIPE_VERSION, description="Recipe format version.")
    name: str | None = Field(None, description="Free-form name, recorded in the manifest.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)


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
