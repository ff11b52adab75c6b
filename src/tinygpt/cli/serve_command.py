"""``tinygpt serve``: an OpenAI-compatible HTTP server (and a page) for one model, and any LoRA adapters of it
(``--adapter NAME=DIR``, each served as the model NAME).

The server's flags are the fields of ``serving.options.ServeOptions`` and ``ReplicaOptions``; the model's
(``--model``, ``--tokenizer-dir``, ``--device``, ``--dtype``, ``--weights``) are ``command_options.ServeModelOptions``,
every loading command's ``ModelOptions`` in the server's words."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..command_options import ServeModelOptions
from ..serving.options import API_KEY_ENV, ServeOptions
from ..serving.replica_options import CLUSTER_EXTRA, ReplicaOptions
from .common import CommandError, add_options, load_for_command, options_from_args


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over HTTP: OpenAI-compatible API with batching, and a web page")
    add_options(p, ServeModelOptions)
    add_options(p, ServeOptions)
    add_options(p, ReplicaOptions)
    p.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if api_key is not None and not api_key.strip():
        raise CommandError("--api-key must not be empty")
    name = args.model_name or (Path(args.model).name if Path(args.model).is_dir() else args.model)
    options = options_from_args(ServeOptions, args, api_key=api_key, model_name=name)  # an OptionError: main()
    # words it with the flag's name
    if args.weights != "float32" and options.adapters:
        raise CommandError(f"--weights {args.weights} cannot serve --adapter: LoRA adapters attach to float32 linears "
                           f"(merge the adapter into the model with tinygpt merge, then serve that with --weights)")
    replicas = options_from_args(ReplicaOptions, args)
    if replicas.enabled:
        return _run_replicas(args, options, replicas, name)
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise CommandError(f"serving needs the serve extra: pip install -e '.[serve]' in a checkout, or "
                           f"pip install starlette uvicorn ({err})") from None
    from ..serving.app import create_app
    from ..serving.server import run_server

    model, tokenizer, device = load_for_command(args.model, args.tokenizer_dir, args.device, args.weights)
    app = create_app(model, tokenizer, options, dtype=args.dtype)

    def announce(url: str) -> None:
        adapters = "".join(f", {a}" for a in options.adapters)
        print(f"tinygpt serve: {name}{adapters} on {url} (max batch {options.max_batch}, queue {options.max_queue}"
              f"{', API key required' if api_key else ''})", flush=True)

    run_server(app, options, announce=announce)
    return 0


# Connection limits of tinygpt's own HTTP server (``serving.server``); with replicas Ray Serve's proxy accepts the
# connections, and it has none of these settings.
_SERVER_ONLY = {"header_timeout": "--header-timeout", "max_connections": "--max-connections",
                "max_header_bytes": "--max-header-bytes"}


def _run_replicas(args: argparse.Namespace, options: ServeOptions, replicas: ReplicaOptions, name: str) -> int:
    """``--replicas N`` / ``--autoscale MIN:MAX``: the same app in N processes behind Ray Serve's proxy."""
    for field, flag in _SERVER_ONLY.items():
        if getattr(args, field) != ServeOptions.__dataclass_fields__[field].default:
            raise CommandError(f"{flag} is a setting of tinygpt's own HTTP server; with --replicas/--autoscale Ray "
                               f"Serve's proxy accepts connections, and it has no such limit: drop {flag}")
    if options.port == 0:
        raise CommandError("--port 0 with --replicas/--autoscale: Ray Serve's proxy needs a fixed port; pick one")
    try:
        import ray.serve  # noqa: F401
    except ImportError as err:
        raise CommandError(f"--replicas/--autoscale need the cluster extra: {CLUSTER_EXTRA} ({err})") from None
    from ..serving.replicas import serve_replicas

    def announce(url: str) -> None:
        count = f"{replicas.replicas} replicas" if replicas.bounds is None else \
            f"{replicas.bounds[0]} to {replicas.bounds[1]} replicas"
        print(f"tinygpt serve: {name} on {url} ({count} on Ray Serve, max batch {options.max_batch} each"
              f"{', API key required' if options.api_key else ''})", flush=True)

    serve_replicas(args.model, options, replicas, tokenizer_dir=args.tokenizer_dir, device=args.device,
                   dtype=args.dtype, weights=args.weights, announce=announce)
    return 0
