"""Accuracy: the fraction of predictions equal to their references.

optkit's own metric module for the Hugging Face ``evaluate`` library, shipped inside the package
so ``evaluate.load(<this file or its directory>)`` works offline (the canonical
``evaluate.load("accuracy")`` fetches its script from the Hub). It depends only on numpy and
``evaluate`` itself: ``evaluate`` copies this file into its modules cache
(``$HF_HOME/modules``) and imports it from there, so it must not import from optkit.

    accuracy = sum_i w_i [pred_i == ref_i] / sum_i w_i      (w_i = 1 without sample_weight)

Unlike the Hub's module it needs no scikit-learn; the result is the same number.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """
Accuracy is the proportion of correct predictions among all predictions:
Accuracy = (number of predictions equal to their reference) / (number of predictions).
With `sample_weight`, each prediction counts with its weight.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels (for a multiple-choice task, the index of the chosen answer).
    references (`list` of `int`): ground-truth labels, one per prediction.
    normalize (`bool`): if True (default) return the fraction correct, else the count correct.
    sample_weight (`list` of `float`): optional weight per prediction; defaults to 1 each.

Returns:
    accuracy (`float` or `int`): the fraction (or, with normalize=False, the weighted count) of
    correct predictions; 0.0 when there are no predictions.

Examples:
    >>> accuracy = evaluate.load("optkit/evaluate/metrics/accuracy")
    >>> accuracy.compute(predictions=[0, 1, 2, 3], references=[0, 1, 1, 3])
    {'accuracy': 0.75}
"""

_CITATION = """
@misc{optkit-accuracy,
  title = {optkit accuracy metric},
  note = {Part of optkit; the same definition as scikit-learn's accuracy_score.}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    """Fraction (or weighted count) of predictions that equal their reference."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Value("int32"),
                    "references": datasets.Value("int32"),
                }
            ),
            reference_urls=[],
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        pred = np.asarray(predictions, dtype=np.int64)  # (N,)
        ref = np.asarray(references, dtype=np.int64)  # (N,)
        weight = np.ones(pred.shape, dtype=np.float64) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
        if weight.shape != pred.shape:
            raise ValueError(f"sample_weight has {weight.shape[0]} entries for {pred.shape[0]} predictions")
        correct = float(np.sum(weight * (pred == ref)))
        if not normalize:
            return {"accuracy": correct}
        total = float(np.sum(weight))
        return {"accuracy": correct / total if total > 0 else 0.0}
