"""``tinygpt serve``: an OpenAI-compatible HTTP server (and a page) for one model."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .. import checks
from .common import CommandError, add_device_options

API_KEY_ENV = "TINYGPT_API_KEY"


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over HTTP: OpenAI-compatible API with batching, and a web page")
    p.add_argument("--model", required=True, metavar="DIR|HUBNAME",
                   help="a tinygpt checkpoint, a Hugging Face GPT-2 folder, or a hub name (gpt2, gpt2-medium, ...)")
    p.add_argument("--tokenizer-dir", metavar="DIR", help="a tokenizer to use instead of the model's own")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    p.add_argument("--max-batch", type=int, default=8, metavar="N",
                   help="rows decoded together; requests beyond wait in the queue (default: 8)")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="rows that may wait for a place in the batch; beyond, 429 + Retry-After (default: 64)")
    p.add_argument("--model-name", metavar="NAME",
                   help="the model's id in the API (default: the directory's name or the hub name)")
    p.add_argument("--api-key", metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} if set, else no key)")
    p.add_argument("--token-budget", type=int, default=None, metavar="N",
                   help="tokens per forward: every running row's decode first, then chunks of waiting prompts "
                        "(default: 256, or --max-batch if larger)")
    p.add_argument("--cache-tokens", type=int, default=None, metavar="N",
                   help="positions the KV cache holds, allocated once (default: --max-batch x the context)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="do not reuse the cached keys/values of a prompt's prefix (a shared system prompt, the "
                        "previous turns of a chat)")
    p.add_argument("--speculative", choices=["off", "lookup"], default="off",
                   help="lookup: prompt-lookup speculative decoding (drafts copied from the row's own text, verified "
                        "in one forward; the same tokens for greedy rows, the same distribution for sampled ones)")
    p.add_argument("--speculative-tokens", type=int, default=4, metavar="K",
                   help="draft tokens verified per forward at most, with --speculative lookup (default: 4)")
    add_device_options(p)
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                   help="on SIGTERM/SIGINT, seconds the in-flight requests get to finish (default: 10)")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info",
                   help="uvicorn's log level (default: info)")
    p.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    checks.positive_int("max_batch", args.max_batch)  # an OptionError: main() words it with the flag's name
    checks.non_negative_int("max_queue", args.max_queue)
    checks.int_in_range("port", args.port, 0, 65535)
    checks.non_negative_number("shutdown_timeout", args.shutdown_timeout)
    checks.int_in_range("token_budget", args.token_budget, args.max_batch, None, optional=True,
                        note="(--max-batch: every running row decodes at every step)")
    checks.positive_int("cache_tokens", args.cache_tokens, optional=True)
    checks.positive_int("speculative_tokens", args.speculative_tokens)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if api_key is not None and not api_key.strip():
        raise CommandError("--api-key must not be empty")
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise CommandError(f"serving needs the serve extra: pip install 'tinygpt[serve]' ({err})") from None
    from ..devices import resolve_device

    from ..interop.pretrained import load_pretrained
    from ..serving.app import create_app
    from ..serving.server import run_server

    device = resolve_device(args.device)
    model, tokenizer = load_pretrained(args.model, tokenizer_dir=args.tokenizer_dir, device=device)
    if tokenizer is None:
        raise CommandError(f"{args.model} has no tokenizer: pass --tokenizer-dir DIR")
    name = args.model_name or (Path(args.model).name if Path(args.model).is_dir() else args.model)
    app = create_app(model, tokenizer, model_name=name, max_batch=args.max_batch, max_queue=args.max_queue,
                     api_key=api_key, dtype=args.dtype, engine_options=dict(
                         token_budget=args.token_budget, cache_tokens=args.cache_tokens,
                         prefix_reuse=not args.no_prefix_cache,
                         speculative_tokens=args.speculative_tokens if args.speculative == "lookup" else 0))
    def announce(url: str) -> None:
        print(f"tinygpt serve: {name} on {url} (max batch {args.max_batch}, queue {args.max_queue}"
              f"{', API key required' if api_key else ''})", flush=True)

    run_server(app, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout,
               log_level=args.log_level, announce=announce)
    return 0
