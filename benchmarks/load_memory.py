"""Peak memory of loading a checkpoint: ``python -m benchmarks.load_memory [--model gpt2-medium] [--repeats 2]``.

A random model of the preset (GPT-2 as released: QKV bias, tied head) is saved once with ``save_model`` to a
temporary directory; then each way of loading it runs in a fresh subprocess that reports its ``ru_maxrss`` (peak
resident memory). Runs are interleaved (baseline, tinygpt, naive, baseline, ...) so a busy machine hits all alike.

- ``baseline``: import torch and tinygpt, load nothing -- the interpreter's own footprint;
- ``tinygpt``: ``load_model(dir)`` (meta-device build, tensors assigned, no second copy); safetensors
  maps the file copy-on-write, so pages become resident only when read;
- ``tinygpt-touched``: the same, then every weight read once (what the first forward pass does);
- ``naive``: ``GPTModel(config)`` (random init) then ``load_state_dict(safetensors.torch.load_file(...))``, weights
  read once too;
- ``hf-import``: ``tinygpt.interop.hf.import_hf`` of the same weights exported as a Hugging Face folder (the four
  Conv1D weights per block are transposed into new memory), weights read once.

The headline is (peak - baseline) / file size: 1.0 means exactly one copy of the weights in memory.
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

from .common import format_table, write_json_atomic

_CHILD = r"""
import json, resource, sys, torch
torch.set_num_threads(1)
from tinygpt import GPTModel, GPTConfig, load_model
how, directory = sys.argv[1], sys.argv[2]
if how.startswith("tinygpt"):
    model = load_model(directory)
elif how == "naive":
    from safetensors.torch import load_file
    model = GPTModel(GPTConfig.from_file(directory + "/config.json"))
    state = load_file(directory + "/model.safetensors")
    state["out_head.weight"] = state["tok_emb.weight"]
    model.load_state_dict(state)
    del state
    model.out_head.weight = model.tok_emb.weight
elif how == "hf-import":
    from tinygpt.interop.hf import import_hf
    model = import_hf(directory + "-hf")
if how in ("tinygpt-touched", "naive", "hf-import"):
    # Read every weight once, as a forward pass would: safetensors maps the file copy-on-write, so until a page is
    # read it is not resident, and the untouched figure alone would understate what using the model costs.
    with torch.no_grad():
        total = sum(float(p.sum()) for p in model.parameters())
# ru_maxrss is in KiB on Linux, bytes on macOS. VmHWM (Linux) is the same peak for this process image alone.
scale = 1 if sys.platform == "darwin" else 1024
hwm = None
try:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
except OSError:
    pass
print(json.dumps({"peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, "hwm_bytes": hwm}))
"""

_SAVE = r"""
import sys, torch
from tinygpt import GPTModel, get_config, save_model
from tinygpt.interop.hf import export_hf
torch.manual_seed(0)
with torch.no_grad():
    model = GPTModel(get_config(sys.argv[1], qkv_bias=True, tie_weights=True))
    save_model(model, sys.argv[2])
    export_hf(model, sys.argv[2] + "-hf")
"""

WAYS = ("baseline", "tinygpt", "tinygpt-touched", "naive", "hf-import")


def _save_random(preset: str, directory: Path) -> None:
    # In a subprocess too: Linux carries ru_maxrss across fork + exec, so this (parent) process must stay small
    # or every child would report at least the parent's peak. The parent never imports torch.
    subprocess.run([sys.executable, "-c", _SAVE, preset, str(directory)], check=True)


def _peak(how: str, directory: Path) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", _CHILD, how, str(directory)], check=True, capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(preset: str, repeats: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="tinygpt-load-") as tmp:
        directory = Path(tmp) / preset
        _save_random(preset, directory)
        file_bytes = (directory / "model.safetensors").stat().st_size
        samples: dict[str, list[dict[str, int]]] = {how: [] for how in WAYS}
        for _ in range(repeats):
            for how in WAYS:
                samples[how].append(_peak(how, directory))
    baseline = statistics.median(s["peak_bytes"] for s in samples["baseline"])
    rows = []
    for how in WAYS:
        peak = statistics.median(s["peak_bytes"] for s in samples[how])
        hwm = [s["hwm_bytes"] for s in samples[how] if s["hwm_bytes"] is not None]
        rows.append({"way": how, "peak_mib": peak / 2**20, "over_baseline_mib": (peak - baseline) / 2**20,
                     "copies_of_file": (peak - baseline) / file_bytes,
                     "vmhwm_mib": statistics.median(hwm) / 2**20 if hwm else None,
                     "samples_mib": [s["peak_bytes"] / 2**20 for s in samples[how]]})
    return {"preset": preset, "file_mib": file_bytes / 2**20, "repeats": repeats, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-medium", help="a preset (default: gpt2-medium)")
    parser.add_argument("--repeats", type=int, default=2, help="subprocess runs per way (default: 2)")
    parser.add_argument("--json", default="benchmarks/results/load_memory.json", help="where to write the JSON")
    args = parser.parse_args(argv)
    result = run(args.model, args.repeats)
    print(f"{result['preset']}: model.safetensors = {result['file_mib']:,.0f} MiB; peak RSS (ru_maxrss), "
          f"median of {args.repeats} fresh processes")
    print(format_table(result["rows"], [("way", "way"), ("peak_mib", "peak MiB"),
                                        ("over_baseline_mib", "over baseline MiB"),
                                        ("copies_of_file", "copies of the file"), ("vmhwm_mib", "VmHWM MiB")]))
    write_json_atomic(args.json, result)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
