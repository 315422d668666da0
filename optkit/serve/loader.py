"""What the engine can serve, read without the calibration/quantization internals (DESIGN: serve
imports the artifact reader and kernels only).

- an optkit artifact directory (``optkit.json``): integer codes straight from the packed tensors;
- a Hugging Face checkpoint directory, or ``default`` (the embedded SmolLM2): float weights;
- anything else the checkpoint loader accepts (a GGUF file, a hub id when online): float weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from optkit.errors import CheckpointError
from optkit.export.compressed import STORED_SUFFIXES, unpack_weight
from optkit.export.reader import MANIFEST, read_manifest, scheme_from_manifest
from optkit.quantize.rtn import QuantizedWeight


@dataclass
class ModelSource:
    """Everything needed to build an executor: config, weights by transformers name, tokenizer."""

    config: Any
    weights: dict[str, torch.Tensor | QuantizedWeight]
    tokenizer: Any
    kind: str  # "artifact" | "checkpoint" | "synthetic"
    path: str
    schemes: dict[str, int] = field(default_factory=dict)  # scheme label -> number of layers
    synthetic: bool = False


def _tokenizer(path: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot load a tokenizer: {err}") from None


def _safetensors(d: Path) -> dict[str, torch.Tensor]:
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{d}: no .safetensors weights", hint="the runner reads safetensors only (no pickle)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def load_artifact(path: Path, trust_remote_code: bool = False) -> ModelSource:
    from transformers import AutoConfig

    manifest = read_manifest(path)
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the executor reads the codes itself
    tensors = _safetensors(path)
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    schemes: dict[str, int] = {}
    for name, info in manifest["layers"]["quantized"].items():
        scheme = scheme_from_manifest(info)
        qw = unpack_weight(tensors, f"{name}.", scheme)
        for suffix in STORED_SUFFIXES:
            tensors.pop(f"{name}.{suffix}", None)
        weights[f"{name}.weight"] = qw
        schemes[scheme.label()] = schemes.get(scheme.label(), 0) + 1
    weights.update(tensors)
    return ModelSource(config, weights, _tokenizer(str(path), trust_remote_code), "artifact", str(path), schemes)


def load_checkpoint_dir(path: Path, trust_remote_code: bool = False) -> ModelSource:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    weights = dict(_safetensors(path))
    return ModelSource(config, weights, _tokenizer(str(path), trust_remote_code), "checkpoint", str(path))


def load_source(path: str, trust_remote_code: bool = False) -> ModelSource:
    """Resolve MODEL for ``optkit bench`` / ``optkit serve``."""
    if path == "default":
        from optkit.checkpoint.default import ensure_default_checkpoint

        d, _ = ensure_default_checkpoint()
        src = load_checkpoint_dir(d)
        src.path = "default"
        return src
    p = Path(path)
    if p.is_dir() and (p / MANIFEST).is_file():
        return load_artifact(p, trust_remote_code)
    if p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        return load_checkpoint_dir(p, trust_remote_code)
    from optkit.checkpoint.loader import load_checkpoint
    from optkit.recipe import ModelConfig

    loaded = load_checkpoint(ModelConfig(source=path, trust_remote_code=trust_remote_code))
    weights = dict(loaded.model.state_dict())
    if getattr(loaded.model.config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)
    return ModelSource(loaded.model.config, weights, loaded.tokenizer, "checkpoint", path)


def source_from_model(model: Any, tokenizer: Any, path: str = "in-memory") -> ModelSource:
    """Serve a transformers model already in memory (tests, notebooks): float weights."""
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    if not getattr(model.config, "architectures", None):  # models built in code carry no architectures list
        model.config.architectures = [type(model).__name__]
    if getattr(model.config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)
    return ModelSource(model.config, weights, tokenizer, "checkpoint", path)
