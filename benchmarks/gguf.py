"""GGUF export accuracy: ``python -m benchmarks.gguf [--preset gpt2-small | --model DIR] [--json PATH]``.

A random model of the preset (GPT-2 as released: QKV bias, tied head; seed 0) with GPT-2's vocabulary is written as
GGUF at each type (f32, f16, q8_0, q4_0) and read back; for each the table gives the file size, the largest logit
error against tinygpt's float32 logits on a fixed prompt, and how many of the greedy tokens (from the same prompt)
agree before the first difference. The f32 file is also checked for an exact round trip, against transformers' GGUF
loader and, when llama-cpp-python is installed, against llama.cpp itself (logits and greedy tokens, each type).

Random weights make near-uniform logits, where a small error flips the argmax sooner than in a trained model: the
greedy agreement here is a lower bound. The GPT-2 vocabulary is read from ``$TINYGPT_GPT2_VOCAB`` or the shared
data folder (``common.shared_data_dir``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tinygpt import GPTModel, generate_greedy, get_config
from tinygpt.config import PRESETS
from tinygpt.interop.gguf import GGUF_TYPES, load_gguf, write_gguf
from tinygpt.tokenizer import gpt2_tokenizer

from .common import format_table, run_and_report, shared_data_dir

PROMPT = "The history of the printing press begins in the fifteenth century, when"


def _agreeing(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _llama_cpp(path: Path, ids: list[int], new_tokens: int, context: int) -> tuple[np.ndarray, list[int]] | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    if len(ids) + new_tokens > context:  # llama.cpp's gpt2 graph aborts past its position table
        return None
    llm = llama_cpp.Llama(str(path), n_ctx=context, logits_all=True, verbose=False, n_threads=1)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)])
    llm.reset()
    greedy = [int(t) for t, _ in zip(llm.generate(ids, temp=0.0, top_k=1), range(new_tokens))]
    return logits, greedy


def measure(preset: str, new_tokens: int, model_dir: str | None = None, prompt: str = PROMPT) -> dict[str, Any]:
    torch.manual_seed(0)
    if model_dir is not None:
        from tinygpt.interop.pretrained import load_pretrained

        model, tokenizer = load_pretrained(model_dir)
        if tokenizer is None:
            raise ValueError(f"{model_dir} has no tokenizer")
        config, preset = model.config, str(model_dir)
    else:
        vocab = os.environ.get("TINYGPT_GPT2_VOCAB") or shared_data_dir() / "gpt2"
        tokenizer = gpt2_tokenizer(vocab)
        config = get_config(preset).replace(vocab_size=tokenizer.vocab_size, qkv_bias=True, tie_weights=True)
        model = GPTModel(config).eval()
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        exact = model(torch.tensor([ids]))[0]
    ours = generate_greedy(model, torch.tensor([ids]), new_tokens)[0, len(ids):].tolist()
    rows, checks = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in GGUF_TYPES:
            path = Path(tmp) / f"{kind}.gguf"
            start = time.perf_counter()
            write_gguf(model, path, tokenizer, type=kind)
            seconds = time.perf_counter() - start
            back = load_gguf(path)[0]
            with torch.no_grad():
                logits = back(torch.tensor([ids]))[0]
            greedy = generate_greedy(back, torch.tensor([ids]), new_tokens)[0, len(ids):].tolist()
            row = {"type": kind, "file_mb": path.stat().st_size / 1e6, "write_s": seconds,
                   "max_abs_logit_error": (logits - exact).abs().max().item(),
                   "greedy_agree": _agreeing(greedy, ours), "greedy_of": new_tokens,
                   "greedy_text": tokenizer.decode(greedy)}
            if kind == "f32":
                state, again = model.state_dict(), back.state_dict()
                checks["f32_round_trip_exact"] = back.config == config and all(
                    torch.equal(state[k], again[k]) for k in state)
                checks.update(_transformers(model, path, config, ids, exact))
            cpp = _llama_cpp(path, ids, new_tokens, config.context_length)
            if cpp is not None:
                row["llama_cpp_max_abs_diff_vs_f32"] = float(np.abs(cpp[0] - exact.numpy()).max())
                row["llama_cpp_greedy_agree"] = _agreeing(cpp[1], ours)
                row["llama_cpp_greedy_text"] = tokenizer.decode(cpp[1])
            rows.append(row)
            del back
    return {"preset": preset, "config": config.to_dict(), "prompt": prompt, "prompt_tokens": len(ids),
            "tinygpt_greedy_text": tokenizer.decode(ours), "rows": rows, **checks}


def _transformers(model: GPTModel, path: Path, config: Any, ids: list[int], exact: torch.Tensor) -> dict[str, Any]:
    """transformers' GGUF loader on the f32 file against tinygpt, and against transformers on the same weights
    from a safetensors folder (``export_hf``): the second difference is what the GGUF path itself adds."""
    try:
        import transformers
    except ImportError:
        return {}
    from tinygpt.interop.hf import export_hf

    transformers.logging.set_verbosity_error()
    hf_config = transformers.GPT2Config(vocab_size=config.vocab_size, n_positions=config.context_length,
                                        n_ctx=config.context_length, n_embd=config.emb_dim, n_layer=config.n_layers,
                                        n_head=config.n_heads)
    from_gguf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  config=hf_config).eval()
    export_hf(model, path.parent / "hf")
    from_safetensors = transformers.GPT2LMHeadModel.from_pretrained(path.parent / "hf").eval()
    with torch.no_grad():
        a = from_gguf(torch.tensor([ids])).logits[0]
        b = from_safetensors(torch.tensor([ids])).logits[0]
    return {"transformers_max_abs_diff": (a - exact).abs().max().item(),
            "transformers_gguf_vs_safetensors_max_abs_diff": (a - b).abs().max().item(),
            "max_abs_logit": exact.abs().max().item()}


def table(result: dict[str, Any]) -> str:
    columns = [("type", "type"), ("file_mb", "file MB"), ("write_s", "write s"),
               ("max_abs_logit_error", "max |logit error| vs f32"), ("greedy_agree", "greedy tokens agreeing"),
               ("llama_cpp_max_abs_diff_vs_f32", "llama.cpp max |diff|"),
               ("llama_cpp_greedy_agree", "llama.cpp greedy")]
    what = "random weights, GPT-2 vocabulary" if result["preset"] in PRESETS else "trained"
    lines = [f"{result['preset']} ({what}), prompt of {result['prompt_tokens']} tokens, "
             f"{result['rows'][0]['greedy_of']} greedy tokens",
             format_table(result["rows"], columns),
             f"f32 round trip exact: {result['f32_round_trip_exact']}; transformers' GGUF loader max |diff|: "
             f"{result.get('transformers_max_abs_diff')} (max |logit| {result.get('max_abs_logit')}); the same "
             f"transformers model from safetensors vs from GGUF: "
             f"{result.get('transformers_gguf_vs_safetensors_max_abs_diff')}",
             f"greedy text: tinygpt float32 {result['tinygpt_greedy_text']!r}"]
    for row in result["rows"]:
        lines.append(f"  {row['type']}: tinygpt {row['greedy_text']!r}, llama.cpp {row.get('llama_cpp_greedy_text')!r}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-small", help="a tinygpt preset (default: gpt2-small)")
    parser.add_argument("--model", metavar="DIR", help="a trained checkpoint instead of a random --preset model")
    parser.add_argument("--prompt", default=PROMPT, help="the prompt (default: a sentence of English)")
    parser.add_argument("--new-tokens", type=int, default=20, help="greedy tokens compared (default: 20)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    return run_and_report(parser, lambda: measure(args.preset, args.new_tokens, args.model, args.prompt), table,
                          args.json)


if __name__ == "__main__":
    raise SystemExit(main())
