"""GPU benchmark: train gpt2-small in bf16 with torch.compile and flash attention, then decode with the KV cache.

    python -m benchmarks.gpu                 # CUDA: ~300 steps of gpt2-small at 16 x 1024 tokens, under 5 minutes
    python -m benchmarks.gpu --tiny          # CPU (or any device): a tiny model, a few steps, seconds

Prints training tokens/s and MFU (model FLOPs utilisation: the FLOPs the model needs, 3 x forward, divided by the
time and by the device's dense bf16 peak from ``PEAK_BF16_TFLOPS``), then cached greedy decoding tokens/s.
``--tiny`` runs the very same code path (autocast, optimizer, cache, timing) so that a GPU run is not its first run.
The data are random tokens: speed does not depend on what the tokens are.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from tinygpt import GPTConfig, GPTModel, KVCache, get_config

from .models import forward_flops

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' data sheets, TFLOP/s; first substring match wins.
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),  # SXM
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
]


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device by its name (``torch.cuda.get_device_name``); None when unknown."""
    for key, peak in PEAK_BF16_TFLOPS:
        if key in device_name:
            return peak
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _flash_only(device: torch.device):
    """Restrict SDPA to the flash kernel on CUDA (an error there, rather than a silent slower kernel)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def train(model: GPTModel, config: GPTConfig, *, batch: int, steps: int, warmup: int, device: torch.device,
          compile_model: bool) -> dict[str, Any]:
    """``warmup`` + ``steps`` AdamW steps in bf16 autocast on random tokens; timing covers ``steps`` only."""
    model.train()
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=fused)
    forward = torch.compile(model) if compile_model else model
    t = config.context_length
    generator = torch.Generator(device="cpu").manual_seed(0)
    data = torch.randint(0, config.vocab_size, (batch, t + 1), generator=generator).to(device)
    idx, targets = data[:, :-1], data[:, 1:]

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16), _flash_only(device):
            logits = forward(idx)  # [B, T, V]
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    start = time.perf_counter()
    for _ in range(warmup):
        first_loss = step()
    _sync(device)
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    _sync(device)
    elapsed = time.perf_counter() - start
    tokens = batch * t * steps
    flops = 3 * forward_flops(config, batch, t) * steps  # backward ~ 2 x forward
    return {"batch": batch, "tokens_per_step": batch * t, "steps": steps, "warmup_steps": warmup,
            "warmup_s": warmup_s, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "achieved_tflops": flops / elapsed / 1e12, "first_loss": float(first_loss), "last_loss": float(loss)}


@torch.inference_mode()
def decode_greedy(model: GPTModel, config: GPTConfig, prompt: torch.Tensor, *, new_tokens: int, dtype: torch.dtype,
                  device: torch.device, timings: dict[str, float] | None = None) -> torch.Tensor:
    """Greedy decoding with a KV cache of ``dtype``: one prefill of prompt [B, T], then one position per step.

    Returns [B, T + new_tokens]; ``timings`` (if given) receives ``prefill_s`` and ``decode_s``.
    """
    model.eval()
    batch, t = prompt.shape
    cache = KVCache(config, batch, dtype=dtype, device=device, max_length=t + new_tokens)
    ids = [prompt]
    _sync(device)
    start = time.perf_counter()
    logits = model(prompt, cache=cache, pos=0, last_only=True)  # [B, 1, V]
    next_id = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
    _sync(device)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for pos in range(t, t + new_tokens - 1):
        ids.append(next_id)
        logits = model(next_id, cache=cache, pos=pos, last_only=True)  # [B, 1, V]
        next_id = logits[:, -1].argmax(-1, keepdim=True)
    ids.append(next_id)
    _sync(device)
    if timings is not None:
        timings.update(prefill_s=prefill_s, decode_s=time.perf_counter() - start)
    return torch.cat(ids, dim=1)


def generate_cached(model: GPTModel, config: GPTConfig, *, batch: int, prompt: int, new_tokens: int,
                    device: torch.device) -> dict[str, Any]:
    """Greedy decoding speed of the bf16 model with a bf16 cache, on a random prompt of ``prompt`` tokens.

    Uses the generation engine (``tinygpt.generate``) when the installed tinygpt has it, else ``decode_greedy``.
    The prefill is timed on its own (one new token), so decode tokens/s counts the per-token steps only.
    """
    generator = torch.Generator(device="cpu").manual_seed(1)
    idx = torch.randint(0, config.vocab_size, (batch, prompt), generator=generator).to(device)
    try:
        from tinygpt import generate
    except ImportError:
        generate = None
    if generate is not None:
        def timed(n: int) -> float:
            _sync(device)
            start = time.perf_counter()
            generate(model, idx, max_new_tokens=n)
            _sync(device)
            return time.perf_counter() - start

        timed(2)  # warm-up
        prefill_s = timed(1)
        timings = {"prefill_s": prefill_s, "decode_s": max(timed(new_tokens) - prefill_s, 1e-9)}
        engine = "tinygpt.generate"
    else:
        timings = {}
        decode_greedy(model, config, idx, new_tokens=new_tokens, dtype=torch.bfloat16, device=device,
                      timings=timings)
        engine = "benchmarks.gpu.decode_greedy"
    steps = new_tokens - 1
    return {"engine": engine, "batch": batch, "prompt": prompt, "new_tokens": new_tokens, **timings,
            "decode_tokens_per_s": batch * steps / timings["decode_s"] if steps else None}


def run(*, tiny: bool, device: str | None = None, steps: int | None = None, batch: int | None = None,
        compile_model: bool | None = None, peak: float | None = None) -> dict[str, Any]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if tiny:
        config = GPTConfig(vocab_size=512, context_length=64, emb_dim=64, n_heads=4, n_layers=2,
                           qkv_bias=True, tie_weights=True)
        batch, steps, warmup = batch or 4, steps or 4, 2
        gen = dict(batch=2, prompt=16, new_tokens=16)
    else:
        config = get_config("gpt2-small", qkv_bias=True, tie_weights=True)
        batch, steps, warmup = batch or 16, steps or 300, 10  # 300 x 16k tokens: ~5e9 tokens-FLOP budget
        gen = dict(batch=1, prompt=128, new_tokens=256)
    compile_model = (dev.type == "cuda") if compile_model is None else compile_model
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        name = torch.cuda.get_device_name(dev)
    else:
        name = "cpu"
    peak = peak if peak is not None else peak_tflops(name)
    torch.manual_seed(0)
    model = GPTModel(config).to(dev)
    result: dict[str, Any] = {"device": name, "config": config.to_dict(), "compile": compile_model,
                              "peak_bf16_tflops": peak, "torch": torch.__version__}
    result["train"] = train(model, config, batch=batch, steps=steps, warmup=warmup, device=dev,
                            compile_model=compile_model)
    result["train"]["mfu"] = result["train"]["achieved_tflops"] / peak if peak else None
    model = model.to(torch.bfloat16)
    result["generate"] = generate_cached(model, config, device=dev, **gen)
    return result


def report(result: dict[str, Any]) -> str:
    tr, ge = result["train"], result["generate"]
    mfu = f"{tr['mfu']:.1%}" if tr["mfu"] is not None else "n/a (unknown peak; pass --peak-tflops)"
    return "\n".join([
        f"device {result['device']}, torch {result['torch']}, compile={result['compile']}, "
        f"bf16 peak {result['peak_bf16_tflops']} TFLOP/s",
        f"train: {tr['steps']} steps x {tr['tokens_per_step']} tokens in {tr['seconds']:.1f} s "
        f"(+{tr['warmup_s']:.1f} s warm-up/compile): {tr['tokens_per_s']:,.0f} tokens/s, "
        f"{tr['achieved_tflops']:.1f} TFLOP/s, MFU {mfu}; loss {tr['first_loss']:.3f} -> {tr['last_loss']:.3f}",
        f"generate ({ge['engine']}, bf16, KV cache, greedy): batch {ge['batch']}, prompt {ge['prompt']}, prefill "
        f"{ge['prefill_s'] * 1e3:.1f} ms, decode {ge['decode_tokens_per_s']:,.0f} tokens/s",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model and a few steps (runs on CPU)")
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--steps", type=int, help="timed training steps (default 300; --tiny: 4)")
    parser.add_argument("--batch", type=int, help="sequences per step (default 16; --tiny: 4)")
    parser.add_argument("--compile", dest="compile_model", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the model (default: on for CUDA, off for CPU)")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, if not in the table")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    for name in ("steps", "batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
    result = run(tiny=args.tiny, device=args.device, steps=args.steps, batch=args.batch,
                 compile_model=args.compile_model, peak=args.peak_tflops)
    print(report(result))
    if args.json:
        from .common import write_json_atomic

        write_json_atomic(args.json, result)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
