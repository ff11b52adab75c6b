"""What one step of each alignment stage costs: SFT, reward model, DPO, PPO (and PPO's rollout alone).

``python -m benchmarks.alignment [--quick] [--json PATH] [--model DIR] [--batch N] [--repeats N]``

A GPT-2-small-sized model (124M, C = 1024, the GPT-2 tokenizer from ``../shared/data/gpt2``) unless ``--model``
names a checkpoint (e.g. a real GPT-2 converted with ``tinygpt convert --from-hf gpt2``); ``--quick`` is a tiny
model and a BPE trained on the data, for the smoke test. Batches are real Alpaca entries from
``instruction-data*.json`` (what a user's run would see), ``--batch`` rows per step.

Every stage runs what the library's one loop does in a step (the stage's ``batches`` and ``loss``, backward,
``optimizer_step``: clip, AdamW). To keep one copy of the weights in memory, the four stages share one policy
(which is also the reward model's trunk) and one AdamW over it and the two heads; timings do not depend on the weight values, except PPO's response length: a random
model never samples end-of-text, so its responses are always ``max_new_tokens`` long (the worst case). The stages
are timed interleaved (SFT, reward, DPO, PPO, rollout, SFT, ...) after a warm-up step each; the headline is each
stage's cost as a multiple of an SFT step, which survives a noisy machine better than the seconds do.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from tinygpt import GPTConfig, GPTModel
from tinygpt.alignment.batches import batch_for_step, encode_prompt
from tinygpt.alignment.data import format_prompt, load_instruction_data, load_preference_data
from tinygpt.alignment.dpo import DPOStage
from tinygpt.alignment.ppo import PPOConfig
from tinygpt.alignment.ppo_trainer import PPOStage, reward_model_fn
from tinygpt.alignment.reward import RewardModel, RewardStage
from tinygpt.alignment.sft import SFTStage
from tinygpt.training.optim import build_optimizer, optimizer_step

from .common import format_table, pin_threads, shared_data_dir, spread, time_interleaved, write_json_atomic
from .models import gpt2_small

SHARED_DATA = shared_data_dir()


def _model_and_tokenizer(quick: bool, model_dir: str | None, data_dir: Path):
    if model_dir is not None:
        from tinygpt.alignment.finetune import load_start_model

        return load_start_model(model_dir)
    if quick:
        from tinygpt.tokenizer import BPETokenizer

        entries = load_preference_data(data_dir / "instruction-data-with-preference.json", limit=64)
        tokenizer = BPETokenizer.train([e.prompt + e.chosen + e.rejected for e in entries], 320)
        config = GPTConfig(vocab_size=tokenizer.vocab_size, context_length=256, emb_dim=32, n_heads=2, n_layers=2,
                           drop_rate=0.0)
    else:
        from tinygpt.tokenizer import gpt2_tokenizer

        tokenizer = gpt2_tokenizer(data_dir / "gpt2")
        config = gpt2_small().replace(drop_rate=0.0)
    torch.manual_seed(0)
    return GPTModel(config), tokenizer


def run(quick: bool, *, model_dir: str | None = None, batch: int | None = None, repeats: int | None = None,
        max_new_tokens: int | None = None, data_dir: Path = SHARED_DATA) -> dict[str, Any]:
    batch = batch or 2
    repeats = repeats or (2 if quick else 3)
    max_new_tokens = max_new_tokens or (8 if quick else 32)
    n = 4 * batch * (repeats + 1)  # enough entries that no step repeats a batch (the DPO reference is cached)
    policy, tokenizer = _model_and_tokenizer(quick, model_dir, data_dir)
    policy.train()
    c = policy.config.context_length
    reference = GPTModel(policy.config)
    reference.load_state_dict(policy.state_dict())
    instructions = load_instruction_data(data_dir / "instruction-data.json", limit=n)
    preferences = load_preference_data(data_dir / "instruction-data-with-preference.json", limit=n)
    common = dict(batch_size=batch, val_fraction=0.0, seed=0)
    reward_model = RewardModel(policy)
    stages = {
        "sft": SFTStage(policy, tokenizer, instructions, **common),
        "reward": RewardStage(reward_model, tokenizer, preferences, **common),
        "dpo": DPOStage(policy, tokenizer, preferences, reference=reference, beta=0.1, **common),
    }
    eot = tokenizer.eot_id
    prompts = [encode_prompt(tokenizer, format_prompt(e.instruction, e.input), c - max_new_tokens, f"entry {i}")
               for i, e in enumerate(instructions)]
    stages["ppo"] = PPOStage(policy, prompts, reward_model_fn(reward_model, eot), tokenizer=tokenizer,
                             reference=reference, config=PPOConfig(max_new_tokens=max_new_tokens), eos_id=eot,
                             pad_id=eot, **common)
    heads = nn.ModuleDict({"policy": policy, "reward": reward_model.head, "value": stages["ppo"].heads["value"]})
    optimizer = build_optimizer(heads, lr=1e-6)
    counters = {name: 0 for name in stages}

    def step_fn(name: str) -> Callable[[], None]:
        def step() -> None:  # what the loop's train_step does with a stage (one process, no autocast)
            stage = stages[name]
            for update in stage.batches(counters[name]):
                total = 0.0
                for batch in update:
                    loss, _ = stage.loss(batch)
                    (loss / len(update)).backward()
                    total += float(loss.detach())
                optimizer_step(optimizer, total / len(update), 1.0, counters[name])
            counters[name] += 1
        return step

    ppo = stages["ppo"]
    rollout_step = [0]

    def rollout() -> None:
        chosen = batch_for_step(len(ppo.train_prompts), batch, 1000 + rollout_step[0], 0)
        ppo.rollout([ppo.train_prompts[i] for i in chosen])
        rollout_step[0] += 1

    fns = {name: step_fn(name) for name in stages}
    fns["ppo rollout"] = rollout
    stats = time_interleaved(fns, warmup=1, repeats=repeats)
    base = stats["sft"]["median_s"]
    rows = [{"stage": name, "median_s": s["median_s"], "spread_ms": spread(s), "x_sft": s["median_s"] / base}
            for name, s in stats.items()]
    return {
        "config": policy.config.to_dict(), "parameters": policy.num_parameters(), "batch": batch,
        "ppo": {"max_new_tokens": max_new_tokens, "ppo_epochs": PPOConfig().ppo_epochs},
        "repeats": repeats, "quick": quick, "model": model_dir or ("tiny" if quick else "gpt2-small (random init)"),
        "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "rows": rows, "stats": stats,
    }


def table(result: dict[str, Any]) -> str:
    return format_table(result["rows"], [("stage", "stage"), ("median_s", "median s"),
                                         ("spread_ms", "ms median [min-max]"), ("x_sft", "x SFT step")])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.alignment", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model (seconds): the smoke test")
    parser.add_argument("--model", metavar="DIR", help="a checkpoint to use instead of a random gpt2-small")
    parser.add_argument("--batch", type=int, help="rows per step (default 2)")
    parser.add_argument("--repeats", type=int, help="timed steps per stage (default 3; quick 2)")
    parser.add_argument("--max-new-tokens", type=int, help="PPO response length cap (default 32; quick 8)")
    parser.add_argument("--data-dir", type=Path, default=SHARED_DATA, help="folder with instruction-data*.json")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    threads = pin_threads()
    result = run(args.quick, model_dir=args.model, batch=args.batch, repeats=args.repeats,
                 max_new_tokens=args.max_new_tokens, data_dir=args.data_dir)
    print(f"alignment stages: {result['model']}, {result['parameters']:,} parameters, batch {result['batch']}, "
          f"PPO {result['ppo']['max_new_tokens']} new tokens x {result['ppo']['ppo_epochs']} epochs, "
          f"{threads} thread(s)")
    print(table(result))
    if args.json:
        write_json_atomic(args.json, result)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
