"""Classification accuracy: the fraction of predictions equal to the references.

An `evaluate` module shipped inside the package, because the Hub (where
`evaluate.load("accuracy")` would fetch its own) is not always reachable.
"""

import datasets
import evaluate

_DESCRIPTION = "Accuracy: correct predictions / all predictions."
_KWARGS_DESCRIPTION = """
Args:
    predictions: predicted class ids.
    references: true class ids.
Returns:
    accuracy: in [0, 1].
    num_samples: how many predictions were scored.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        if not predictions:
            raise ValueError("no predictions were scored")
        correct = sum(int(p == r) for p, r in zip(predictions, references))
        return {"accuracy": correct / len(predictions), "num_samples": len(predictions)}
