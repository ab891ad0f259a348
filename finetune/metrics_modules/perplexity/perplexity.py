"""Perplexity of a causal LM from its summed token negative log-likelihoods.

An `evaluate` module shipped inside the package, because the Hub is not always
reachable (and the Hub's `perplexity` metric runs its own model instead of
scoring ours). Inputs are per-sequence sums, so that sequences of different
lengths are weighted by their tokens.
"""

import math

import datasets
import evaluate

_DESCRIPTION = "Token-weighted perplexity: exp(sum of token NLLs / number of tokens)."
_KWARGS_DESCRIPTION = """
Args:
    nll_sum: per-sequence sums of token negative log-likelihoods (natural log).
    num_tokens: per-sequence counts of the tokens scored.
Returns:
    perplexity: exp(mean token NLL).
    eval_loss: mean token NLL.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Perplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"nll_sum": datasets.Value("float64"), "num_tokens": datasets.Value("int64")}),
        )

    def _compute(self, nll_sum, num_tokens):
        tokens = sum(num_tokens)
        if tokens == 0:
            raise ValueError("no tokens were scored")
        mean_nll = sum(nll_sum) / tokens
        return {"eval_loss": mean_nll, "perplexity": math.exp(min(mean_nll, 700.0)), "num_tokens": tokens}
