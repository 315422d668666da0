"""Multiple-choice and cloze tasks scored by log-likelihood, the way lm-evaluation-harness
scores them.

Task file format: JSONL, one item per line (blank lines are skipped)::

    {"id": "facts-001", "context": "Question: ...\\nAnswer:", "choices": ["...", "..."], "answer": 2}

``context`` is the text the model conditions on; each of the (at least two, distinct,
non-empty) ``choices`` is a candidate continuation; ``answer`` is the index of the correct
one. No other keys are allowed. A cloze item is the same thing with the choices being
possible endings of the sentence in ``context``.

Scoring (lm-eval's ``loglikelihood`` request with ``target_delimiter=" "``):

* the continuation is ``" " + choice`` (no space is added when the context already ends with
  whitespace or the choice starts with it); trailing whitespace of the context is moved to
  the front of the continuation, so ``"Paris is in "`` + ``"France"`` is scored as
  ``"Paris is in"`` | ``" France"``, the way word-level BPE vocabularies spell words;
* ``tokens(context + continuation)`` is cut after ``len(tokens(context))`` tokens: the tail is
  the continuation's tokens; no BOS or other special tokens are added (as ``quality.py``);
* ``ll(choice) = sum_i log p(cont_i | context, cont_<i)``, from one forward pass over
  ``(context + continuation)[:-1]``;
* ``acc``: ``argmax_c ll(c) == answer``; ``acc_norm``: ``argmax_c ll(c) / len(c)`` with
  ``len`` the choice's length in characters, lm-eval's ``acc_norm``, which removes the bias
  toward short choices. Ties go to the lowest index.

Accuracies are computed by the Hugging Face ``evaluate`` library from optkit's local metric
module (:mod:`optkit.evaluate.metrics`), so no Hub access is needed.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from optkit.errors import UserError

TASKS_DIR = Path(__file__).resolve().parent / "tasks_data"

#: Task sets written for optkit and shipped with it: name -> JSONL file.
BUILTIN_TASKS: dict[str, Path] = {
    "optkit-facts": TASKS_DIR / "optkit-facts.jsonl",
    "optkit-cloze": TASKS_DIR / "optkit-cloze.jsonl",
}

#: Joins a context and a choice (lm-eval's default ``target_delimiter``).
TARGET_DELIMITER = " "

_KEYS = ("id", "context", "choices", "answer")


@dataclass(frozen=True)
class TaskItem:
    """One multiple-choice item: ``choices[answer]`` is the correct continuation of ``context``."""

    id: str
    context: str
    choices: tuple[str, ...]
    answer: int


@dataclass
class ItemPrediction:
    """How the model answered one item.

    Attributes:
        id: the item's id.
        answer: index of the correct choice.
        pred: argmax of the summed log-likelihoods (what ``acc`` scores).
        pred_norm: argmax of the log-likelihoods divided by the choices' lengths in characters
            (what ``acc_norm`` scores).
        loglikelihoods: summed log-likelihood (nats) of each choice's tokens.
    """

    id: str
    answer: int
    pred: int
    pred_norm: int
    loglikelihoods: list[float]


@dataclass
class TaskResult:
    """Scores of one model on one task.

    Attributes:
        accuracy: lm-eval's ``acc``: fraction of items whose highest-likelihood choice is correct.
        accuracy_norm: lm-eval's ``acc_norm``: the same with likelihoods divided by choice length.
        n: items scored.
        predictions: per item, in file order (for paired comparisons between models).
        source: the task file, or ``"<list>"`` for items passed in memory.
        accuracy_stderr: standard error of ``accuracy``, ``sqrt(p (1 - p) / (n - 1))`` (lm-eval's
            ``acc_stderr``; 0 when n is 1): two models whose accuracies differ by less than about
            twice this are not distinguished by the task.
        accuracy_norm_stderr: the same for ``accuracy_norm``.
    """

    accuracy: float
    accuracy_norm: float
    n: int
    predictions: list[ItemPrediction] = field(repr=False)
    source: str = "<list>"
    accuracy_stderr: float = 0.0
    accuracy_norm_stderr: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- loading


def _bad(where: str, what: str) -> UserError:
    return UserError(
        f"{where}: {what}",
        hint='each line must be a JSON object {"id": str, "context": str, "choices": [str, str, ...], "answer": int}',
    )


def parse_item(obj: Any, where: str) -> TaskItem:
    """Validate one decoded item; ``where`` (e.g. ``"tasks.jsonl line 3"``) prefixes every error."""
    if not isinstance(obj, dict):
        raise _bad(where, f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(_KEYS))
    missing = [k for k in _KEYS if k not in obj]
    if unknown or missing:
        parts = ([f"missing key(s) {', '.join(missing)}"] if missing else []) + (
            [f"unknown key(s) {', '.join(unknown)}"] if unknown else []
        )
        raise _bad(where, "; ".join(parts))
    item_id, context, choices, answer = (obj[k] for k in _KEYS)
    if not isinstance(item_id, str) or not item_id:
        raise _bad(where, f"'id' must be a non-empty string, got {item_id!r}")
    if not isinstance(context, str) or not context.strip():
        raise _bad(where, f"item {item_id!r}: 'context' must be a string with some non-whitespace text, got {context!r}")
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise _bad(where, f"item {item_id!r}: 'choices' must be a list of strings, got {choices!r}")
    if len(choices) < 2:
        raise _bad(where, f"item {item_id!r}: 'choices' has {len(choices)} choice(s), at least 2 are needed")
    if any(not c.strip() for c in choices):
        raise _bad(where, f"item {item_id!r}: every choice must hold some non-whitespace text, got {choices!r}")
    if len(set(choices)) != len(choices):
        raise _bad(where, f"item {item_id!r}: 'choices' repeats a choice: {choices!r}")
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise _bad(where, f"item {item_id!r}: 'answer' must be an integer index into 'choices', got {answer!r}")
    if not 0 <= answer < len(choices):
        raise _bad(where, f"item {item_id!r}: 'answer' {answer} is out of range for {len(choices)} choices (0..{len(choices) - 1})")
    return TaskItem(item_id, context, tuple(choices), answer)


def _check_ids(items: list[TaskItem], wheres: list[str], source: str) -> None:
    if not items:
        raise UserError(f"{source}: the task holds no items", hint="add at least one item, one JSON object per line")
    seen: dict[str, str] = {}
    for item, where in zip(items, wheres, strict=True):
        if item.id in seen:
            raise _bad(where, f"id {item.id!r} repeats the id at {seen[item.id]}")
        seen[item.id] = where


def load_task(path: str | Path) -> list[TaskItem]:
    """Read and validate a JSONL task file; any problem is a :class:`UserError` naming the file and line."""
    p = Path(path)
    if not p.is_file():
        raise UserError(
            f"task file {p} not found",
            hint=f"pass a JSONL file or one of the built-in tasks: {', '.join(sorted(BUILTIN_TASKS))}",
        )
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{p}: not UTF-8 text: {err}") from None
    items, wheres = [], []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{p} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise _bad(where, f"not valid JSON ({err.msg} at column {err.colno})") from None
        items.append(parse_item(obj, where))
        wheres.append(where)
    _check_ids(items, wheres, str(p))
    return items


def resolve_task(spec: str | Path) -> Path:
    """A built-in task name (``optkit-facts``) or a path to a JSONL file -> the file's path."""
    if isinstance(spec, str) and spec in BUILTIN_TASKS:
        return BUILTIN_TASKS[spec]
    p = Path(spec)
    if not p.is_file():
        raise UserError(
            f"task {str(spec)!r} is neither a built-in task nor an existing file",
            hint=f"built-in tasks: {', '.join(sorted(BUILTIN_TASKS))}; or pass the path of a JSONL task file",
        )
    return p


