"""Evaluation: sliding-window perplexity and lm-evaluation-harness (``harness``, imported on demand: lm-eval is the
optional extra ``tinygpt[eval]``)."""

from .perplexity import PerplexityResult, perplexity, sliding_windows, stream_bytes, text_tokens
from .scoring import RowScore, score_rows

__all__ = ["PerplexityResult", "RowScore", "perplexity", "score_rows", "sliding_windows", "stream_bytes",
           "text_tokens"]
