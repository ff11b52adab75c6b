"""Commands about one model: `params`, `verify`, `generate`, `convert`."""

from __future__ import annotations

import argparse
import json
import sys

from ..command_options import ConvertOptions, ParamsOptions, VerifyOptions
from ..config import GPTConfig
from ..params import count_parameters
from .common import (CommandError, add_generation_options, add_options, config_from_args, load_for_command,
                     options_from_args, sampling_config)


def _add_params(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("params", help="count parameters from the formula N = 2VD + CD + L(12D^2 + 10D) + 2D")
    add_options(p, ParamsOptions)
    p.set_defaults(run=_run_params)


def _run_params(args: argparse.Namespace) -> int:
    args = options_from_args(ParamsOptions, args)
    stored = None
    if args.model is not None:
        if args.qkv_bias or args.tie_weights:
            raise CommandError("--qkv-bias and --tie-weights change a config; a saved model already has its own")
        from ..checkpoint import count_stored_parameters, load_config

        config, stored, label = load_config(args.model), count_stored_parameters(args.model), args.model
    else:
        config, label = config_from_args(args.config), args.config
    overrides = {}
    if args.qkv_bias:
        overrides["qkv_bias"] = True
    if args.tie_weights:
        overrides["tie_weights"] = True
    config = config.replace(**overrides)
    counts = count_parameters(config)
    if args.json:
        extra = {} if stored is None else {"stored_parameters": stored}
        print(json.dumps({"config": config.to_dict(), "parameters": counts.to_dict(), **extra}, indent=2))
        return 0
    rows = [
        ("token embedding (V*D)", counts.token_embedding),
        ("position embedding (C*D, 0 with RoPE)", counts.position_embedding),
        (f"attention ({config.n_layers} x {counts.attention_per_block:,})", counts.attention),
        (f"feed-forward ({config.n_layers} x {counts.feed_forward_per_block:,})", counts.feed_forward),
        (f"{config.norm} ({config.n_layers} x {counts.norms_per_block:,} + {counts.final_norm:,})", counts.norms),
        ("output head (V*D, 0 when tied)", counts.head),
        ("total", counts.total),
    ]
    if stored is not None:
        rows.append(("stored in model.safetensors", stored))
    print(f"{label}: V={config.vocab_size} C={config.context_length} D={config.emb_dim} "
          f"H={config.n_heads} L={config.n_layers} qkv_bias={config.qkv_bias} tie_weights={config.tie_weights}")
    defaults = GPTConfig()
    variant = [f"{name}={getattr(config, name)}" for name in ("norm", "ffn", "bias", "pos_emb", "n_kv_heads")
               if getattr(config, name) != getattr(defaults, name)]
    if variant:
        print(f"  variant: {' '.join(variant)}")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value:>15,}")
    return 0


def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="prove the math: copy weights into a reference implementation, compare logits")
    add_options(p, VerifyOptions)
    p.set_defaults(run=_run_verify)


def _run_verify(args: argparse.Namespace) -> int:
    from ..verify import CHECKS, MissingReferenceError

    args = options_from_args(VerifyOptions, args)
    try:
        results = CHECKS[args.reference]()
    except MissingReferenceError as err:
        raise CommandError(str(err)) from None
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        for r in results:
            tokens = "" if r.tokens_match is None else f"  greedy tokens {'identical' if r.tokens_match else 'DIFFER'}"
            status = "ok  " if r.passed else "FAIL"
            print(f"{status} {r.dtype:<8} max|diff| {r.max_abs_diff:.3e} <= {r.tolerance:.0e}{tokens}  {r.name}")
    return 0 if all(r.passed for r in results) else 1


def _add_generate(sub: argparse._SubParsersAction) -> None:
    from ..command_options import GenerateOptions

    p = sub.add_parser("generate", help="continue a prompt with a saved model (greedy unless --temperature > 0)")
    add_options(p, GenerateOptions)
    add_generation_options(p, max_new_tokens=50)
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from ..command_options import GenerateOptions
    from ..devices import autocast
    from ..interop.pretrained import load_draft
    from ..text_stream import stream_text

    options = options_from_args(GenerateOptions, args)
    options.check()
    if options.prompt_file is not None:
        try:
            prompt = open(options.prompt_file, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as err:
            raise CommandError(f"cannot read --prompt-file {options.prompt_file}: {err}") from None
    else:
        prompt = sys.stdin.read() if options.prompt == "-" else options.prompt
    settings = sampling_config(args, "generate")  # checked before the model is loaded
    model, tokenizer, device = load_for_command(options.model, options.tokenizer_dir, options.device,
                                                options.weights, base=options.base)
    if not tokenizer.encode(prompt):
        raise CommandError("the prompt is empty: give at least one character of text to continue")
    draft = None
    if options.draft is not None:
        if not settings.use_cache:
            raise CommandError("--draft needs the cache (drop --no-cache): drafts are verified against it")
        draft = load_draft(options.draft, model, tokenizer, device=device)
    if options.tool and draft is not None:
        raise CommandError("--tool and --draft cannot be combined: a row that calls a tool does not draft")
    from ..tools import Calculator

    pieces = stream_text(model, tokenizer, prompt, settings, stop_texts=options.stop, draft_model=draft,
                         constraint=Calculator(tokenizer) if options.tool else None)
    with autocast(device, options.dtype):
        if not options.stream:
            print(prompt + "".join(pieces))
            return 0
        sys.stdout.write(prompt)
        sys.stdout.flush()
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="a tinygpt checkpoint <-> a Hugging Face GPT-2 folder or a GGUF file "
                                       "(llama.cpp)")
    add_options(p, ConvertOptions)
    p.set_defaults(run=_run_convert)


def _run_convert(args: argparse.Namespace) -> int:
    from ..interop.pretrained import convert_from_hf, convert_to_hf

    args = options_from_args(ConvertOptions, args)

    def warn(message: str) -> None:
        print(f"tinygpt convert: warning: {message}", file=sys.stderr)

    if args.to_gguf is not None:
        if args.model is None or args.out is not None:
            raise CommandError("--to-gguf OUT.gguf takes the checkpoint as --model DIR (and no --out)")
        from ..interop.pretrained import convert_to_gguf

        try:
            convert_to_gguf(args.model, args.to_gguf, type=args.type, overwrite=args.force, warn=warn)
        except ImportError as err:
            raise CommandError(str(err)) from None
        print(f"wrote {args.to_gguf} ({args.type})")
        return 0
    if args.out is None:
        raise CommandError("--out DIR is required with --from-hf, --to-hf and --from-gguf")
    if args.model is not None or args.type != "f32":
        raise CommandError("--model and --type apply to --to-gguf only")
    if args.from_gguf is not None:
        from ..interop.pretrained import convert_from_gguf

        try:
            files = convert_from_gguf(args.from_gguf, args.out, overwrite=args.force, warn=warn)
        except ImportError as err:
            raise CommandError(str(err)) from None
    else:
        convert, source = (convert_from_hf, args.from_hf) if args.from_hf else (convert_to_hf, args.to_hf)
        files = convert(source, args.out, overwrite=args.force, warn=warn)
    print(f"wrote {args.out}: {', '.join(files)}")
    return 0