def resolve_tasks(specs: Sequence[str | Path]) -> dict[str, Path]:
    """Built-in names and/or JSONL paths -> ``{name: path}`` for :func:`evaluate_tasks`, every
    file read and validated now (so a bad task fails before any model runs). A built-in task
    is named as given; a file by its stem (``data/my-qa.jsonl`` -> ``my-qa``)."""
    out: dict[str, Path] = {}
    for spec in specs:
        path = resolve_task(spec)
        name = str(spec) if isinstance(spec, str) and spec in BUILTIN_TASKS else path.stem
        if name in out:
            raise UserError(
                f"two tasks are named {name!r} ({out[name]} and {path})",
                hint="a task file is named by its stem; rename one of the files",
            )
        load_task(path)
        out[name] = path
    return out


def _items_of(name: str, spec: str | Path | Sequence[TaskItem | dict]) -> tuple[list[TaskItem], str]:
    if isinstance(spec, (str, Path)):
        path = resolve_task(spec)
        return load_task(path), str(path)
    items, wheres = [], []
    for i, obj in enumerate(spec):
        where = f"task {name!r} item {i}"
        if isinstance(obj, TaskItem):  # validated like a file's item
            obj = {"id": obj.id, "context": obj.context, "choices": list(obj.choices), "answer": obj.answer}
        items.append(parse_item(obj, where))
        wheres.append(where)
    _check_ids(items, wheres, f"task {name!r}")
    return items, "<list>"


