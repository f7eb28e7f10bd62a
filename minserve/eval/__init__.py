"""Quality evaluation: our own metrics, the release gate, and an lm-eval adapter.

- :mod:`~minserve.eval.data`: the shipped text and question sets (``datasets/eval/``);
- :mod:`~minserve.eval.metrics`: perplexity, mean KL divergence, greedy agreement, exact match;
- :mod:`~minserve.eval.gate`: thresholds per weight format and the fp32-referenced table;
- :mod:`~minserve.eval.cli`: ``minserve eval``;
- :mod:`~minserve.eval.lm_eval_adapter`: minserve as an lm-eval model (imported on demand: lm-eval
  is the optional extra ``minserve[eval]``).
"""

from typing import TYPE_CHECKING

from minserve import lazy

# On first use: data.py alone (a dataset's path) must not load PyTorch, which metrics.py does.
__getattr__, __dir__ = lazy.exports(globals(), {
    **dict.fromkeys(("Question", "load_questions", "load_texts"), "minserve.eval.data"),
    **dict.fromkeys(("FormatResult", "FormatSpec", "Thresholds", "parse_format", "run_gate"), "minserve.eval.gate"),
    **dict.fromkeys(("exact_match", "greedy_agreement", "mean_kl", "perplexity"), "minserve.eval.metrics"),
})

if TYPE_CHECKING:
    from minserve.eval.data import Question, load_questions, load_texts
    from minserve.eval.gate import FormatResult, FormatSpec, Thresholds, parse_format, run_gate
    from minserve.eval.metrics import exact_match, greedy_agreement, mean_kl, perplexity

__all__ = ["FormatResult", "FormatSpec", "Question", "Thresholds", "exact_match", "greedy_agreement",
           "load_questions", "load_texts", "mean_kl", "parse_format", "perplexity", "run_gate"]
