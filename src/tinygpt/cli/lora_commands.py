"""`merge`: fold a LoRA adapter into its base and write a plain checkpoint."""

from __future__ import annotations

import argparse

from ..command_options import MergeOptions
from .common import add_options, options_from_args


def _add_merge(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("merge", help="fold a LoRA adapter (tinygpt's or peft's) into its base: a plain checkpoint")
    add_options(p, MergeOptions)
    p.set_defaults(run=_run_merge)


def _run_merge(args: argparse.Namespace) -> int:
    from ..interop.pretrained import merge_adapter

    args = options_from_args(MergeOptions, args)
    files = merge_adapter(args.adapter, args.out, base=args.base, overwrite=args.force)
    print(f"merged {args.adapter} into {args.out}: {', '.join(files)}")
    return 0