# --------------------------------------------------------------------------- scoring


def encode_pair(tokenizer: Any, context: str, choice: str) -> tuple[list[int], list[int]]:
    """Token ids of the context and of the choice's continuation (lm-eval's ``_encode_pair``)."""
    continuation = choice if (choice[:1].isspace() or context[-1:].isspace()) else TARGET_DELIMITER + choice
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:  # "... in " + "France" -> "... in" + " France"
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    return list(ctx), list(whole[len(ctx) :])


def _max_length(model: Any) -> int | None:
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def loglikelihoods(
    model: Any, requests: Sequence[tuple[list[int], list[int]]], batch_size: int = 8
) -> list[float]:
    """Summed log-probability (nats, float32 softmax) of each request's continuation tokens
    given its context tokens: one value per ``(context_ids, continuation_ids)``.

    Requests are run longest first in batches of ``batch_size`` rows, right-padded with an
    attention mask (causal attention keeps padding from reaching the real positions). A
    request longer than the model's ``max_position_embeddings`` + 1 loses context from the left.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if model.training:
        raise ValueError("the model is in training mode; call model.eval() before evaluating it")
    device = next(model.parameters()).device
    max_len = _max_length(model)
    rows: list[list[int]] = []  # model input: (context + continuation)[:-1]
    for i, (ctx, cont) in enumerate(requests):
        if not cont:
            raise ValueError(f"request {i} has no continuation tokens")
        if not ctx:
            raise ValueError(f"request {i} has no context tokens to condition the first continuation token on")
        whole = list(ctx) + list(cont)
        if max_len is not None and len(whole) > max_len + 1:
            if len(cont) > max_len:
                raise UserError(f"a choice of {len(cont)} tokens does not fit the model's {max_len} positions")
            whole = whole[-(max_len + 1) :]
        rows.append(whole[:-1])
    order = sorted(range(len(rows)), key=lambda i: (-len(rows[i]), i))
    out = [0.0] * len(rows)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            width = max(len(rows[i]) for i in idx)
            n_cont = max(len(requests[i][1]) for i in idx)
            ids = torch.zeros(len(idx), width, dtype=torch.long)  # (B, L); pad id 0 is masked out
            mask = torch.zeros(len(idx), width, dtype=torch.long)  # (B, L)
            pos = torch.zeros(len(idx), n_cont, dtype=torch.long)  # (B, C): logit rows predicting the continuation
            targets = torch.zeros(len(idx), n_cont, dtype=torch.long)  # (B, C)
            valid = torch.zeros(len(idx), n_cont, dtype=torch.bool)  # (B, C)
            for b, i in enumerate(idx):
                row, cont = rows[i], requests[i][1]
                n, c = len(row), len(cont)
                ids[b, :n] = torch.tensor(row)
                mask[b, :n] = 1
                # logits at position j predict token j + 1 of (row + last token): the
                # continuation's c tokens are predicted by positions n - c .. n - 1
                pos[b, :c] = torch.arange(n - c, n)
                targets[b, :c] = torch.tensor(cont)
                valid[b, :c] = True
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits  # (B, L, V)
            vocab = logits.shape[-1]
            picked = logits.gather(1, pos.to(device).unsqueeze(-1).expand(-1, -1, vocab))  # (B, C, V)
            logp = torch.log_softmax(picked.float(), dim=-1)  # (B, C, V)
            token_lp = logp.gather(-1, targets.to(device).unsqueeze(-1)).squeeze(-1)  # (B, C)
            sums = (token_lp * valid.to(device)).double().sum(-1).cpu()  # (B,)
            for b, i in enumerate(idx):
                out[i] = float(sums[b])
    return out


def choose(loglikelihoods: Sequence[float], choices: Sequence[str]) -> tuple[int, int]:
    """``(pred, pred_norm)``: argmax of the log-likelihoods, and of them divided by each
    choice's length in characters (lm-eval's ``acc`` / ``acc_norm``); ties go to the lowest index."""
    lls = list(loglikelihoods)
    normed = [ll / len(c) for ll, c in zip(lls, choices, strict=True)]
    return max(range(len(lls)), key=lambda i: (lls[i], -i)), max(range(len(normed)), key=lambda i: (normed[i], -i))


def score_items(model: Any, tokenizer: Any, items: Sequence[TaskItem], batch_size: int = 8) -> list[ItemPrediction]:
    """Every item's choices scored in one batched pass over all (item, choice) pairs."""
    requests, owner = [], []
    for k, item in enumerate(items):
        for j, choice in enumerate(item.choices):
            ctx, cont = encode_pair(tokenizer, item.context, choice)
            if not cont:
                raise UserError(f"item {item.id!r}: choice {j} ({choice!r}) gives no tokens after the context")
            requests.append((ctx, cont))
            owner.append(k)
    lls = loglikelihoods(model, requests, batch_size=batch_size)
    per_item: list[list[float]] = [[] for _ in items]
    for k, ll in zip(owner, lls, strict=True):
        per_item[k].append(ll)
    preds = []
    for item, item_lls in zip(items, per_item, strict=True):
        pred, pred_norm = choose(item_lls, item.choices)
        preds.append(ItemPrediction(item.id, item.answer, pred, pred_norm, item_lls))
    return preds


