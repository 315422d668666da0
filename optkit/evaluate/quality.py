"""Quality of a (quantized) causal LM: perplexity on held-out text, and how far its next-token
distributions move from a reference model's (KL divergence, top-1 agreement).

Protocol (see ``../shared/data/README.md``): tokenize the whole text with the model's tokenizer,
no BOS or other special tokens added; cut it into non-overlapping windows of ``seq_len`` tokens
(the incomplete tail is dropped); in each window the logits at positions ``0..L-2`` predict
tokens ``1..L-1``, so every token but the first of each window is scored.

The reference model's log-probabilities are computed once (:meth:`ReferenceLogits.compute`)
and kept as float16 in a memory-mapped file on disk, so many quantized models can be compared
with it without holding ``positions x vocab`` float32 logits in memory.
"""

from __future__ import annotations

import errno
import math
import shutil
import tempfile
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from optkit.errors import CalibrationError

REFERENCE_FILE = "reference-logprobs.f16"


@dataclass
class QualityResult:
    """Scores of one model on one set of windows.

    Attributes:
        perplexity: exp(nll).
        nll: mean negative log-likelihood (nats) over the scored tokens.
        tokens_scored: windows x (seq_len - 1).
        windows: number of windows.
        seq_len: tokens per window.
        kl_divergence: mean KL(P_ref || P_model) in nats over the same positions (with a reference).
        top1_agreement: fraction of positions whose argmax equals the reference's (with a reference).
    """

    perplexity: float
    nll: float
    tokens_scored: int
    windows: int
    seq_len: int
    kl_divergence: float | None = None
    top1_agreement: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


def load_text_tokens(path: str | Path, tokenizer: Any) -> torch.Tensor:
    """The whole UTF-8 file as one token stream, no BOS/special tokens added: LongTensor (T,)."""
    p = Path(path)
    if not p.is_file():
        raise CalibrationError(f"evaluation text {p} not found", hint="pass an existing UTF-8 text file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise CalibrationError(f"{p}: not UTF-8 text: {err}") from None
    # verbose=False: a long text is expected here, not a too-long model input
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)  # (T,)


def make_windows(
    ids: torch.Tensor, seq_len: int = 512, max_windows: int | None = None, stride: int | None = None
) -> torch.Tensor:
    """Windows of ``seq_len`` tokens starting every ``stride`` tokens (default ``seq_len``:
    non-overlapping), the incomplete tail dropped, at most ``max_windows`` of them (the first
    ones): LongTensor (W, seq_len). With overlap, :func:`evaluate` given the same ``stride``
    scores each token once: every window after the first only scores its last ``stride``
    targets, the tokens before them are context (the sliding-window perplexity of transformers'
    docs, which gives each scored token ``seq_len - stride`` tokens of history)."""
    if ids.dim() != 1:
        raise ValueError(f"expected a 1-D token stream, got shape {tuple(ids.shape)}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2 (one token to condition on, one to score), got {seq_len}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be at least 1, got {max_windows}")
    stride = seq_len if stride is None else stride
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride must be in [1, seq_len={seq_len}], got {stride}")
    n = 0 if ids.numel() < seq_len else (ids.numel() - seq_len) // stride + 1
    if n == 0:
        raise CalibrationError(
            f"the evaluation text holds {ids.numel()} tokens, fewer than one window of {seq_len}",
            hint="use a longer text or a shorter window",
        )
    if max_windows is not None:
        n = min(n, max_windows)
    if stride == seq_len:
        return ids[: n * seq_len].reshape(n, seq_len).clone()  # (W, L)
    return torch.stack([ids[i * stride : i * stride + seq_len] for i in range(n)])  # (W, L)


