"""Metric modules for the Hugging Face ``evaluate`` library, shipped with optkit.

``evaluate.load("accuracy")`` fetches the metric's script from the Hub, which fails offline.
optkit ships its own module (``accuracy/accuracy.py``, a documented ``evaluate.Metric``
subclass) and loads it by path: ``evaluate`` copies the script into ``$HF_HOME/modules`` and
imports it from there, with no network access.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from optkit.errors import UserError

METRICS_DIR = Path(__file__).resolve().parent

#: Metric name -> directory holding ``<name>.py`` (what ``evaluate.load`` takes).
LOCAL_METRICS: dict[str, Path] = {"accuracy": METRICS_DIR / "accuracy"}


def load_metric(name: str) -> Any:
    """The ``evaluate.EvaluationModule`` of one of optkit's local metrics, loaded by path.

    ``keep_in_memory=True``: predictions are not written to an Arrow cache file on disk.
    """
    if name not in LOCAL_METRICS:
        raise UserError(f"unknown metric {name!r}; optkit ships: {', '.join(sorted(LOCAL_METRICS))}")
    try:
        import evaluate
    except ImportError as err:
        raise UserError(
            f"task accuracy needs the Hugging Face 'evaluate' library, which is not installed ({err})",
            hint="pip install evaluate",
        ) from None
    return evaluate.load(str(LOCAL_METRICS[name]), keep_in_memory=True)
