"""Where the parameters and the training memory of each preset go (the chapter's counts; the block lesson's exercise 1).

Parameter counts come from ``count_parameters`` (the formula N = 2VD + CD + L(12D^2 + 10D) + 2D and its breakdown),
so no tensor is allocated. Memory for training with AdamW, per parameter: the weight, its gradient, and AdamW's two
moment tensors (``exp_avg``, ``exp_avg_sq``, kept in the parameter's dtype by ``torch.optim.AdamW``): 4 copies, i.e.
16 bytes at float32 and 8 bytes at bfloat16 (activations, which depend on batch and sequence length, are not
counted). In LLMs-from-scratch's chapter 4 each block also holds its causal mask as a buffer, C*C float32 values: not a
parameter, but memory (the chapter notes it), and the table shows what those cost; tinygpt keeps none (it builds a mask per
call, for the call's positions, and only where a plain causal attention does not do).

Savings: tying the head to the token embedding removes V*D. Bias-free linears (block lesson, exercise 1: ``bias=False``
on every linear of the block, as modern open-weight LLMs do) remove, per block, the fused QKV bias ((H + 2Hkv)hd =
3D without GQA, only where ``qkv_bias`` is set) + D (attention output projection) + gF + D (the FFN's linears, g = 2
for SwiGLU, F = 4D for GPT-2); the head already has no bias. The config's ``bias=False`` switch goes further and also
drops the LayerNorm shifts; that saving is read from ``count_parameters``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from ..config import PRESETS, GPTConfig, get_config
from ..params import count_parameters
from .report import ExperimentReport, check_seed, finish, format_table, new_figure, output_dir

PARTS = ("embeddings", "attention", "feed_forward", "norms", "head")
BYTES = {"float32": 4, "bfloat16": 2}


def resolve_config(name_or_file: str | GPTConfig) -> tuple[str, GPTConfig]:
    """A preset name, a config ``.json`` file or a ``GPTConfig`` -> (label, config)."""
    if isinstance(name_or_file, GPTConfig):
        return "custom", name_or_file
    if not isinstance(name_or_file, str):
        raise TypeError(f"config must be a preset name, a .json path or a GPTConfig, got {type(name_or_file).__name__}")
    if name_or_file.endswith(".json"):
        return Path(name_or_file).stem, GPTConfig.from_file(name_or_file)
    return name_or_file, get_config(name_or_file)


def linear_bias_parameters(config: GPTConfig) -> int:
    """Bias parameters of the linears in all blocks: L * ([qkv_bias](H + 2Hkv)hd + [bias](D + gF + D))."""
    d = config.emb_dim
    qkv = (config.n_heads + 2 * config.kv_heads) * config.head_dim if config.qkv_bias else 0
    gates = 2 if config.ffn == "swiglu" else 1
    others = d + gates * config.ffn_dim + d if config.bias else 0
    return config.n_layers * (qkv + others)


def anatomy(config: GPTConfig) -> dict:
    """Parameter split, per-block ratio, training memory and the two savings of one config."""
    counts = count_parameters(config)
    parts = {part: getattr(counts, part) for part in PARTS}
    memory = {}
    for dtype, size in BYTES.items():
        weights = counts.total * size
        memory[dtype] = {"weights": weights, "gradients": weights, "adamw_state": 2 * weights,
                         "total": 4 * weights}
    untied = config.replace(tie_weights=False)
    return {
        "config": config.to_dict(),
        "parameters": parts,
        "total": counts.total,
        "per_block": {"attention": counts.attention_per_block, "feed_forward": counts.feed_forward_per_block,
                      "norms": counts.norms_per_block,
                      "feed_forward_over_attention": counts.feed_forward_per_block / counts.attention_per_block},
        "memory_bytes": memory,
        "upstream_mask_bytes": 4 * config.n_layers * config.context_length**2,
        "saving_tie_weights": count_parameters(untied).total - count_parameters(untied.replace(tie_weights=True)).total,
        "saving_bias_free_linears": linear_bias_parameters(config),
        "saving_bias_switch_off": counts.total - count_parameters(config.replace(bias=False, qkv_bias=False)).total,
    }


def human_bytes(n: int) -> str:
    """Binary units: 1536 -> '1.5 KiB'."""
    if n < 1024:
        return f"{n} B"
    exponent = min(3, int(math.log(n, 1024)))
    return f"{n / 1024**exponent:.2f} {('KiB', 'MiB', 'GiB')[exponent - 1]}"


def run_anatomy(out: str | Path | None = None, seed: int = 123,
                configs: Sequence[str | GPTConfig] | None = None) -> ExperimentReport:
    """The anatomy of every preset (or of ``configs``: preset names, .json files or GPTConfigs).

    Nothing here is random; ``seed`` is accepted for a uniform interface and recorded."""
    check_seed(seed)
    directory = output_dir("anatomy", out)
    labelled = [resolve_config(c) for c in (configs if configs is not None else list(PRESETS))]
    if not labelled:
        raise ValueError("configs is empty: give at least one preset name or config file")
    results = {label: anatomy(config) for label, config in labelled}

    split_rows, memory_rows, saving_rows = [], [], []
    for label, r in results.items():
        c, total = r["config"], r["total"]
        split_rows.append([label, f"{c['emb_dim']}/{c['n_heads']}/{c['n_layers']}", total,
                           *(f"{100 * r['parameters'][p] / total:.2f}%" for p in PARTS),
                           f"{r['per_block']['feed_forward_over_attention']:.2f}"])
        m32, m16 = r["memory_bytes"]["float32"], r["memory_bytes"]["bfloat16"]
        memory_rows.append([label, *(human_bytes(m32[k]) for k in ("weights", "gradients", "adamw_state", "total")),
                            human_bytes(m16["total"]), human_bytes(r["upstream_mask_bytes"])])
        saving_rows.append([label, r["saving_tie_weights"], f"{100 * r['saving_tie_weights'] / total:.1f}%",
                            r["saving_bias_free_linears"], f"{100 * r['saving_bias_free_linears'] / total:.3f}%",
                            r["saving_bias_switch_off"]])
    split_table = format_table(["config", "D/H/L", "parameters", "embeddings", "attention", "feed-forward", "norms",
                                "head", "FFN/attn per block"], split_rows)
    memory_table = format_table(["config", "fp32 weights", "fp32 grads", "fp32 AdamW state", "fp32 total",
                                 "bf16 total", "upstream's fp32 masks"], memory_rows)
    saving_table = format_table(["config", "tying saves", "of total", "bias-free linears save", "of total",
                                 "bias=False, qkv_bias=False save"], saving_rows)

    exercise = GPTConfig(vocab_size=50257, context_length=1024, emb_dim=768, n_heads=12, n_layers=12)
    ex_plain = linear_bias_parameters(exercise)
    ex_qkv = linear_bias_parameters(exercise.replace(qkv_bias=True))
    ex_switch = count_parameters(exercise).total - count_parameters(exercise.replace(bias=False)).total
    ffn_ratios = sorted({round(r["per_block"]["feed_forward_over_attention"], 2) for r in results.values()})
    findings = [
        f"feed-forward / attention parameters per block: {', '.join(map(str, ffn_ratios))}; for GPT-2 blocks "
        "(8D^2 + 5D) / (4D^2 + D) -> 2 as D grows",
        "training memory with AdamW = 4 copies of the parameters (weight, gradient, two moments): 16 bytes each at "
        "float32, 8 at bfloat16; activations not included",
        f"the block lesson's exercise 1 (12 layers x 768): bias-free linears save L * 6D = {ex_plain:,} parameters with "
        "tinygpt's "
        f"default bias-free QKV, or L * 9D = {ex_qkv:,} when the QKV projection has a bias (GPT-2 as released); "
        f"computed from the formula; the config's bias=False switch also drops the LayerNorm shifts: "
        f"{ex_switch:,} in all",
        f"tying the head saves V*D = {exercise.vocab_size * exercise.emb_dim:,} at that size: "
        f"{exercise.vocab_size * exercise.emb_dim / ex_plain:,.0f}x the bias-free saving",
    ]

    labels = list(results)
    fig = new_figure(max(7.0, 1.6 * len(labels) + 2), 4.8)
    ax = fig.add_subplot()
    bottoms = [0.0] * len(labels)
    colors = {"embeddings": "#4c72b0", "attention": "#dd8452", "feed_forward": "#55a868", "norms": "#c44e52",
              "head": "#8172b3"}
    for part in PARTS:
        shares = [100 * results[lab]["parameters"][part] / results[lab]["total"] for lab in labels]
        ax.bar(labels, shares, bottom=bottoms, label=part.replace("_", "-"), color=colors[part])
        bottoms = [b + s for b, s in zip(bottoms, shares)]
    for i, lab in enumerate(labels):
        ax.text(i, 101, f"{results[lab]['total'] / 1e6:,.1f}M" if results[lab]["total"] >= 1e5
                else f"{results[lab]['total']:,}", ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, 110)
    ax.set_xlabel("config")
    ax.set_ylabel("% of parameters")
    ax.set_title("Where the parameters are (total above each bar; untied head, no QKV bias unless configured)")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)

    data = {"seed": seed, "configs": results,
            "exercise_12x768": {"bias_free_saving_no_qkv_bias": ex_plain, "bias_free_saving_with_qkv_bias": ex_qkv,
                                "formula": "L * (D + 4D + D + [qkv_bias] 3D)",
                                "bias_switch_off_saving": ex_switch}}
    return finish("anatomy", directory, "Parameter anatomy, training memory and savings",
                  [split_table, memory_table, saving_table], data, findings, {"anatomy": fig})
