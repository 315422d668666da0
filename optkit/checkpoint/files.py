"""File-level checks and fingerprints, decided by content (magic bytes), not by name."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from optkit.errors import CheckpointError

GGUF_MAGIC = b"GGUF"
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fingerprint_files(files: list[Path], root: Path) -> str:
    """sha256 over (relative name, sha256 of content) of every file, in name order."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(b"\0")
        h.update(sha256_file(f).encode())
        h.update(b"\n")
    return h.hexdigest()


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def check_safetensors(path: Path) -> None:
    """Cheap integrity check: the header parses and the file holds every byte it declares.

    Catches truncated downloads and files that are not safetensors at all, without reading
    the tensors. (A flipped bit inside tensor data needs a hash to be caught.)
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 * 1024**2:
            raise CheckpointError(f"{path}: corrupt or truncated safetensors file (header length {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path}: corrupt safetensors header: {err}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {name!r}") from None
    if 8 + n + end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file: tensors need {8 + n + end} bytes, the file has {size}",
            hint="download or copy the checkpoint again",
        )
