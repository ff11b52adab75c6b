"""A/B measurements behind the performance edits (``tinygpt.fast``, ``layers.py``): the old path vs the current one.

    python -m benchmarks.ab layernorm [--shapes 1x128,1x1024] [--repeats 7]
    python -m benchmarks.ab head [--shapes 1x128,1x1024,8x256]
    python -m benchmarks.ab onednn [--shapes 1x128,1x1024,8x256]
    python -m benchmarks.ab linear [--repeats 7]
    python -m benchmarks.ab train [--repeats 7]
    python -m benchmarks.ab trained [--repeats 7] [--products 1024x768x2304,768x128x512]
    python -m benchmarks.ab train-gpt2 [--repeats 3] [--layers 4] [--shapes 2x512]
    python -m benchmarks.ab refactor --before DIR [--after DIR] [--rounds 5] [--repeats 5] [--quick]
    python -m benchmarks.ab inference [--repeats 7] [--products 1x128x512,16x128x512,...] [--threads 1]
    python -m benchmarks.ab decode [--repeats 7] [--models char,gpt2-small] [--weights float32,bfloat16]
                                   [--rows 1,16] [--new-tokens 64] [--threads 1] [--compile] [--quick]

Each experiment swaps one piece of tinygpt back to what it was before the edit (A) and times the gpt2-small
forward, full logits, float32, inference mode, against the current code (B), interleaved A B A B after a warm-up,
with the logits compared so that the edit is also shown to preserve the result.

The old path is the fast path switched off (``tinygpt.fast.disabled``). ``head`` times the head's kernel choice
(``tinygpt.fast.head``) against a plain ``F.linear``. ``onednn`` times the forward with every product on torch's BLAS
(A: ``F.linear``, the head into 64-float-aligned rows) and on oneDNN (B: ``tinygpt.fast.linear``). ``linear`` is about
decoding, not the full forward: A multiplies one row by every weight of gpt2-small (the 48 block linears and the head)
with ``F.linear``, B with ``tinygpt.fast.linear``,
next to a plain sum over the same weights (the rate of just reading them); then a cached greedy decode (16-token
prompt, 64 new tokens) runs with oneDNN switched off (A) and on (B), the tokens compared. ``train`` times the training benchmark's step (``benchmarks.train_step``: 4 layers, 256 wide, 8 x 256
tokens, AdamW) with oneDNN off (A) and on (B: the head's logits in ``head_loss`` on oneDNN), from the same weights.
``trained`` times one trained linear's forward + backward (dL/dx, dL/dW, dL/db)
per product shape ROWSxINxOUT: A autograd's route for ``F.linear`` (BLAS), B ``fast.onednn``'s ``_TrainedLinear``
(all three products on oneDNN), with the gradients compared; its last column says which the rule
(``fast.onednn.TRAINED_MIN_MACS``) picks. ``train-gpt2`` times one AdamW training step (forward, fused loss,
backward, step) at gpt2-small's shapes (D = 768, 12 heads, V = 50257, biased QKV, tied head; ``--layers`` of its 12
blocks, B x T tokens from ``--shapes``): A with the trained-weight route switched off (``disabled("train")``: the code
before it), B as it is now, and Hugging Face's ``GPT2LMHeadModel`` from the same weights, interleaved.
``refactor`` is different: it times two checkouts against each other in child processes (``benchmarks.ab_refactor``).
``inference`` times one inference product per shape ROWSxINxOUT (no autograd), ``F.linear`` (BLAS) against
oneDNN's kernel, with the kernel the rule (``fast.onednn.INFERENCE_MIN_WEIGHT``) picks.
``decode`` times the lean decode step (``tinygpt.generate``, greedy, a 16-token prompt and ``--new-tokens`` new
tokens per row, ``--threads`` torch threads) on the default ``tinygpt train`` model's shapes ("char": V = 65,
C = 128, D = 128, 4 heads, 4 layers) and gpt2-small's, per weight type (``fast.weights``) and row count: A is the
step before it (every inference product on oneDNN, ``fast.onednn.INFERENCE_MIN_WEIGHT = 0``, and each greedy row
drawn and read back alone), B as it is now, C (``--compile``) B with ``GenerationConfig(compile=True)``, its first
call (the compile) timed apart; the tokens of every variant are compared with A's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from tinygpt import GPTConfig, GPTModel, fast, generate
from tinygpt.layers import LayerNorm, layer_norm_formula

from . import ab_refactor
from .common import format_table, parse_shapes, pin_threads, run_and_report, spread, time_interleaved
from .models import build_tinygpt, gpt2_small
from .train_step import make_step, train_config


@contextlib.contextmanager
def _layernorm_formula() -> Iterator[None]:
    """A: LayerNorm as the seven-op formula (the code before the edit)."""
    fused = LayerNorm.forward
    LayerNorm.forward = lambda self, x: layer_norm_formula(x, self.scale, self.shift, self.eps)
    try:
        yield
    finally:
        LayerNorm.forward = fused


def _plain_linear() -> contextlib.AbstractContextManager:
    """A: every product of the model on torch's BLAS through ``F.linear`` (oneDNN switched off)."""
    return fast.disabled("onednn")


