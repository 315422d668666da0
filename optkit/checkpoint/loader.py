"""Resolve a model source to (model in float32, tokenizer, provenance).

Sources, decided by what is on disk (never by file-name suffix alone):
- ``default``: the embedded SmolLM2-135M-Instruct (see :mod:`optkit.checkpoint.default`);
- a directory holding ``config.json`` and safetensors weights (pickle weights only with
  ``allow_pickle``, then ``weights_only=True``);
- a single GGUF file (magic bytes ``GGUF``), dequantized by transformers + gguf;
- otherwise a hub id (``org/name``), downloaded with huggingface_hub when online.
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from optkit.checkpoint.default import DEFAULT_MODEL_NAME, drop_gguf_marker, ensure_default_checkpoint
from optkit.checkpoint.files import check_safetensors, fingerprint_files, is_gguf, sha256_file
from optkit.errors import CheckpointError
from optkit.recipe import ModelConfig

PICKLE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class LoadedCheckpoint:
    """A model ready to quantize.

    Attributes:
        model: causal LM in float32, eval mode.
        tokenizer: its tokenizer.
        name: short name for default output paths.
        source: provenance recorded in the manifest (kind, path or id, revision).
        fingerprint: sha256 over the checkpoint's config and weight files (or the GGUF file).
        dtype: the checkpoint's own dtype ("bfloat16", ...), or None when it has none.
    """

    model: Any
    tokenizer: Any
    name: str
    source: dict = field(default_factory=dict)
    fingerprint: str = ""
    dtype: str | None = None


def _weight_files(d: Path) -> tuple[list[Path], list[Path]]:
    safetensors = sorted(d.glob("*.safetensors"))
    pickles = sorted(p for p in d.iterdir() if p.is_file() and p.suffix in PICKLE_WEIGHT_SUFFIXES)
    return safetensors, pickles


def _checkpoint_dtype(config: Any) -> str | None:
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if dt is None:
        return None
    return str(dt).removeprefix("torch.")


def _load_tokenizer(path: str, trust_remote_code: bool, **kw: Any) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kw)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot load a tokenizer: {err}", hint="a checkpoint needs its tokenizer files") from None


def load_hf_directory(d: Path, cfg: ModelConfig, source: dict | None = None, fingerprint: str | None = None) -> LoadedCheckpoint:
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (d / "config.json").is_file():
        raise CheckpointError(f"{d}: no config.json; not a Hugging Face model directory")
    safetensors, pickles = _weight_files(d)
    if not safetensors and not pickles:
        raise CheckpointError(
            f"{d}: no weight files (expected *.safetensors)", hint="point at the directory that holds the model's weights"
        )
    if not safetensors:
        if not cfg.allow_pickle:
            raise CheckpointError(
                f"{d}: holds only pickle weights ({', '.join(p.name for p in pickles)}); pickle files can run "
                "arbitrary code when loaded, so they are refused by default",
                hint="convert them to safetensors, or pass --allow-pickle (model.allow_pickle: true) to load "
                "them with torch.load(weights_only=True)",
            )
    for f in safetensors:
        check_safetensors(f)
    try:
        config = AutoConfig.from_pretrained(str(d), trust_remote_code=cfg.trust_remote_code)
    except ValueError as err:
        raise CheckpointError(f"{d}/config.json: {err}") from None
    if getattr(config, "quantization_config", None):
        method = config.quantization_config.get("quant_method", "?") if isinstance(config.quantization_config, dict) else "?"
        raise CheckpointError(
            f"{d}: the checkpoint is already quantized (quant_method {method!r}); start from a 16/32-bit checkpoint"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(d),
            config=config,
            dtype=torch.float32,
            trust_remote_code=cfg.trust_remote_code,
            use_safetensors=bool(safetensors),
            weights_only=True,
        )
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{d}: pickle weights hold more than tensors and were refused by torch.load(weights_only=True): "
            f"{str(err).splitlines()[0]}",
            hint="only load pickles from authors you trust; ask for a safetensors export",
        ) from None
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise CheckpointError(f"{d}: cannot load the model: {err}") from None
    model.eval()
    tokenizer = _load_tokenizer(str(d), cfg.trust_remote_code)
    files = [d / "config.json", *(safetensors or pickles)]
    return LoadedCheckpoint(
        model=model,
        tokenizer=tokenizer,
        name=d.name,
        source=source or {"kind": "directory", "path": str(d.resolve())},
        fingerprint=fingerprint or fingerprint_files(files, d),
        dtype=_checkpoint_dtype(config),
    )


def load_gguf(path: Path, cfg: ModelConfig) -> LoadedCheckpoint:
    import gguf
    from transformers import AutoModelForCausalLM

    try:
        reader = gguf.GGUFReader(str(path))
        field_ = reader.fields.get("general.architecture")
        arch = bytes(field_.parts[field_.data[0]]).decode() if field_ is not None else None
    except Exception as err:  # noqa: BLE001 - gguf raises bare ValueError/struct errors on bad files
        raise CheckpointError(f"{path}: not a readable GGUF file: {err}") from None
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:  # older transformers: let it decide below
        GGUF_SUPPORTED_ARCHITECTURES = None
    if arch is None:
        raise CheckpointError(f"{path}: GGUF file has no general.architecture field")
    if GGUF_SUPPORTED_ARCHITECTURES is not None and arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} is not supported by transformers' GGUF loader",
            hint="supported: " + ", ".join(sorted(GGUF_SUPPORTED_ARCHITECTURES)),
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise CheckpointError(f"{path}: cannot dequantize the GGUF model: {err}") from None
    drop_gguf_marker(model)
    model.eval()
    tokenizer = _load_tokenizer(str(path.parent), False, gguf_file=path.name)
    return LoadedCheckpoint(
        model=model,
        tokenizer=tokenizer,
        name=path.stem,
        source={"kind": "gguf", "path": str(path.resolve()), "architecture": arch},
        fingerprint=sha256_file(path),
        dtype=None,
    )


def download_hub(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"],
            )
        )
    except Exception as err:  # noqa: BLE001 - hub errors span requests/httpx/hub exception types
        raise CheckpointError(
            f"{repo_id!r} is not a local path, and downloading it from the hub failed: {type(err).__name__}: {err}",
            hint="check the path, or the network (hub ids need one)",
        ) from None


def load_checkpoint(cfg: ModelConfig) -> LoadedCheckpoint:
    src = cfg.source
    if src == "default":
        d, gguf_sha = ensure_default_checkpoint()
        ck = load_hf_directory(
            d,
            cfg,
            source={"kind": "default", "name": DEFAULT_MODEL_NAME, "gguf_sha256": gguf_sha},
            fingerprint=gguf_sha,
        )
        ck.name = DEFAULT_MODEL_NAME
        return ck
    path = Path(src).expanduser()
    if path.is_dir():
        return load_hf_directory(path, cfg)
    if path.is_file():
        if is_gguf(path):
            return load_gguf(path, cfg)
        if path.suffix in PICKLE_WEIGHT_SUFFIXES or path.suffix == ".safetensors":
            raise CheckpointError(
                f"{path}: a bare weight file has no config or tokenizer; pass the model directory that holds it"
            )
        raise CheckpointError(f"{path}: not a GGUF file (no GGUF magic bytes) and not a model directory")
    if _HUB_ID.match(src) and not src.startswith((".", "/", "~")):
        d = download_hub(src, cfg.revision)
        ck = load_hf_directory(d, cfg, source={"kind": "hub", "id": src, "revision": cfg.revision or "main"})
        ck.name = src.split("/")[-1]
        return ck
    raise CheckpointError(
        f"model {src!r} not found: no such file or directory",
        hint="pass 'default', a Hugging Face model directory, a .gguf file, or a hub id like org/name",
    )
