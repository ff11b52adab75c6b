"""What LoRA and QLoRA save: full fine-tuning vs tinygpt LoRA (r = 8, 16) vs QLoRA vs Hugging Face + peft LoRA.

``python -m benchmarks.lora [--quick] [--sizes gpt2-small gpt2-medium] [--steps N] [--batch B] [--tokens T]
[--json PATH]``

Each configuration runs in a process of its own (peak RSS is a high-water mark that never goes down): it builds
the model (random GPT-2 weights, seed 0: the same weights for every configuration, Hugging Face's copied from
tinygpt's), trains ``--steps`` SFT steps on the same batches of the shipped instruction data (GPT-2 tokenizer,
prompt tokens masked, rows cut to ``--tokens``), then reports the validation loss on the same held-out batches.
Columns: trainable parameters, peak RSS (``VmHWM``), the median step time (the first step is a warm-up and not
counted), the validation loss after the steps. The LoRA rows adapt QKV + the attention's output projection
(PEFT: ``attn.c_attn``, ``attn.c_proj``), alpha = 2r, AdamW at lr 1e-3; full fine-tuning uses lr 1e-4 (both
customary). Two DPO rows show what the reference costs: full DPO holds a second copy of the model, DPO with LoRA
none (its reference is the base with the adapters off).

With random weights the loss after a few steps mostly measures how fast the token statistics are learnt, which
the embeddings (trained by full fine-tuning only) do best: the loss columns compare like with like only between
the LoRA rows. Ratios to full fine-tuning and to peft are printed beside the figures. Processes run one after
another, so a loaded machine distorts the step times: the load average is recorded before and after.

Run one configuration directly: ``python -m benchmarks.lora --one lora-r8 --size gpt2-small`` (one JSON line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from .common import format_table, run_json_process, shared_data_dir, write_json_atomic

SHARED_DATA = shared_data_dir()
CONFIGS = ("full", "lora-r8", "lora-r16", "qlora-r8", "qlora-dq-r8", "peft-r8", "dpo-full", "dpo-lora-r8")
QUANTIZE = {"qlora-r8": "nf4", "qlora-dq-r8": "nf4-dq"}  # the QLoRA rows' --quantize
SIZES = ("gpt2-small", "gpt2-medium")
TARGETS = ("qkv", "out_proj")


def _peak_mib() -> float:
    from .memory import _peak_mib as peak

    return peak()


def _model_config(size: str, quick: bool):
    from tinygpt import GPTConfig, get_config

    if quick:
        return GPTConfig(vocab_size=320, context_length=256, emb_dim=64, n_heads=4, n_layers=2, qkv_bias=True,
                         tie_weights=True)
    return get_config(size, qkv_bias=True, tie_weights=True)


def _tokenizer(quick: bool, data_dir: Path):
    if quick:
        from tinygpt.alignment.data import load_instruction_data
        from tinygpt.tokenizer import BPETokenizer

        entries = load_instruction_data(data_dir / "instruction-data.json", limit=64)
        return BPETokenizer.train([e.prompt + e.output for e in entries], 320)
    from tinygpt.tokenizer import gpt2_tokenizer

    return gpt2_tokenizer(data_dir / "gpt2")


def _batches(tokenizer, tokens: int, batch: int, steps: int, val_batches: int, data_dir: Path):
    """(train batches, val batches), each a list of (inputs, targets) [B, T'] with T' <= ``tokens``."""
    from tinygpt.alignment.batches import collate_targets, encode_example, end_of_text_id
    from tinygpt.alignment.data import load_instruction_data

    encoded = []
    for i, e in enumerate(load_instruction_data(data_dir / "instruction-data.json")):
        try:
            encoded.append(encode_example(tokenizer, e.prompt, e.output, tokens, f"entry {i}"))
        except ValueError:  # a prompt that leaves no room in --tokens: skipped, the same for every configuration
            continue
        if len(encoded) == batch * (steps + val_batches):
            break
    pad = end_of_text_id(tokenizer)
    groups = [collate_targets(encoded[j:j + batch], pad) for j in range(0, len(encoded), batch)]
    return groups[:steps], groups[steps:]


def save_start(size: str, quick: bool, directory: Path) -> Path:
    """The seed-0 random model of ``size`` saved as a tinygpt checkpoint: what the QLoRA rows load, as
    ``tinygpt sft --model DIR --quantize ...`` does."""
    import torch

    from tinygpt import GPTModel
    from tinygpt.checkpoint import save_model

    torch.manual_seed(0)
    save_model(GPTModel(_model_config(size, quick)), directory)
    return directory


def measure(name: str, size: str, *, steps: int, batch: int, tokens: int, quick: bool,
            data_dir: Path = SHARED_DATA, start: Path | None = None) -> dict[str, Any]:
    """One configuration in this process: train, evaluate, and report (see the module docstring). A QLoRA row
    loads ``start`` (``save_start``'s checkpoint) through the stages' loader, which quantises each block linear as
    it reads it; the other rows build the same seed-0 model in memory."""
    import torch

    from tinygpt import GPTModel
    from tinygpt.lora import LoRAConfig, apply_lora

    from .common import pin_threads

    if os.environ.get("OMP_NUM_THREADS"):  # a shared machine: the threads it was given, not every core
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    else:
        pin_threads()
    config = _model_config(size, quick)
    tokenizer = _tokenizer(quick, data_dir)
    train, val = _batches(tokenizer, min(tokens, config.context_length), batch, steps, 2, data_dir)
    r = int(name.rsplit("-r", 1)[1]) if "-r" in name else None
    quantize = QUANTIZE.get(name)
    if quantize is not None:
        from tinygpt.checkpoint import load_model

        if start is None:
            raise ValueError(f"{name} loads a saved start checkpoint: pass --start DIR (see save_start)")
        model = load_model(start, quantize=quantize).train()
    else:
        torch.manual_seed(0)
        model = GPTModel(config).train()
    if name.startswith("peft"):
        model, loss_of = peft_lora(config, model, r)
    else:
        if r is not None:
            apply_lora(model, LoRAConfig(r=r, alpha=2 * r, targets=TARGETS, quantize=quantize), seed=0)

        def loss_of(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return model(inputs, targets=targets)

    if name.startswith("dpo"):
        return _measure_dpo(name, "tiny" if quick else size, model, tokenizer, batch, steps, data_dir)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4 if r is None else 1e-3, weight_decay=0.0)
    times = []
    for inputs, targets in train:
        start = time.perf_counter()
        loss = loss_of(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    model.eval()
    with torch.no_grad():
        val_loss = sum(float(loss_of(i, t)) for i, t in val) / len(val)
    timed = sorted(times[1:] or times)
    return {"config": name, "size": "tiny" if quick else size, "trainable": sum(p.numel() for p in trainable),
            "peak_rss_mib": _peak_mib(), "step_s": timed[len(timed) // 2], "val_loss": val_loss,
            "steps": len(train), "batch": batch, "tokens": int(train[0][0].shape[1])}


def peft_lora(config, weights_from, r: int):
    """(Hugging Face GPT-2 with ``weights_from``'s weights under peft LoRA r on c_attn + c_proj, its loss
    ``(inputs, targets) -> scalar``): what a peft user trains, in train mode. ``weights_from`` is not kept."""
    import peft
    import torch.nn.functional as F

    from .models import build_hf

    hf = build_hf(config, weights_from=weights_from)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, fan_in_fan_out=True,
                                                    target_modules=["attn.c_attn", "attn.c_proj"]))
    model.train()

    def loss_of(inputs, targets):
        logits = model(input_ids=inputs).logits  # what labels= computes, with our already shifted targets
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    return model, loss_of


def _measure_dpo(name: str, size: str, policy, tokenizer, batch: int, steps: int, data_dir: Path
                 ) -> dict[str, Any]:
    """DPO steps (the library's ``DPOStage``): full DPO deep-copies the policy as its reference; with LoRA the
    reference is the policy's base."""
    import torch

    from tinygpt.alignment.data import load_preference_data
    from tinygpt.alignment.dpo import DPOStage

    preferences = load_preference_data(data_dir / "instruction-data-with-preference.json", limit=batch * steps)
    stage = DPOStage(policy, tokenizer, preferences, beta=0.1, batch_size=batch, val_fraction=0.0, seed=0)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4 if "lora" not in name else 1e-3, weight_decay=0.0)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        for update in stage.batches(step):  # what the loop does with a stage: accumulate, step
            for micro in update:
                stage.loss(micro)[0].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    timed = sorted(times[1:] or times)
    return {"config": name, "size": size, "trainable": sum(p.numel() for p in trainable),
            "peak_rss_mib": _peak_mib(), "step_s": timed[len(timed) // 2], "val_loss": None, "steps": steps,
            "batch": batch, "tokens": None, "reference_copy": stage.reference is not None}


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def run(quick: bool, *, sizes: Sequence[str] = SIZES, configs: Sequence[str] = CONFIGS, steps: int | None = None,
        batch: int = 1, tokens: int = 128, data_dir: Path = SHARED_DATA) -> dict[str, Any]:
    """Every configuration of every size, each in its own process, one after another."""
    from .models import available

    steps = steps or (3 if quick else 4)
    sizes = sizes[:1] if quick else sizes
    skipped = [] if available("hf") and _has("peft") else ["peft-r8"]
    rows = []
    load_before = _load()
    with tempfile.TemporaryDirectory(prefix="tinygpt-lora-bench-") as scratch:
        for size in sizes:
            start = save_start(size, quick, Path(scratch) / size) if set(configs) & set(QUANTIZE) else None
            for name in configs:
                if name in skipped:
                    continue
                args = ["--one", name, "--size", size, "--steps", str(steps), "--batch", str(batch), "--tokens",
                        str(tokens), "--data-dir", str(data_dir), *(["--quick"] if quick else []),
                        *(["--start", str(start)] if name in QUANTIZE else [])]
                rows.append(run_json_process("lora", args, f"lora benchmark {name}/{size}"))
    for row in rows:
        same = {r["config"]: r for r in rows if r["size"] == row["size"]}
        full = same.get("dpo-full" if row["config"].startswith("dpo") else "full")
        row["rss_x_full"] = row["peak_rss_mib"] / full["peak_rss_mib"] if full else None
        peft_row = same.get("peft-r8")
        # speed relative to peft: > 1 is faster (peft's step time / this step time)
        row["speed_x_peft"] = peft_row["step_s"] / row["step_s"] if peft_row and not row["config"].startswith(
            "dpo") else None
    return {"rows": rows, "quick": quick, "steps": steps, "batch": batch, "tokens": tokens,
            "load_before": load_before, "load_after": _load(), "not_available": skipped,
            "cores": os.cpu_count(), "threads": int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)}


def _has(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def table(result: dict[str, Any]) -> str:
    columns = [("size", "size"), ("config", "config"), ("trainable", "trainable"),
               ("peak_rss_mib", "peak RSS MiB"), ("rss_x_full", "RSS / full"), ("step_s", "step s"),
               ("speed_x_peft", "speed / peft"), ("val_loss", "val loss")]
    text = format_table(result["rows"], columns)
    text += (f"\n{result['steps']} steps of batch {result['batch']} (rows cut to {result['tokens']} tokens); "
             f"load average {result['load_before']:.1f} before, {result['load_after']:.1f} after, "
             f"{result['cores']} cores, {result['threads']} torch threads")
    for name in result["not_available"]:
        text += f"\n{name}: not available (transformers or peft not installed)"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model (seconds): the smoke test")
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES))
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--steps", type=int, help="training steps per configuration (default 4; quick 3)")
    parser.add_argument("--batch", type=int, default=1, help="rows per step (default 1)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per row at most (default 128)")
    parser.add_argument("--data-dir", type=Path, default=SHARED_DATA, help="folder with instruction-data*.json")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=SIZES, default="gpt2-small", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.size, steps=args.steps or 3, batch=args.batch, tokens=args.tokens,
                                 quick=args.quick, data_dir=args.data_dir, start=args.start)))
        return 0
    result = run(args.quick, sizes=args.sizes, configs=args.configs, steps=args.steps, batch=args.batch,
                 tokens=args.tokens, data_dir=args.data_dir)
    print(table(result))
    if args.json:
        write_json_atomic(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
