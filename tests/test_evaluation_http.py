"""lm-eval's own ``local-completions`` model pointed at ``tinygpt serve``: the shipped tasks give the same
log-likelihoods (within 1e-4), accuracies and generated answers as tinygpt's in-process class on the same weights.

The server runs in a thread on 127.0.0.1 at a free port. lm-eval tokenizes either with the exported checkpoint's
own vocab.json + merges.txt (``tokenizer_backend=huggingface`` on a local folder: no hub) or through the server
(``tokenizer_backend=remote``: /tokenizer_info, /tokenize, /detokenize), sends token ids, and reads the prompt's
log-probabilities back through ``echo`` + ``logprobs``.
"""

from __future__ import annotations

import contextlib
import os

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("tenacity")  # lm-eval's API models import it
pytest.importorskip("tinygpt.serving")
pytest.importorskip("uvicorn")

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402
import torch  # noqa: E402

from tinygpt import GPTConfig, GPTModel, gpt2_tokenizer  # noqa: E402
from tinygpt.evaluation.harness import TinyGPTLM  # noqa: E402
from tinygpt.evaluation.task_files import SHIPPED_TASKS, resolve_tasks  # noqa: E402
from tinygpt.interop.hf import export_hf  # noqa: E402
from tinygpt.serving.app import create_app  # noqa: E402
from tinygpt.serving.server import BackgroundServer  # noqa: E402

from conftest import GPT2_VOCAB_DIR  # noqa: E402

LIMIT = 6


@contextlib.contextmanager
def _serve(tmp_path_factory, context: int):
    """(model, tokenizer, the HF export folder, the live server) for a tiny random GPT-2 with ``context``."""
    if not (GPT2_VOCAB_DIR / "encoder.json").exists():
        pytest.skip(f"GPT-2 vocabulary files not found in {GPT2_VOCAB_DIR}")
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50257, context_length=context, emb_dim=32, n_heads=4, n_layers=2, qkv_bias=True)
    model, tokenizer = GPTModel(config).eval(), gpt2_tokenizer(GPT2_VOCAB_DIR)
    folder = tmp_path_factory.mktemp("served") / "hf"
    export_hf(model, folder, tokenizer=tokenizer)
    with BackgroundServer(create_app(model, tokenizer, model_name="tiny")) as server:
        yield model, tokenizer, folder, server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A 256-token context: no request of the shipped tasks is cut."""
    with _serve(tmp_path_factory, 256) as served:
        yield served


@pytest.fixture(scope="module")
def manager():
    return resolve_tasks(list(SHIPPED_TASKS))[1]  # indexing lm-eval's task files takes seconds: once per module


def _evaluate(model, manager, **kwargs):
    return lm_eval.simple_evaluate(model=model, tasks=list(SHIPPED_TASKS), task_manager=manager, limit=LIMIT,
                                   log_samples=True, bootstrap_iters=0, **kwargs)


@pytest.fixture(scope="module")
def in_process(served, manager):
    """tinygpt's own class on the served weights: the reference both tokenizer backends are compared with."""
    model, tokenizer, _, _ = served
    return _evaluate(TinyGPTLM(model=model, tokenizer=tokenizer, progress=False), manager)


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_local_completions_against_tinygpt_serve_match_in_process(served, manager, in_process, backend):
    """``huggingface``: lm-eval tokenizes with the export's files; ``remote``: with the server's /tokenizer_info,
    /tokenize and /detokenize, no tokenizer files at all."""
    _, _, folder, server = served
    tokenizer_args = f"tokenizer_backend=huggingface,tokenizer={folder}" if backend == "huggingface" else (
        "tokenizer_backend=remote")
    args = (f"base_url={server.url}/v1/completions,model=tiny,{tokenizer_args},"
            f"max_length=256,num_concurrent=1,max_retries=1,timeout=120")
    over_http = _evaluate("local-completions", manager, model_args=args)
    assert _compare(over_http, in_process) == {"loglikelihood": LIMIT + 4 * LIMIT, "generate_until": LIMIT}


def test_requests_longer_than_the_context_are_cut_the_same_way_over_http_and_in_process(tmp_path_factory, manager):
    """A 24-token context cuts most requests of the shipped tasks (a choice's context + ending, a passage, a
    question + 12 new tokens). lm-eval's API class keeps max_length - 1 tokens: with max_length = C + 2 it keeps
    the C + 1 that its HF class and tinygpt's class score, and the server scores a C + 1-token prompt, so every
    log-likelihood and answer agrees."""
    context = 24
    with _serve(tmp_path_factory, context) as (model, tokenizer, _, server):
        ours = _evaluate(TinyGPTLM(model=model, tokenizer=tokenizer, progress=False), manager)
        args = (f"base_url={server.url}/v1/completions,model=tiny,tokenizer_backend=remote,"
                f"max_length={context + 2},num_concurrent=1,max_retries=1,timeout=120")
        over_http = _evaluate("local-completions", manager, model_args=args)
        assert _compare(over_http, ours) == {"loglikelihood": LIMIT + 4 * LIMIT, "generate_until": LIMIT}
        cut = {"loglikelihood": 0, "generate_until": 0}
        for sample in (s for task in SHIPPED_TASKS for s in ours["samples"][task]):
            for context_text, second in sample["arguments"]:
                if isinstance(second, str):  # (context, continuation): cut when both exceed the C + 1 window
                    cut["loglikelihood"] += len(tokenizer.encode(context_text + second)) > context + 1
                else:  # (context, gen_kwargs): cut when more than C + 1 - max_gen_toks tokens
                    cut["generate_until"] += len(tokenizer.encode(context_text)) > context + 1 - 12
        assert cut["loglikelihood"] >= 20 and cut["generate_until"] >= 2, cut  # the cut really happened


def _compare(over_http, in_process) -> dict[str, int]:
    """Assert the same metrics, log-likelihoods (1e-4) and answers; how many responses of each kind compared."""
    compared = {"loglikelihood": 0, "generate_until": 0}
    for task in SHIPPED_TASKS:
        http_results, ours = over_http["results"][task], in_process["results"][task]
        for key in (k for k in ours if "," in k and "_stderr" not in k):
            if key.startswith("perplexity"):
                assert http_results[key] == pytest.approx(ours[key], rel=1e-4), (task, key)
            else:
                assert http_results[key] == ours[key], (task, key)
        pairs = zip(sorted(over_http["samples"][task], key=lambda s: s["doc_id"]),
                    sorted(in_process["samples"][task], key=lambda s: s["doc_id"]))
        for a, b in pairs:
            for x, y in zip(a["resps"], b["resps"]):
                if isinstance(y[0], str):
                    assert x == y  # greedy on the same weights: the same answer
                    compared["generate_until"] += 1
                else:
                    assert x[0][0] == pytest.approx(y[0][0], abs=1e-4) and x[0][1] == y[0][1]
                    compared["loglikelihood"] += 1
    return compared
