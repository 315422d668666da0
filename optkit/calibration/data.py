"""Calibration text -> token windows ``(num_samples, seq_len)``, deterministically.

Steps: read documents (plain text, or conversations rendered with the chat template),
shuffle their order with ``seed``, tokenize each and join them with the EOS token into one
stream, cut the stream into non-overlapping windows of ``seq_len`` and pick ``num_samples``
of them with the same seed. The same inputs always give the same token ids, and the
fingerprint (sha256 of the ids) is written into the artifact's manifest.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from optkit.errors import CalibrationError
from optkit.recipe import CalibrationConfig

Document = str | list  # plain text, or a list of {"role", "content"} messages
#: Plain text: ``.txt``, and WikiText's own ``.raw`` / ``.tokens`` files (one document per file).
TEXT_SUFFIXES = (".txt", ".raw", ".tokens")
LOCAL_SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")


@dataclass(frozen=True)
class CalibrationSet:
    """Token windows and their provenance.

    Attributes:
        input_ids: int64 ``(num_samples, seq_len)``.
        fingerprint: sha256 of the ids and their shape.
        info: source, documents read, tokens available, chat-template use.
    """

    input_ids: torch.Tensor
    fingerprint: str
    info: dict = field(default_factory=dict)


def builtin_dir() -> Path:
    """The builtin set: inside the package in a wheel, at the repository top level in a checkout."""
    packaged = Path(__file__).resolve().parent / "builtin"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "calibration" / "builtin"


def _record_to_doc(rec: Any, where: str, text_field: str) -> Document:
    if isinstance(rec, dict):
        msgs = rec.get("messages")
        if isinstance(msgs, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            return msgs
        text = rec.get(text_field)
        if isinstance(text, str):
            return text
        keys = ", ".join(map(str, rec)) or "none"
        raise CalibrationError(
            f"{where}: record has no string {text_field!r} field and no 'messages' list (keys: {keys})",
            hint="set calibration.text_field to the key that holds the text",
        )
    raise CalibrationError(f"{where}: expected a JSON object per line, got {type(rec).__name__}")


def _read_jsonl(path: Path, text_field: str) -> Iterator[Document]:
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise CalibrationError(f"{path}:{i}: not valid JSON: {err}") from None
            yield _record_to_doc(rec, f"{path}:{i}", text_field)


def _read_table(rows: Iterable[dict], where: str, text_field: str) -> Iterator[Document]:
    for i, row in enumerate(rows):
        yield _record_to_doc(row, f"{where} row {i}", text_field)


def read_documents(cfg: CalibrationConfig) -> tuple[list[Document], str]:
    """Documents in source order, and a description of the source."""
    src = cfg.source
    if src == "builtin":
        d = builtin_dir()
        files = sorted(d.glob("*.jsonl"))
        if not files:
            raise CalibrationError(f"the builtin calibration set is missing (looked in {d})")
        return [doc for f in files for doc in _read_jsonl(f, "text")], "builtin"
    if src.startswith("hf:"):
        return _read_hf(cfg), src
    path = Path(src).expanduser()
    if not path.is_file():
        raise CalibrationError(
            f"calibration source {src!r} not found",
            hint="use 'builtin', a local .txt/.raw/.tokens/.jsonl/.parquet file, or 'hf:DATASET'",
        )
    try:
        if path.suffix in TEXT_SUFFIXES:
            return [path.read_text(encoding="utf-8")], str(path)
        if path.suffix == ".jsonl":
            return list(_read_jsonl(path, cfg.text_field)), str(path)
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                table = pq.read_table(path)
            except Exception as err:  # noqa: BLE001 - pyarrow raises several unrelated types
                raise CalibrationError(f"{path}: cannot read parquet: {err}") from None
            return list(_read_table(table.to_pylist(), str(path), cfg.text_field)), str(path)
    except UnicodeDecodeError as err:
        raise CalibrationError(f"{path}: not UTF-8 text: {err}") from None
    raise CalibrationError(f"{path}: unsupported calibration file type {path.suffix!r}; allowed: {', '.join(LOCAL_SUFFIXES)}")


def _read_hf(cfg: CalibrationConfig) -> list[Document]:
    import datasets

    name = cfg.source[3:]
    try:
        ds = datasets.load_dataset(name, cfg.dataset_config, split=cfg.split)
    except Exception as err:  # noqa: BLE001 - datasets/hub raise many types; all mean "cannot load"
        raise CalibrationError(f"cannot load dataset {name!r} (split {cfg.split!r}): {type(err).__name__}: {err}") from None
    cols = set(ds.column_names)
    if cfg.text_field not in cols and "messages" not in cols:
        raise CalibrationError(
            f"dataset {name!r} has no {cfg.text_field!r} or 'messages' column (columns: {', '.join(sorted(cols))})",
            hint="set calibration.text_field",
        )
    return list(_read_table(ds, f"dataset {name!r}", cfg.text_field))


def _render(doc: Document, tokenizer: Any, use_template: bool) -> str:
    if isinstance(doc, str):
        return doc
    if use_template:
        return tokenizer.apply_chat_template(doc, tokenize=False)
    return "\n".join(f"{m['role']}: {m['content']}" for m in doc)


def fingerprint_tokens(ids: torch.Tensor) -> str:
    h = hashlib.sha256(b"optkit-calibration-v1")
    h.update(json.dumps(list(ids.shape)).encode())
    h.update(ids.to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


def build_calibration(cfg: CalibrationConfig, tokenizer: Any) -> CalibrationSet:
    docs, source = read_documents(cfg)
    if not docs:
        raise CalibrationError(f"calibration source {source!r} holds no documents")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if cfg.chat_template == "on" and not has_template:
        raise CalibrationError(
            "calibration.chat_template is 'on' but the tokenizer has no chat template",
            hint="use 'auto' or 'off'",
        )
    use_template = cfg.chat_template == "on" or (cfg.chat_template == "auto" and has_template)

    rng = random.Random(cfg.seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for i in order:
        stream.extend(tokenizer(_render(docs[i], tokenizer, use_template), add_special_tokens=False)["input_ids"])
        stream.extend(sep)

    n_windows = len(stream) // cfg.seq_len
    if n_windows < cfg.num_samples:
        raise CalibrationError(
            f"calibration source {source!r} holds {len(stream)} tokens: {n_windows} windows of {cfg.seq_len}, "
            f"fewer than num_samples={cfg.num_samples}",
            hint="lower calibration.num_samples or calibration.seq_len, or add text",
        )
    picks = sorted(rng.sample(range(n_windows), cfg.num_samples))
    ids = torch.tensor([stream[p * cfg.seq_len : (p + 1) * cfg.seq_len] for p in picks], dtype=torch.int64)
    n_conv = sum(1 for d in docs if not isinstance(d, str))
    info = {
        "source": source,
        "documents": len(docs),
        "conversations": n_conv,
        "chat_template": use_template and n_conv > 0,
        "tokens_available": len(stream),
        "num_samples": cfg.num_samples,
        "seq_len": cfg.seq_len,
        "seed": cfg.seed,
    }
    return CalibrationSet(ids, fingerprint_tokens(ids), info)
