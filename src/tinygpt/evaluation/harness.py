"""tinygpt as an lm-evaluation-harness model: ``TinyGPTLM``, registered with lm-eval as ``tinygpt`` on import.

lm-eval (the optional extra ``tinygpt[eval]``) finds models in its own registry only, so this module must be
imported before lm-eval looks the name up: ``tinygpt eval --tasks ...`` and ``python -m tinygpt.evaluation``
(lm-eval's own command line with this class registered) both do; in Python, ``import tinygpt.evaluation.harness``
before ``lm_eval.simple_evaluate(model="tinygpt", model_args="path=DIR", ...)``, or pass a ``TinyGPTLM`` instance.

The requests are lm-eval's three kinds:

- ``loglikelihood`` (context, continuation): lm-eval's ``TemplateLM`` tokenizes the pair exactly as its HF class
  does; the window ``(context + continuation)[-(C+1):]`` is scored by ``scoring.score_rows`` (batched, the shared
  context of a multiple-choice question run once).
- ``loglikelihood_rolling`` (text): lm-eval's own disjoint rolling windows of C tokens after the end-of-text
  prefix (``lm_eval.utils.get_rolling_token_windows``), the same windows its HF class scores.
- ``generate_until`` (context, gen_kwargs): ``tinygpt.stream`` (the KV-cached engine) on the last
  ``C + 1 - max_gen_toks`` tokens of each context (all that fit: the last new token is never fed), a batch of
  prompts at a time, stopping when every row has produced a stop text (or the end-of-text token, or
  ``max_gen_toks``); the text is cut before the first stop text, as lm-eval's HF class cuts it.

Requests longer than the context are cut as lm-eval's ``local-completions`` against ``tinygpt serve`` cuts them with
``max_length=C+2`` (its API class keeps ``max_length - 1`` tokens; the server scores a C + 1-token prompt), so the
in-process and HTTP scores agree on every request.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from ..generation import GenerationConfig, stream
from ..model import GPTModel
from ..text_stream import TextStreamer
from ..tokenizer import Tokenizer
from .scoring import score_rows

DEFAULT_BATCH_SIZE = 16
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _batch_size(value: object) -> int:
    """lm-eval passes --batch_size as given: an int, "8", or "auto"/"auto:N" (here: the default)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and value.strip().isdigit():
        size = int(value)
    elif isinstance(value, str) and value.startswith("auto"):
        return DEFAULT_BATCH_SIZE
    else:
        raise ValueError(f"batch_size={value!r} must be a positive integer or 'auto'")
    if size < 1:
        raise ValueError(f"batch_size={value!r} must be >= 1")
    return size


def _resolve_device(device: str | None) -> str:
    """lm-eval's command line passes cuda:0 unless told otherwise; like its HF class, use the CPU when there is no
    CUDA device (and the first GPU when none is named and one exists)."""
    import logging

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        logging.getLogger(__name__).warning("device %s is not available; using the CPU", device)
        return "cpu"
    return device


