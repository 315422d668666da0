"""Atomic artifact writer.

Everything is written into a temporary directory beside the target and renamed into place
at the end, so an interrupted or failed run never leaves a half artifact at the target.

Layout::

    config.json                  model config + compressed-tensors quantization_config
    generation_config.json
    model.safetensors            (or model-0000k-of-0000n.safetensors + index)
    tokenizer files
    optkit.json                  manifest: recipe, fingerprints, versions, per-layer schemes, sha256 of every file
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from optkit import ARTIFACT_FORMAT_VERSION, __version__
from optkit.checkpoint.files import sha256_file
from optkit.errors import ArtifactError
from optkit.export.compressed import FORMAT, format_of, pack_weight, quantization_config
from optkit.quantize.modules import QuantizedEmbedding, QuantizedLinear
from optkit.quantize.plan import LayerPlan, output_head_name, runtime_notes
from optkit.quantize.scheme import QuantScheme

MANIFEST = "optkit.json"
_VERSIONED_PACKAGES = ("torch", "transformers", "compressed-tensors", "safetensors", "tokenizers")
_Q_BUFFERS = ("qweight", "weight_scale", "weight_zero_point", "weight")


@dataclass(frozen=True)
class ArtifactInfo:
    path: Path
    files: dict[str, dict]
    total_bytes: int
    weight_bytes: int


def package_versions() -> dict[str, str]:
    out = {"optkit": __version__}
    for name in _VERSIONED_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def plan_manifest(plan: LayerPlan) -> dict:
    """Per-module schemes as the reader and the runner consume them (the config's
    ``quantization_config`` says the same for external runtimes)."""

    def scheme(s: QuantScheme, kind: str) -> dict:
        return {"kind": kind, "bits": s.bits, "group_size": s.group_size, "symmetric": s.symmetric, "act_bits": s.act_bits}

    return {
        "quantized": {
            **{n: scheme(s, "linear") for n, s in sorted(plan.linears.items())},
            **{n: scheme(s, "embedding") for n, s in sorted(plan.embeddings.items())},
        },
        "skipped": dict(sorted(plan.skipped.items())),
        "excluded": sorted(plan.excluded),
        "runtime_notes": runtime_notes(plan),
    }


def build_state_dict(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint tensors: packed integers for quantized modules, ``dtype`` for the rest."""
    sd = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))}
    for name, module in quantized.items():
        out.update(pack_weight(module.quantized_weight(), f"{name}."))
    q_keys = {f"{n}.{b}" for n in quantized for b in _Q_BUFFERS}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    head_name = output_head_name(model)
    for k, v in sd.items():
        if k in q_keys or k in out:
            continue
        if tied and head_name is not None and k == f"{head_name}.weight":
            continue  # tied to the input embeddings; runtimes re-tie on load
        out[k] = v.to(dtype) if v.is_floating_point() else v
    # safetensors refuses shared storage and non-contiguous views: give every tensor its own.
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def _shards(sd: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(sd):
        nbytes = sd[k].numel() * sd[k].element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = sd[k]
        size += nbytes
    return shards


def _write_weights(sd: dict[str, torch.Tensor], d: Path, max_bytes: int) -> list[str]:
    shards = _shards(sd, max_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(d / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(d / name), metadata={"format": "pt"})
        names.append(name)
        weight_map.update({k: name for k in shard})
    total = sum(v.numel() * v.element_size() for v in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def _write_config(model: nn.Module, plan: LayerPlan, dtype: torch.dtype, d: Path, actorder: bool) -> None:
    config = copy.deepcopy(model.config)
    groups: dict[QuantScheme, list[str]] = defaultdict(list)
    for name, scheme in {**plan.linears, **plan.embeddings}.items():
        groups[scheme].append(name)
    linear_names = {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, QuantizedLinear))}
    ignore = [n for n in linear_names if n not in plan.linears]
    config.quantization_config = quantization_config(dict(groups), ignore, linear_names, actorder=actorder)
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    config.save_pretrained(str(d))


def write_artifact(
    model: nn.Module,
    tokenizer: Any,
    plan: LayerPlan,
    out: Path,
    *,
    dtype: torch.dtype,
    manifest: dict,
    overwrite: bool = False,
    max_shard_bytes: int = 5 * 1024**3,
    actorder: bool = False,
) -> ArtifactInfo:
    """Write the artifact for an already-quantized ``model`` atomically at ``out``."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise ArtifactError(f"output path {out} already exists", hint="choose another --out or pass --overwrite")
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"output path {out} exists and is not a directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as err:
        raise ArtifactError(f"cannot create the output directory next to {out}: {err}") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; an artifact is meant to be shared
        weight_files = _write_weights(build_state_dict(model, dtype), tmp, max_shard_bytes)
        _write_config(model, plan, dtype, tmp, actorder)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        for f in tmp.iterdir():  # safetensors writes 0600; keep the user's umask for every file
            os.chmod(f, 0o666 & ~umask)
        files = {
            p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in sorted(tmp.iterdir())
            if p.is_file()
        }
        formats = {format_of(s) for s in [*plan.linears.values(), *plan.embeddings.values()]}
        full = {
            "format": "optkit-artifact",
            "format_version": ARTIFACT_FORMAT_VERSION,
            "packages": package_versions(),
            "weights_format": "compressed-tensors/" + ("+".join(sorted(formats)) or FORMAT),
            **manifest,
            "layers": plan_manifest(plan),
            "files": files,
        }
        (tmp / MANIFEST).write_text(json.dumps(full, indent=2, sort_keys=True) + "\n")
        manifest_bytes = (tmp / MANIFEST).stat().st_size
        _move_into_place(tmp, out, overwrite)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):
            raise ArtifactError(f"writing the artifact failed, nothing was written to {out}: {err}") from err
        raise
    weight_bytes = sum(files[n]["bytes"] for n in weight_files)
    return ArtifactInfo(out, files, manifest_bytes + sum(f["bytes"] for f in files.values()), weight_bytes)


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    if not out.exists():
        tmp.rename(out)
        return
    if not overwrite:  # appeared while we were writing
        raise ArtifactError(f"output path {out} appeared while the artifact was being written")
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old.rmdir()
    out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        old.rename(out)  # put the previous artifact back
        raise
    shutil.rmtree(old, ignore_errors=True)
