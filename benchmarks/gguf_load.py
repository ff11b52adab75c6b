"""Loading a GGUF into the small weight types: ``python -m benchmarks.gguf_load [--preset gpt2-small] [--repeats 2]``.

Peak memory. A random model of the preset (GPT-2 as released: QKV bias, tied head) is written once as an f16 and a
q8_0 GGUF; each way of loading runs in a fresh subprocess (interleaved, ``--repeats`` rounds) that first loads a tiny
GGUF the same way (the code's one-time costs: imports, torch's first module build), resets its high-water mark
(``/proc/self/clear_refs``) and reports how far ``VmHWM`` rose over ``VmRSS`` while loading -- what the weights
cost. (Not ``ru_maxrss``: Linux carries it across fork + exec, so it would report the parent's size.)

- ``float32``: ``load_gguf(f16 file)``, the float32 model;
- ``float32 -> bfloat16`` / ``float32 -> int8``: that, then ``convert_weights`` (the route before the direct read);
- ``direct bfloat16`` / ``direct int8``: ``load_gguf(file, weights=...)`` (``interop.gguf_weights``), from the f16
  file and from the q8_0 file.

The headline is the rise over the float32 model's bytes: under 1.0 means no float32 copy of the model was held.

``--products``: one-row products (decode) at the preset's block shapes, the time per block's four linears:
float32 ``F.linear``; ``Int8Linear`` (per-row scales, what ``--weights int8`` reads a q8_0 file into); and the two
exact q8_0 products (per-block scales) stock torch offers: the blocks dequantised into float32 a few rows at a time,
then ``F.linear``; and the int8 value split into two 4-bit halves for ``_weight_int4pack_mm_for_cpu`` (float32
input: exact per-block scales). Interleaved rounds, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .common import format_table, write_json_atomic

_WRITE = r"""
import sys, torch
from tinygpt import GPTModel, get_config
from tinygpt.interop.gguf import write_gguf
from tinygpt.tokenizer import CharTokenizer
torch.manual_seed(0)
preset, folder = sys.argv[1], sys.argv[2]
with torch.no_grad():
    model = GPTModel(get_config(preset, qkv_bias=True, tie_weights=True)).eval()
    for kind in ("f16", "q8_0"):
        write_gguf(model, f"{folder}/model-{kind}.gguf", type=kind)
    write_gguf(GPTModel(get_config("tiny")).eval(), f"{folder}/tiny.gguf", type="f16")
    print(sum(p.numel() * p.element_size() for p in model.parameters()))  # the float32 model, tied head once