def run_linear(repeats: int) -> dict[str, Any]:
    """One-row products over all of gpt2-small's weights, then a cached greedy decode, A (F.linear) vs B."""
    model = build_tinygpt(gpt2_small())
    weights = [(m.weight, m.bias) for m in model.trf_blocks.modules() if isinstance(m, torch.nn.Linear)]
    weights.append((model.out_head.weight, None))
    rows_in = [torch.randn(1, w.shape[1]) for w, _ in weights]
    rows = []
    with torch.inference_mode():
        diff = max((F.linear(x, w, b) - fast.linear(x, w, b)).abs().max().item()
                   for x, (w, b) in zip(rows_in, weights))
        products = time_interleaved(
            {"A (F.linear)": lambda: [F.linear(x, w, b) for x, (w, b) in zip(rows_in, weights)],
             "B (fast.linear)": lambda: [fast.linear(x, w, b) for x, (w, b) in zip(rows_in, weights)],
             # not a product: a sum reads every weight once, the floor for streaming them (no speed-up claimed)
             "read floor (sum)": lambda: [w.sum() for w, _ in weights]},
            warmup=2, repeats=repeats * 3)
    megabytes = sum(w.numel() * w.element_size() for w, _ in weights) / 1e6
    for name, st in products.items():
        product = name != "read floor (sum)"
        rows.append({"case": f"1-row products, {len(weights)} weights, {megabytes:.0f} MB", "variant": name, **st,
                     "time_ms": spread(st),
                     "speedup": products["A (F.linear)"]["median_s"] / st["median_s"] if product else None,
                     "rate": f"{megabytes / 1e3 / st['median_s']:.1f} GB/s", "max_abs_diff": diff if product else None})
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(5))
    new = 64
    outputs: dict[str, torch.Tensor] = {}

    def decode(name: str, swap: Callable[[], contextlib.AbstractContextManager]) -> Callable[[], None]:
        def call() -> None:
            with swap():
                outputs[name] = generate(model, prompt, max_new_tokens=new).tokens

        return call

    decodes = time_interleaved({"A (F.linear)": decode("A", _plain_linear),
                                "B (fast.linear)": decode("B", contextlib.nullcontext)},
                               warmup=1, repeats=max(2, repeats // 2))
    same = bool(torch.equal(outputs["A"], outputs["B"]))
    for name, st in decodes.items():
        rows.append({"case": f"cached greedy decode 1x16+{new}", "variant": name, **st, "time_ms": spread(st),
                     "speedup": decodes["A (F.linear)"]["median_s"] / st["median_s"],
                     "rate": f"{new / st['median_s']:.1f} tok/s", "max_abs_diff": "tokens equal" if same else "DIFFER"})
    return {"experiment": "linear", "repeats": repeats, "rows": rows}


def run_train(repeats: int) -> dict[str, Any]:
    """The training step of ``benchmarks.train_step`` with every product on torch's BLAS (A) and as it is (B)."""
    config = train_config(quick=False)
    torch.manual_seed(0)
    models = {"A": GPTModel(config), "B": GPTModel(config)}
    models["B"].load_state_dict(models["A"].state_dict())
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, config.vocab_size, (8, config.context_length + 1), generator=generator)
    idx, targets = tokens[:, :-1], tokens[:, 1:]
    steps = {name: make_step(model, idx, targets) for name, model in models.items()}
    losses: dict[str, list[float]] = {"A": [], "B": []}

    def timed(name: str, swap: Callable[[], contextlib.AbstractContextManager]) -> Callable[[], None]:
        def call() -> None:
            with swap():
                losses[name].append(steps[name]())

        return call

    stats = time_interleaved({"A (BLAS)": timed("A", _plain_linear), "B (now)": timed("B", contextlib.nullcontext)},
                             warmup=1, repeats=repeats)
    diff = max(abs(a - b) for a, b in zip(losses["A"], losses["B"]))
    rows = [{"case": f"train step 8x{config.context_length}, 4x256", "variant": name, **st, "time_ms": spread(st),
             "speedup": stats["A (BLAS)"]["median_s"] / st["median_s"],
             "rate": f"{8 * config.context_length / st['median_s']:.0f} tok/s",
             "max_abs_diff": f"losses within {diff:.1e}"} for name, st in stats.items()]
    return {"experiment": "train", "repeats": repeats, "rows": rows}


# gpt2-small's four block products at 1,024 rows, then nanoGPT's shakespeare-char CPU recipe's (12 x 64 rows, D=128)
TRAINED_PRODUCTS = "1024x768x2304,1024x768x768,1024x768x3072,1024x3072x768,768x128x384,768x128x128,768x128x512,768x512x128"


def parse_products(text: str) -> list[tuple[int, int, int]]:
    """``"1024x768x2304,..."`` -> [(rows, in, out), ...]."""
    try:
        products = [tuple(int(n) for n in part.split("x")) for part in text.split(",")]
    except ValueError:
        products = []
    if not products or any(len(p) != 3 or min(p) < 1 for p in products):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated ROWSxINxOUT, e.g. 1024x768x2304")
    return products  # type: ignore[return-value]


# The default ``tinygpt train`` model's weights (128 x 384 .. 512 x 128, its 65-wide head), a middle size, then
# gpt2-small's, at 1, 16 and 128 rows
INFERENCE_PRODUCTS = ",".join(f"{rows}x{shape}" for shape in ("128x384", "128x512", "512x128", "128x65", "256x1024",
                                                              "768x768", "768x2304", "768x3072", "3072x768")
                              for rows in (1, 16, 128))


def run_inference_products(repeats: int, products: list[tuple[int, int, int]]) -> dict[str, Any]:
    """One inference product per shape: F.linear (A) against oneDNN (B), and which one the rule takes."""
    from tinygpt.fast import onednn

    if not onednn.available():
        raise SystemExit("this torch has no oneDNN linear kernel: nothing to compare")
    rows = []
    for n, d_in, d_out in products:
        generator = torch.Generator().manual_seed(6)
        x, weight = torch.randn(n, d_in, generator=generator), torch.randn(d_out, d_in, generator=generator)
        bias = torch.randn(d_out, generator=generator)
        calls = max(1, int(2e7 // (n * d_in * d_out)))  # about 20 M multiply-adds per timed call

        def timed(product: Callable[..., torch.Tensor]) -> Callable[[], None]:
            def call() -> None:
                for _ in range(calls):
                    product(x, weight, bias)

            return call

        with torch.inference_mode():
            diff = float((F.linear(x, weight, bias) - onednn.onednn_linear(x, weight, bias)).abs().max())
            stats = time_interleaved({"A (F.linear)": timed(F.linear), "B (oneDNN)": timed(onednn.onednn_linear)},
                                     warmup=1, repeats=repeats)
        taken = weight.numel() >= onednn.INFERENCE_MIN_WEIGHT
        for name, st in stats.items():
            rows.append({"case": f"{n}x{d_in}x{d_out}", "variant": name, **st,
                         "time_ms": f"{st['median_s'] / calls * 1e6:.1f} us", "speedup":
                         stats["A (F.linear)"]["median_s"] / st["median_s"], "max_abs_diff": f"{diff:.1e}",
                         "rule": "oneDNN" if taken else "F.linear"})
    return {"experiment": "inference", "repeats": repeats, "threads": torch.get_num_threads(), "rows": rows}


def run_trained(repeats: int, products: list[tuple[int, int, int]]) -> dict[str, Any]:
    """Forward + backward of one trained linear, F.linear's autograd (A) against ``_TrainedLinear`` on oneDNN (B)."""
    from tinygpt.fast import onednn

    if not onednn.available():
        raise SystemExit("this torch has no oneDNN linear kernel: nothing to compare")
    rows = []
    for n, d_in, d_out in products:
        generator = torch.Generator().manual_seed(6)
        x = torch.randn(n, d_in, generator=generator).requires_grad_()
        weight = (torch.randn(d_out, d_in, generator=generator) * 0.02).requires_grad_()
        bias = torch.zeros(d_out).requires_grad_()
        grad_out = torch.randn(n, d_out, generator=generator)
        grads = {}

        def step(name: str, forward: Callable[[], torch.Tensor]) -> Callable[[], None]:
            def call() -> None:
                x.grad = weight.grad = bias.grad = None
                forward().backward(grad_out)
                grads[name] = (x.grad, weight.grad, bias.grad)

            return call

        stats = time_interleaved({
            "A (F.linear)": step("A", lambda: F.linear(x, weight, bias)),
            "B (oneDNN)": step("B", lambda: onednn._TrainedLinear.apply(x, weight, bias, onednn.onednn_linear)),
        }, warmup=1, repeats=repeats)
        diff = max(float((a - b).abs().max()) for a, b in zip(grads["A"], grads["B"]))
        taken = n * d_in * d_out >= onednn.TRAINED_MIN_MACS
        for name, st in stats.items():
            rows.append({"case": f"{n}x{d_in}x{d_out}", "variant": name, **st, "time_ms": spread(st),
                         "speedup": stats["A (F.linear)"]["median_s"] / st["median_s"],
                         "min_speedup": stats["A (F.linear)"]["min_s"] / st["min_s"],
                         "max_abs_diff": f"grads within {diff:.1e}", "rule": "oneDNN" if taken else "F.linear"})
    return {"experiment": "trained", "repeats": repeats, "rows": rows}


def run_train_gpt2(repeats: int, layers: int, shape: tuple[int, int]) -> dict[str, Any]:
    """One training step at gpt2-small's shapes: before the trained-weight route (A), now (B), Hugging Face."""
    from .models import available, build_hf

    config = gpt2_small().replace(n_layers=layers, context_length=max(shape[1], 1))
    batch, tokens = shape
    generator = torch.Generator().manual_seed(3)
    data = torch.randint(0, config.vocab_size, (batch, tokens + 1), generator=generator)
    idx, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    torch.manual_seed(0)
    models = {"A": GPTModel(config), "B": GPTModel(config)}
    models["B"].load_state_dict(models["A"].state_dict())
    steps = {"A (before: F.linear)": make_step(models["A"], idx, targets),
             "B (now: oneDNN route)": make_step(models["B"], idx, targets)}
    if available("hf"):
        steps["Hugging Face GPT2LMHeadModel"] = make_step(build_hf(config, models["A"]), idx, targets)
    before = steps["A (before: F.linear)"]

    def a() -> float:
        with fast.disabled("train"):
            return before()

    timed = {**steps, "A (before: F.linear)": a}
    losses = {name: fn() for name, fn in timed.items()}  # also the warm-up step
    stats = time_interleaved(timed, warmup=0, repeats=repeats)
    base = stats["A (before: F.linear)"]["median_s"]
    rows = [{"case": f"train step {batch}x{tokens}, {layers} gpt2-small blocks", "variant": name, **st,
             "time_ms": spread(st), "speedup": base / st["median_s"], "rate": f"{batch * tokens / st['median_s']:.0f} tok/s",
             "max_abs_diff": f"first loss {losses[name]:.5f}"} for name, st in stats.items()]
    return {"experiment": "train-gpt2", "repeats": repeats, "rows": rows}


# The default ``tinygpt train`` model (training.options.DEFAULT_MODEL) on tinyshakespeare's 65 characters
CHAR_MODEL = GPTConfig(vocab_size=65, context_length=128, emb_dim=128, n_heads=4, n_layers=4, drop_rate=0.0)


@contextlib.contextmanager
def _decode_before() -> Iterator[None]:
    """A: the decode step before the lean one: oneDNN for every inference product, greedy rows drawn one by one."""
    from tinygpt.fast import onednn
    from tinygpt.inference import engine

    saved = onednn.INFERENCE_MIN_WEIGHT, engine._draws_greedy
    onednn.INFERENCE_MIN_WEIGHT, engine._draws_greedy = 0, lambda row, n: False
    try:
        yield
    finally:
        onednn.INFERENCE_MIN_WEIGHT, engine._draws_greedy = saved


def run_decode(repeats: int, models: Sequence[str], weights: Sequence[str], row_counts: Sequence[int], new: int,
               *, compile: bool = False, quick: bool = False) -> dict[str, Any]:
    """Greedy decode tok/s, A (before the lean step) against B (now) and C (B compiled), per model/weights/rows."""
    import time

    from tinygpt.fast.weights import convert_weights

    configs = {"char": CHAR_MODEL, "gpt2-small": gpt2_small()}
    rows = []
    for name in models:
        config = configs[name] if not quick else CHAR_MODEL.replace(n_layers=1, emb_dim=32)
        for weight_type in weights:
            model = build_tinygpt(config)
            convert_weights(model, weight_type)
            for count in row_counts:
                generator = torch.Generator().manual_seed(5)
                prompts = torch.randint(0, config.vocab_size, (count, 16), generator=generator).tolist()
                steps = min(new, config.context_length - 16)
                outputs: dict[str, torch.Tensor] = {}

                def decode(variant: str, swap: Callable[[], contextlib.AbstractContextManager],
                           compiled: GPTModel | None = None) -> Callable[[], None]:
                    def call() -> None:
                        with swap():
                            outputs[variant] = generate(compiled or model, prompts, max_new_tokens=steps,
                                                        compile=compiled is not None).tokens

                    return call

                variants = {"A (before)": decode("A", _decode_before), "B (lean step)": decode("B", contextlib.nullcontext)}
                start_up = None
                if compile:
                    # its own copy (the same weights): compiling lays bf16 weights out plain (``plain_weights``)
                    twin = build_tinygpt(config)
                    convert_weights(twin, weight_type)
                    variants["C (lean + compile)"] = decode("C", contextlib.nullcontext, compiled=twin)
                    start = time.perf_counter()
                    variants["C (lean + compile)"]()
                    start_up = time.perf_counter() - start
                stats = time_interleaved(variants, warmup=1, repeats=repeats)
                for variant, st in stats.items():
                    same = torch.equal(outputs[variant[0]], outputs["A"])
                    rows.append({"case": f"{name} {weight_type} {count}x16+{steps}", "variant": variant, **st,
                                 "time_ms": spread(st), "rate": f"{count * steps / st['median_s']:.0f} tok/s",
                                 "speedup": stats["A (before)"]["median_s"] / st["median_s"],
                                 "max_abs_diff": "tokens equal" if same else "DIFFER",
                                 "start_up_s": f"{start_up:.1f}" if variant.startswith("C") else ""})
    return {"experiment": "decode", "repeats": repeats, "threads": torch.get_num_threads(), "rows": rows}


def run(experiment: str, shapes: list[tuple[int, int]], repeats: int) -> dict[str, Any]:
    config = gpt2_small()
    model = build_tinygpt(config)
    old = {"layernorm": _layernorm_formula, "onednn": _plain_linear, "head": lambda: fast.disabled("head")}[experiment]
    rows = []
    for batch, tokens in shapes:
        idx = torch.randint(0, config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(5))

        def a() -> torch.Tensor:
            with old():
                return model(idx)

        with torch.inference_mode():
            diff = (a() - model(idx)).abs().max().item()
            stats = time_interleaved({"A (before)": a, "B (now)": lambda: model(idx)}, warmup=1, repeats=repeats)
        for name, s in stats.items():
            rows.append({"shape": f"{batch}x{tokens}", "variant": name, **s, "time_ms": spread(s),
                         "speedup": stats["A (before)"]["median_s"] / s["median_s"], "max_abs_logit_diff": diff})
    return {"experiment": experiment, "repeats": repeats, "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=["layernorm", "head", "onednn", "linear", "train", "trained",
                                                         "train-gpt2", "refactor", "decode", "inference"])
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="comma-separated BxT (default: 1x128,1x1024,8x256; train-gpt2: 2x512)")
    parser.add_argument("--layers", type=int, default=4, help="train-gpt2: gpt2-small blocks (default: 4)")
    parser.add_argument("--products", type=parse_products, default=None,
                        help="trained, inference: comma-separated ROWSxINxOUT (default: gpt2-small's and the small "
                             "models')")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7; refactor: 5 per child)")
    parser.add_argument("--before", metavar="DIR", help="refactor: the checkout before the change")
    parser.add_argument("--after", metavar="DIR", default=str(Path(__file__).resolve().parents[1]),
                        help="refactor: the checkout after it (default: this one)")
    parser.add_argument("--rounds", type=int, default=5, help="refactor: child processes per checkout")
    parser.add_argument("--quick", action="store_true", help="refactor, decode: tiny models, to check the script works")
    parser.add_argument("--models", default="char,gpt2-small", help="decode: char and/or gpt2-small")
    parser.add_argument("--weights", default="float32,bfloat16", help="decode: weight types (fast.weights)")
    parser.add_argument("--rows", default="1,16", help="decode: rows decoded at once, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=64, help="decode: new tokens per row")
    parser.add_argument("--threads", type=int, default=1, help="decode, inference: torch threads")
    parser.add_argument("--compile", action="store_true", help="decode: also time C, the lean step compiled")
    parser.add_argument("--json", metavar="PATH", help="refactor: write the result here")
    args = parser.parse_args(argv)
    shapes = args.shapes
    if args.experiment == "refactor":
        if not args.before:
            parser.error("refactor needs --before DIR (a checkout of tinygpt before the change)")
        return run_and_report(parser, lambda: ab_refactor.run(
            args.before, args.after, shapes or parse_shapes("1x128,1x1024,8x256"), rounds=args.rounds, repeats=args.repeats or 5, quick=args.quick),
            ab_refactor.table, args.json, failed=lambda result: not all(r["identical"] for r in result["rows"]))
    args.repeats = args.repeats or 7
    if args.experiment == "decode":
        torch.set_num_threads(args.threads)
        models, weights = args.models.split(","), args.weights.split(",")
        bad = [m for m in models if m not in ("char", "gpt2-small")]
        if bad:
            parser.error(f"--models: {bad[0]!r} is not one of char, gpt2-small")
        try:
            row_counts = [int(n) for n in args.rows.split(",")]
        except ValueError:
            row_counts = [0]
        if min(row_counts) < 1:
            parser.error(f"--rows {args.rows!r}: expected comma-separated integers >= 1")
        result = run_decode(args.repeats, models, weights, row_counts, args.new_tokens, compile=args.compile,
                            quick=args.quick)
        print(f"{result['threads']} thread(s), {args.repeats} interleaved rounds; load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(format_table(result["rows"], [("case", "case"), ("variant", "variant"), ("time_ms", "ms median [min-max]"),
                                            ("rate", "rate"), ("speedup", "speedup vs A"), ("max_abs_diff", "tokens"),
                                            ("start_up_s", "compile s")]))
        return 0
    pin_threads()
    if args.experiment == "inference":
        torch.set_num_threads(args.threads)
        result = run_inference_products(args.repeats, args.products or parse_products(INFERENCE_PRODUCTS))
        print(f"{result['threads']} thread(s); load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(format_table(result["rows"], [("case", "rows x in x out"), ("variant", "variant"),
                                            ("time_ms", "per product (median)"), ("speedup", "speedup vs A"),
                                            ("max_abs_diff", "|A-B|"), ("rule", "the rule takes")]))
        return 0
    if args.experiment == "trained":
        result = run_trained(args.repeats, args.products or parse_products(TRAINED_PRODUCTS))
        print(format_table(result["rows"], [("case", "rows x in x out"), ("variant", "variant"),
                                            ("time_ms", "ms median [min-max]"), ("speedup", "speedup vs A"),
                                            ("min_speedup", "speedup of the minima"), ("max_abs_diff", "|A-B|"),
                                            ("rule", "the rule takes")]))
        return 0
    if args.experiment == "train-gpt2":
        result = run_train_gpt2(args.repeats, args.layers, shapes[0] if shapes else (2, 512))
        print(format_table(result["rows"], [("case", "case"), ("variant", "variant"), ("time_ms", "ms median [min-max]"),
                                            ("rate", "rate"), ("speedup", "speedup vs A"),
                                            ("max_abs_diff", "loss")]))
        return 0
    if args.experiment in ("linear", "train"):
        result = (run_linear if args.experiment == "linear" else run_train)(args.repeats)
        columns = [("case", "case"), ("variant", "variant"), ("time_ms", "ms median [min-max]"), ("rate", "rate"),
                   ("speedup", "speedup vs A"), ("max_abs_diff", "max |diff| A-B")]
        print(format_table(result["rows"], columns))
        return 0
    result = run(args.experiment, shapes or parse_shapes("1x128,1x1024,8x256"), args.repeats)
    print(format_table(result["rows"], [("shape", "B x T"), ("variant", "variant"), ("time_ms", "ms median [min-max]"),
                                        ("speedup", "speedup vs A"), ("max_abs_logit_diff", "max |dlogit| A-B")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
