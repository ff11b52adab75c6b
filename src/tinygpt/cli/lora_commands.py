"""`merge`: fold a LoRA adapter into its base and write a plain checkpoint."""

from __future__ import annotations

import argparse


def _add_merge(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("merge", help="fold a LoRA adapter (tinygpt's or peft's) into its base: a plain checkpoint")
    p.add_argument("--adapter", required=True, metavar="DIR",
                   help="an adapter folder (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--base", metavar="DIR|HUBNAME", help="the base model (default: the one the adapter names)")
    p.add_argument("--out", required=True, metavar="DIR", help="where to write the merged checkpoint")
    p.add_argument("--force", action="store_true", help="write into a folder that holds other files (they are kept)")
    p.set_defaults(run=_run_merge)


def _run_merge(args: argparse.Namespace) -> int:
    from ..interop.pretrained import merge_adapter

    files = merge_adapter(args.adapter, args.out, base=args.base, overwrite=args.force)
    print(f"merged {args.adapter} into {args.out}: {', '.join(files)}")
    return 0