"""

_CHILD = r"""
import json, sys, torch
torch.set_num_threads(1)
from tinygpt.fast.weights import convert_weights
from tinygpt.interop.gguf import load_gguf
how, folder = sys.argv[1], sys.argv[2]
def load(path):
    if how.startswith("direct "):
        return load_gguf(path, weights=how.split()[1])[0]
    model = load_gguf(path)[0]
    if "->" in how:
        convert_weights(model, how.split()[-1])
    return model
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
load(folder + "/tiny.gguf")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
model = load(folder + ("/model-q8_0.gguf" if how.endswith("int8") else "/model-f16.gguf"))
print(json.dumps({"rise": status("VmHWM:") - before}))
"""

WAYS = ("float32", "float32 -> bfloat16", "direct bfloat16", "float32 -> int8", "direct int8")


def _rise(how: str, folder: str) -> int:
    out = subprocess.run([sys.executable, "-c", _CHILD, how, folder], check=True, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])["rise"]


def peak_memory(preset: str, repeats: int) -> dict[str, Any]:
    if not sys.platform.startswith("linux"):
        raise ValueError("the peak-memory figures read /proc/self/status: Linux only")
    with tempfile.TemporaryDirectory(prefix="tinygpt-gguf-load-") as folder:
        out = subprocess.run([sys.executable, "-c", _WRITE, preset, folder], check=True, capture_output=True,
                             text=True)
        float32_bytes = int(out.stdout.strip().splitlines()[-1])
        files = {kind: (Path(folder) / f"model-{kind}.gguf").stat().st_size for kind in ("f16", "q8_0")}
        samples: dict[str, list[int]] = {how: [] for how in WAYS}
        for _ in range(repeats):
            for how in WAYS:
                samples[how].append(_rise(how, folder))
    rows = [{"way": how, "file": "q8_0" if how.endswith("int8") else "f16",
             "rise_mib": statistics.median(samples[how]) / 2**20,
             "of_float32": statistics.median(samples[how]) / float32_bytes,
             "samples_mib": [s / 2**20 for s in samples[how]]} for how in WAYS]
    return {"preset": preset, "repeats": repeats, "float32_mib": float32_bytes / 2**20,
            "file_mib": {k: v / 2**20 for k, v in files.items()}, "rows": rows, "load_average": os.getloadavg()}


def products(preset: str, repeats: int) -> dict[str, Any]:
    """Median ms of one block's four one-row products, per way (see the module docstring)."""
    import time

    import torch
    import torch.nn.functional as F

    from tinygpt import get_config
    from tinygpt.fast.weights import Int8Linear

    torch.set_num_threads(1)
    config = get_config(preset)
    d, f = config.emb_dim, config.ffn_dim
    shapes = [(3 * d, d), (d, d), (f, d), (d, f)]  # qkv, out_proj, up, down: [out, in]
    g = torch.Generator().manual_seed(0)
    layers = []
    for out, inp in shapes:
        w = torch.randn(out, inp, generator=g) * 0.02
        scale = (w.view(out, -1, 32).abs().amax(-1) / 127).half().float()  # q8_0's f16 block scales [out, in/32]
        q = torch.round(w.view(out, -1, 32) / scale[..., None]).clamp(-127, 127).to(torch.int8).view(out, inp)
        lo, hi = (q.int() & 15), (q.int() >> 4) + 8  # q = 16 * (hi - 8) + lo, both nibbles in [0, 15]
        st = scale.t().contiguous()  # [in/32, out]
        layers.append(dict(
            w=w, int8=Int8Linear(w), q=q, scale=scale, x=torch.randn(1, inp, generator=g),
            int4=(torch.ops.aten._convert_weight_to_int4pack_for_cpu(lo, 1),
                  torch.stack((st, 8 * st), -1).contiguous(),  # (lo - 8) * s + 8 s = lo * s
                  torch.ops.aten._convert_weight_to_int4pack_for_cpu(hi, 1),
                  torch.stack((16 * st, torch.zeros_like(st)), -1).contiguous())))  # (hi - 8) * 16 s

    def blocks_dequantised(layer: dict[str, Any]) -> torch.Tensor:
        q, scale, x = layer["q"], layer["scale"], layer["x"]
        out = torch.empty(1, q.shape[0])
        for i in range(0, q.shape[0], 256):
            w = (q[i:i + 256].float().view(-1, scale.shape[1], 32) * scale[i:i + 256, :, None]).view(-1, q.shape[1])
            out[:, i:i + 256] = F.linear(x, w)
        return out

    def int4_pair(layer: dict[str, Any]) -> torch.Tensor:
        lo, lo_sz, hi, hi_sz = layer["int4"]
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        return mm(layer["x"], lo, 32, lo_sz) + mm(layer["x"], hi, 32, hi_sz)

    ways = {"float32 F.linear": lambda L: F.linear(L["x"], L["w"]), "Int8Linear (per row)": lambda L: L["int8"](L["x"]),
            "q8_0 exact: blocks dequantised": blocks_dequantised, "q8_0 exact: two int4 kernels": int4_pair}
    check = layers[0]
    exact = check["x"].double() @ (check["q"].double().view(check["q"].shape[0], -1, 32)
                                   * check["scale"].double()[..., None]).view(check["q"].shape).T
    errors = {name: float((way(check).double() - exact).abs().max()) for name, way in ways.items()}
    times: dict[str, list[float]] = {name: [] for name in ways}
    with torch.inference_mode():
        for _ in range(repeats):
            for name, way in ways.items():
                start = time.perf_counter()
                for _ in range(10):
                    for layer in layers:
                        way(layer)
                times[name].append((time.perf_counter() - start) / 10 * 1e3)
    base = statistics.median(times["Int8Linear (per row)"])
    rows = [{"way": name, "ms_per_block": statistics.median(times[name]),
             "of_int8": statistics.median(times[name]) / base, "max_err_vs_q8_0": errors[name]} for name in ways]
    return {"preset": preset, "repeats": repeats, "rows": rows, "load_average": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gguf_load", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-small", help="a model preset (default: gpt2-small)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default: 2; --products: 7)")
    parser.add_argument("--products", action="store_true", help="time the one-row products instead (see above)")
    parser.add_argument("--json", default=None, help="where to write the JSON (default: benchmarks/results/...)")
    args = parser.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (7 if args.products else 2)
    if repeats < 1:
        parser.error(f"--repeats {repeats} must be at least 1")
    try:
        if args.products:
            result = products(args.preset, repeats)
            print(f"{args.preset}: one-row products of one block's four linears, median of {result['repeats']} "
                  f"rounds; load average {result['load_average'][0]:.2f}")
            print(format_table(result["rows"], [("way", "way"), ("ms_per_block", "ms"), ("of_int8", "x Int8Linear"),
                                                ("max_err_vs_q8_0", "max |error| vs the q8_0 values")]))
        else:
            result = peak_memory(args.preset, repeats)
            print(f"{args.preset}: float32 model {result['float32_mib']:,.0f} MiB; files f16 "
                  f"{result['file_mib']['f16']:,.0f} MiB, q8_0 {result['file_mib']['q8_0']:,.0f} MiB; rise of VmHWM "
                  f"while loading, median of {repeats}; load average {result['load_average'][0]:.2f}")
            print(format_table(result["rows"], [("way", "way"), ("file", "file"), ("rise_mib", "rise MiB"),
                                                ("of_float32", "x float32 model")]))
    except ValueError as err:
        parser.error(str(err))
    path = args.json or f"benchmarks/results/gguf_load{'_products' if args.products else ''}.json"
    write_json_atomic(path, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
