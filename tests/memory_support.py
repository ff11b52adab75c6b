"""How much a load grows a fresh interpreter's peak resident memory: the loaders' "never a float32 copy" claims."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import json, sys, torch
torch.set_num_threads(1)
from tinygpt.fast.weights import convert_weights
source, how, tiny, path = sys.argv[1:]
def read(path, weights="float32"):
    if source == "gguf":
        from tinygpt.interop.gguf import load_gguf
        return load_gguf(path, weights=weights)[0]
    from tinygpt.checkpoint import load_model
    return load_model(path, weights=weights)
def load(path):
    if how == "float32-then-convert":
        model = read(path)
        convert_weights(model, "bfloat16")
        return model
    return read(path, how)
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
load(tiny)  # the code's one-time costs (lazy imports, torch's first module build: ~70 MB), not the weights'
# VmHWM, not ru_maxrss: the latter keeps the parent's resident size across fork + exec (pytest's, here)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the present resident size
before = status("VmRSS:")
model = load(path)
print(json.dumps({"grew": status("VmHWM:") - before}))
"""


def load_growth(source: str, how: str, tiny: Path, path: Path) -> int:
    """Bytes by which loading ``path`` raises a fresh interpreter's peak resident size (Linux), after a load of
    ``tiny`` paid the code's one-time costs. ``source``: "gguf" (``load_gguf``) or "checkpoint" (``load_model``);
    ``how``: a weight type, or "float32-then-convert" (float32, then ``convert_weights`` to bfloat16)."""
    out = subprocess.run([sys.executable, "-c", _CHILD, source, how, str(tiny), str(path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])["grew"]
