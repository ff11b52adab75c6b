"""``tinygpt eval``'s settings: which model, what to measure (perplexity of a text or a prepared corpus, lm-eval
tasks), and how. Each field's ``metadata`` is its command-line help (``tinygpt.cli.common.add_options``)."""

from __future__ import annotations

from dataclasses import dataclass

from .. import checks
from ..checks import option
from ..command_options import ModelOptions


@dataclass
class EvalOptions(ModelOptions):
    """What ``tinygpt eval`` measures. ``check`` refuses a bad value, or nothing to evaluate, before any model loads."""

    model: str = option(None, "a tinygpt checkpoint, a Hugging Face GPT-2 folder, or a hub name (gpt2, gpt2-medium, "
                              "...)", metavar="DIR|HUBNAME", required=True)
    tokenizer_dir: str | None = option(None, "a saved tokenizer", metavar="DIR", default_help="the model's own")
    text: str | None = option(None, "perplexity of this UTF-8 text file", metavar="FILE", group="source")
    data: str | None = option(None, "perplexity of a corpus prepared by `tinygpt prepare`", metavar="DIR",
                              group="source")
    split: str = option("val", "with --data: which split", choices=["val", "train"])
    window: int | None = option(None, "tokens per window", metavar="N", default_help="the model's context")
    stride: int | None = option(None, "tokens between window starts; each window scores its last N new tokens",
                                metavar="N", default_help="window/2")
    tasks: str | None = option(None, "comma-separated lm-eval tasks: the shipped tinygpt_lastword, tinygpt_choice, "
                                     "tinygpt_until, or any of lm-eval's (lambada_openai, hellaswag, ...: they "
                                     "download their data)", metavar="NAMES", default_help=None)
    include_path: str | None = option(None, "a folder of extra lm-eval task YAML files", metavar="DIR",
                                      default_help=None)
    limit: float | None = option(None, "at most N items per task (a fraction < 1: that share of each task)",
                                 metavar="N", default_help="all")
    num_fewshot: int | None = option(None, "few-shot examples per prompt", metavar="K", default_help="the task's")
    batch_size: int = option(16, "rows per forward call", metavar="N")
    progress: bool = option(True, "progress bars on stderr (default on)", both_ways=True)
    json: bool = option(False, "print the figures as JSON")

    def check(self) -> None:
        super().check()
        if self.text is None and self.data is None and self.tasks is None:
            raise ValueError("nothing to evaluate: give --text FILE or --data DIR (perplexity) and/or --tasks NAMES")
        checks.int_in_range("window", self.window, 2, None, optional=True,
                            note="(one token of context and one to score; unset: the model's context)")
        checks.positive_int("stride", self.stride, optional=True, note="(unset: window/2)")
        checks.positive_int("batch_size", self.batch_size)
        checks.non_negative_int("num_fewshot", self.num_fewshot, optional=True, note="(unset: the task's)")
        checks.positive_number("limit", self.limit, optional=True, note="(unset: every item)")
        checks.choice("split", self.split, ("val", "train"))
        if (self.window or self.stride) and self.text is None and self.data is None:
            raise ValueError("--window and --stride apply to perplexity: give --text FILE or --data DIR")