@register_model("tinygpt")
class TinyGPTLM(TemplateLM):
    """A tinygpt model for lm-eval. Either ``path`` (a tinygpt checkpoint, a Hugging Face GPT-2 folder or a hub name,
    as ``tinygpt generate --model``) or an in-memory ``model`` + ``tokenizer``.

    ``batch_size``: rows per forward call (and prompts per generation batch). ``max_gen_toks``: the default cap on
    generated tokens when a task does not set one (lm-eval's HF class uses 256). ``progress``: this class's bars.
    """

    def __init__(
        self,
        path: str | None = None,
        *,
        model: GPTModel | None = None,
        tokenizer: Tokenizer | None = None,
        tokenizer_dir: str | None = None,
        batch_size: int | str = DEFAULT_BATCH_SIZE,
        max_batch_size: int | None = None,  # lm-eval passes it with every model; auto sizing is not used here
        device: str | None = None,
        dtype: str | None = None,
        max_gen_toks: int = 256,
        progress: bool = True,
    ) -> None:
        super().__init__()
        if (path is None) == (model is None):
            raise ValueError("give exactly one of path=DIR (model_args path=...) or model=<GPTModel>")
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; allowed: {', '.join(_DTYPES)}")
        if path is not None:
            from ..interop.pretrained import load_pretrained

            model, tokenizer = load_pretrained(str(path), tokenizer_dir=tokenizer_dir, device=_resolve_device(device),
                                               dtype=_DTYPES.get(dtype) if dtype else None)
        elif not isinstance(model, GPTModel):
            raise TypeError(f"model must be a GPTModel, got {type(model).__name__}")
        if tokenizer is None:
            raise ValueError("the model has no tokenizer: pass tokenizer_dir=DIR")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size_per_call = _batch_size(batch_size)
        self._max_gen_toks = int(max_gen_toks)
        self._device = next(model.parameters()).device
        self.progress = progress

    # ------------------------------------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        if self.tokenizer.eot_id is None:
            raise ValueError(f"the model's {self.tokenizer.kind} tokenizer has no end-of-text token, which lm-eval "
                             f"needs as the context of an empty prompt and of rolling log-likelihoods")
        return self.tokenizer.eot_id

    @property
    def max_length(self) -> int:
        return self.model.config.context_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return f"tinygpt-{self.tokenizer.kind}-{self.tokenizer.vocab_size}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        # <|endoftext|> in a task's text means the special token, as Hugging Face's GPT-2 tokenizer reads it.
        return self.tokenizer.encode(string, allowed_special=True)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    # ------------------------------------------------------------------------------------------ scoring
    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]], disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        c = self.max_length
        rows = []
        for _, context, continuation in requests:
            if not context or not continuation:
                raise ValueError("a loglikelihood request needs context and continuation tokens")
            if len(continuation) > c:
                raise ValueError(f"a continuation of {len(continuation)} tokens does not fit the context of {c}")
            rows.append(((context + continuation)[-(c + 1):], len(continuation)))  # left-truncated as lm-eval's HF
        scores = score_rows(self.model, rows, batch_size=self.batch_size_per_call,
                            progress=self.progress and not disable_tqdm, desc="loglikelihood")
        out = []
        for (request, _, _), score in zip(requests, scores):
            answer = (score.logprob, score.greedy)
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        rows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1,
            )
            for context, prediction in map(lm_utils.make_disjoint_window, windows):
                rows.append(((context + prediction)[-(self.max_length + 1):], len(prediction)))
                owners.append(index)
        scores = score_rows(self.model, rows, batch_size=self.batch_size_per_call,
                            progress=self.progress and not disable_tqdm, desc="loglikelihood_rolling")
        totals = [0.0] * len(requests)
        for index, score in zip(owners, scores):
            totals[index] += score.logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------------------------------ generation
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        by_kwargs: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            by_kwargs.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        eos = None if self.tokenizer.eot_id is None else self.tokenizer.decode([self.tokenizer.eot_id])
        with tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm or not self.progress) as bar:
            for indices in by_kwargs.values():
                kwargs = dict(normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks))
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_new = int(kwargs.pop("max_gen_toks"))
                if max_new > self.max_length:
                    raise ValueError(f"max_gen_toks={max_new} must be at most the context of {self.max_length}")
                sampled = bool(kwargs.get("do_sample"))  # normalize_gen_kwargs made temperature 0 otherwise
                settings = GenerationConfig(
                    max_new_tokens=max_new, temperature=float(kwargs.get("temperature", 0.0)) if sampled else 0.0,
                    top_p=float(kwargs.get("top_p") or 1.0), eos_id=self.tokenizer.eot_id,
                )
                # the last new token is never fed back, so C + 1 - max_new prompt tokens fit (one more than lm-eval's
                # HF class keeps; what its API class keeps with max_length = C + 2, so HTTP and in process agree)
                prompts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length + 1 - max_new):] or
                           [self.prefix_token_id] for i in indices}
                order = sorted(indices, key=lambda i: -len(prompts[i]))
                for start in range(0, len(order), self.batch_size_per_call):
                    batch = order[start:start + self.batch_size_per_call]
                    for i, text in zip(batch, self._generate_batch([prompts[i] for i in batch], settings, until)):
                        results[i] = postprocess_generated_text(text, until, None)
                        self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
                    bar.update(len(batch))
        return results  # type: ignore[return-value]

    def _generate_batch(self, prompts: list[list[int]], settings: GenerationConfig, until: list[str]) -> list[str]:
        """Generate for the prompts until each row's text holds a stop text (or the engine ends the row); each
        row's text through one ``TextStreamer``, which decodes only the new tokens (the text before the first stop
        text, whole characters only until the end)."""
        streamers = [TextStreamer(self.tokenizer, [u for u in until if u]) for _ in prompts]
        pieces: list[list[str]] = [[] for _ in prompts]
        stopped = [False] * len(prompts)
        steps = stream(self.model, prompts, settings)
        try:
            for step in steps:
                for row, token in enumerate(step):
                    if token is None or stopped[row]:
                        stopped[row] = True
                        continue
                    piece, stopped[row] = streamers[row].add(token)
                    pieces[row].append(piece)
                if all(stopped):
                    break
        finally:
            steps.close()
        return ["".join(p) + ("" if s.stopped else s.finish()) for p, s in zip(pieces, streamers)]