def _scored(n_windows: int, seq_len: int, stride: int | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """bool (W, L-1): which targets count. All of the first window's; the last ``stride`` of the others."""
    mask = torch.ones(n_windows, seq_len - 1, dtype=torch.bool, device=device)
    if stride is not None and stride < seq_len:
        mask[1:, : seq_len - 1 - stride] = False
    return mask


def _batches(windows: torch.Tensor, batch_size: int):
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    for start in range(0, windows.shape[0], batch_size):
        yield start, windows[start : start + batch_size]  # (B, L)


def _log_probs(model: Any, batch: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax of the logits that predict tokens 1..L-1: (B, L-1, V)."""
    if model.training:
        raise ValueError("the model is in training mode; call model.eval() before evaluating it")
    device = next(model.parameters()).device
    logits = model(input_ids=batch.to(device), use_cache=False).logits  # (B, L, V)
    return torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, L-1, V)


def _nll_sum(logp: torch.Tensor, batch: torch.Tensor, scored: torch.Tensor | None = None) -> float:
    targets = batch[:, 1:].to(logp.device)  # (B, L-1)
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double()  # (B, L-1)
    return (nll if scored is None else nll[scored.to(nll.device)]).sum().item()


class ReferenceLogits:
    """A reference model's log-probabilities on fixed windows, float16 on disk.

    Holds, for every scored position, the full log-softmax row (float16, memory-mapped,
    ``W x (L-1) x V x 2`` bytes), the float32 argmax, the windows themselves (a comparison on
    other windows is refused) and the reference's own :class:`QualityResult`.

    The file lives in a fresh directory under ``directory`` (default: the system temp dir) and is
    removed by :meth:`close` (or when the object is garbage collected); use it as a context manager.
    """

    def __init__(self, windows: torch.Tensor, logprobs: np.memmap, argmax: np.ndarray, result: QualityResult, workdir: Path):
        self.windows = windows  # (W, L)
        self.logprobs = logprobs  # (W, L-1, V) float16
        self.argmax = argmax  # (W, L-1) int64
        self.result = result
        self.path = workdir / REFERENCE_FILE
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(workdir), ignore_errors=True)

    @classmethod
    def compute(
        cls,
        model: Any,
        windows: torch.Tensor,
        directory: str | Path | None = None,
        batch_size: int = 4,
        progress: Callable[[int], None] | None = None,
    ) -> ReferenceLogits:
        """Run ``model`` once over ``windows`` (W, L) and store its log-probabilities."""
        n_windows, seq_len = windows.shape
        vocab = model.get_output_embeddings().weight.shape[0]
        shape = (n_windows, seq_len - 1, vocab)
        needed = math.prod(shape) * 2
        base = Path(directory) if directory is not None else Path(tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(base).free
        if free < needed + (1 << 28):
            raise OSError(
                errno.ENOSPC,
                f"the reference log-probabilities need {needed / 1e9:.1f} GB in {base}, only {free / 1e9:.1f} GB free",
            )
        workdir = Path(tempfile.mkdtemp(prefix="optkit-reference-", dir=base))
        try:
            logprobs = np.memmap(workdir / REFERENCE_FILE, dtype=np.float16, mode="w+", shape=shape)
            argmax = np.empty(shape[:2], dtype=np.int64)
            nll = 0.0
            with torch.inference_mode():
                for start, batch in _batches(windows, batch_size):
                    logp = _log_probs(model, batch)  # (B, L-1, V)
                    if logp.shape[-1] != vocab:
                        raise ValueError(f"model returned {logp.shape[-1]} logits per position, expected {vocab}")
                    nll += _nll_sum(logp, batch)
                    end = start + batch.shape[0]
                    argmax[start:end] = logp.argmax(-1).cpu().numpy()  # (B, L-1)
                    logprobs[start:end] = logp.to(torch.float16).cpu().numpy()  # (B, L-1, V)
                    if progress is not None:
                        progress(end)
            logprobs.flush()
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        result = _result(nll, n_windows, seq_len)
        return cls(windows.clone(), logprobs, argmax, result, workdir)

    def close(self) -> None:
        """Drop the memory map and delete the file."""
        self.logprobs = None
        self._cleanup()

    def __enter__(self) -> ReferenceLogits:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _result(nll_sum: float, n_windows: int, seq_len: int, tokens: int | None = None, **extra: float) -> QualityResult:
    tokens = tokens or n_windows * (seq_len - 1)
    nll = nll_sum / tokens
    return QualityResult(perplexity=math.exp(nll), nll=nll, tokens_scored=tokens, windows=n_windows, seq_len=seq_len, **extra)


def evaluate(
    model: Any,
    windows: torch.Tensor,
    reference: ReferenceLogits | None = None,
    batch_size: int = 4,
    progress: Callable[[int], None] | None = None,
    stride: int | None = None,
) -> QualityResult:
    """Perplexity of ``model`` (in eval mode) on ``windows`` (W, L), and with a ``reference`` its
    KL divergence from and top-1 agreement with the reference on the same positions.
    ``stride``: the windows overlap (see :func:`make_windows`); each token is scored once.

    Logits are taken in float32 whatever the model's dtype. ``progress`` is called with the
    number of windows done after each batch.
    """
    n_windows, seq_len = windows.shape
    if reference is not None:
        if reference.logprobs is None:
            raise ValueError("the reference was closed")
        if not torch.equal(reference.windows, windows):
            raise ValueError("the reference was computed on other windows")
    nll = kl = 0.0
    agree = 0
    scored = _scored(n_windows, seq_len, stride)  # (W, L-1)
    tokens = int(scored.sum())
    with torch.inference_mode():
        for start, batch in _batches(windows, batch_size):
            end = start + batch.shape[0]
            mask = scored[start:end].to(batch.device)  # (B, L-1)
            logp = _log_probs(model, batch)  # (B, L-1, V)
            nll += _nll_sum(logp, batch, mask)
            if reference is not None:
                for i in range(batch.shape[0]):  # one window at a time bounds the float32 copies
                    stored = torch.from_numpy(np.asarray(reference.logprobs[start + i]))  # (L-1, V) float16
                    # renormalize after the float16 rounding, so P_ref sums to 1 and KL(P || P) ~ 0
                    ref_logp = torch.log_softmax(stored.to(logp.device, torch.float32), dim=-1)  # (L-1, V)
                    m = mask[i].to(logp.device)
                    kl += F.kl_div(logp[i][m], ref_logp[m], reduction="sum", log_target=True).double().item()
                ref_top1 = torch.from_numpy(reference.argmax[start:end]).to(logp.device)  # (B, L-1)
                agree += int(((logp.argmax(-1) == ref_top1) & mask.to(logp.device)).sum().item())
            if progress is not None:
                progress(end)
    if reference is None:
        return _result(nll, n_windows, seq_len, tokens)
    return _result(nll, n_windows, seq_len, tokens, kl_divergence=kl / tokens, top1_agreement=agree / tokens)