def _stderr(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0


def evaluate_tasks(
    model: Any,
    tokenizer: Any,
    tasks: dict[str, str | Path | Sequence[TaskItem | dict]],
    batch_size: int = 8,
    max_items: int | None = None,
) -> dict[str, TaskResult]:
    """Score ``model`` (in eval mode) on each task: name -> a built-in task name, a JSONL path,
    or a list of items (:class:`TaskItem` or dicts of the file schema).

    ``max_items``: score only the first that many items of each task (lm-eval's ``--limit``).
    All tasks are read and validated before the model runs.
    """
    if max_items is not None and max_items < 1:
        raise ValueError(f"max_items must be at least 1, got {max_items}")
    loaded = {name: _items_of(name, spec) for name, spec in tasks.items()}
    metric = _accuracy_metric() if loaded else None
    results = {}
    for name, (items, source) in loaded.items():
        items = items[:max_items] if max_items is not None else items
        preds = score_items(model, tokenizer, items, batch_size=batch_size)
        refs = [p.answer for p in preds]
        acc = metric.compute(predictions=[p.pred for p in preds], references=refs)["accuracy"]
        acc_norm = metric.compute(predictions=[p.pred_norm for p in preds], references=refs)["accuracy"]
        results[name] = TaskResult(
            accuracy=float(acc),
            accuracy_norm=float(acc_norm),
            n=len(preds),
            predictions=preds,
            source=source,
            accuracy_stderr=_stderr(acc, len(preds)),
            accuracy_norm_stderr=_stderr(acc_norm, len(preds)),
        )
    return results


def _accuracy_metric() -> Any:
    from optkit.evaluate.metrics import load_metric

    return load_metric("accuracy")

