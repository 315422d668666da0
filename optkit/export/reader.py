"""Artifact reader: version-checked manifest, hash verification, integer weights back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from optkit import ARTIFACT_FORMAT_VERSION
from optkit.checkpoint.files import sha256_file
from optkit.errors import ArtifactError
from optkit.export.compressed import STORED_SUFFIXES, unpack_weight
from optkit.quantize.modules import QuantizedLinear
from optkit.quantize.plan import output_head_name
from optkit.quantize.rtn import QuantizedWeight
from optkit.quantize.scheme import QuantScheme

MANIFEST = "optkit.json"


def read_manifest(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_dir():
        raise ArtifactError(f"{p}: not an artifact directory (does not exist or is a file)")
    mf = p / MANIFEST
    if not mf.is_file():
        raise ArtifactError(f"{p}: no {MANIFEST}; not an optkit artifact")
    try:
        manifest = json.loads(mf.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ArtifactError(f"{mf}: corrupt manifest: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "optkit-artifact":
        raise ArtifactError(f"{mf}: not an optkit artifact manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > ARTIFACT_FORMAT_VERSION:
        raise ArtifactError(
            f"{mf}: artifact format version {version!r} is newer than this optkit reads "
            f"(up to {ARTIFACT_FORMAT_VERSION})",
            hint="upgrade optkit",
        )
    return manifest


def verify_artifact(path: str | Path) -> list[str]:
    """Re-hash every file against the manifest; returns one line per problem (empty = intact)."""
    p = Path(path)
    manifest = read_manifest(p)
    problems = []
    listed = manifest.get("files", {})
    for name, info in sorted(listed.items()):
        f = p / name
        if Path(name).name != name or name in (".", ".."):
            problems.append(f"{name}: not a plain file name inside the artifact (manifest tampered)")
        elif not f.is_file():
            problems.append(f"{name}: missing")
        elif f.stat().st_size != info["bytes"]:
            problems.append(f"{name}: size {f.stat().st_size} bytes, manifest says {info['bytes']}")
        elif sha256_file(f) != info["sha256"]:
            problems.append(f"{name}: sha256 differs from the manifest (file was modified)")
    for f in sorted(p.iterdir()):
        if f.name != MANIFEST and f.name not in listed:
            problems.append(f"{f.name}: not listed in the manifest")
    return problems


def _load_tensors(p: Path, manifest: dict) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(manifest.get("files", {})):
        if name.endswith(".safetensors"):
            tensors.update(load_file(str(p / name)))
    return tensors


def scheme_from_manifest(d: dict) -> QuantScheme:
    """The QuantScheme of one ``layers.quantized`` manifest entry."""
    return QuantScheme(bits=d["bits"], group_size=d["group_size"], symmetric=d["symmetric"], act_bits=d.get("act_bits"))


def load_quantized_weights(path: str | Path) -> dict[str, QuantizedWeight]:
    """Module name -> integer codes, scales and zero points exactly as stored."""
    p = Path(path)
    manifest = read_manifest(p)
    tensors = _load_tensors(p, manifest)
    return {
        name: unpack_weight(tensors, f"{name}.", scheme_from_manifest(info))
        for name, info in manifest["layers"]["quantized"].items()
    }


def load_dequantized_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """optkit's own reading of an artifact: quantized weights dequantized by the reference
    ``dequantize()``, loaded into the plain transformers model class."""
    from transformers import AutoConfig, AutoModelForCausalLM

    p = Path(path)
    manifest = read_manifest(p)
    config = AutoConfig.from_pretrained(str(p))
    config.quantization_config = None
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = _load_tensors(p, manifest)
    state: dict[str, torch.Tensor] = {}
    act_quant: dict[str, QuantizedWeight] = {}
    for name, info in manifest["layers"]["quantized"].items():
        qw = unpack_weight(tensors, f"{name}.", scheme_from_manifest(info))
        state[f"{name}.weight"] = qw.dequantize(dtype)
        if qw.scheme.act_bits is not None:
            act_quant[name] = qw
        for suffix in STORED_SUFFIXES:
            tensors.pop(f"{name}.{suffix}", None)
    state.update({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        head = output_head_name(model)
        missing = [k for k in missing if k != f"{head}.weight"]
    if missing or unexpected:
        raise ArtifactError(f"{p}: weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, qw in act_quant.items():  # W8A8: the reference module also quantizes its input per token
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantizedLinear(qw, getattr(parent, child).bias))
    return model.eval()
