"""Where and in what precision the numbers run: one rule for every command (``--device``, ``--dtype``).

``device`` None/"auto" is cuda when torch sees a GPU, else cpu. ``dtype`` "bfloat16" runs the matrix products
under bf16 autocast with float32 weights (and float32 optimizer state when training); "float32" is plain float32;
"auto" is bf16 on a bf16-capable GPU, else float32.
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = ("auto", "float32", "bfloat16")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/"auto" -> cuda when available else cpu; otherwise the named device (``ValueError`` if unusable)."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device={device!r} is not a device; use cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda was asked for but torch sees no CUDA GPU; use --device cpu")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported; use cpu or cuda")
    return resolved


def uses_bf16(device: torch.device, dtype: str) -> bool:
    """Whether ``dtype`` ("auto", "float32", "bfloat16") means bf16 autocast on ``device``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not allowed; allowed: {', '.join(DTYPES)}")
    return dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """bf16 autocast when ``dtype`` asks for it (weights and optimizer stay float32), else nothing."""
    if not uses_bf16(device, dtype):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def available_memory(device: torch.device) -> int | None:
    """Bytes that a new allocation on ``device`` can take now (free GPU memory; Linux's MemAvailable for the
    CPU), or None where that cannot be known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


THREADS_ENV = "OMP_NUM_THREADS"


def crowded_cpu_note(command: str, *, load: float | None = None, cores: int | None = None,
                     threads: int | None = None) -> str | None:
    """One line for a command about to run on the CPU when the machine's load leaves fewer free cores than torch has
    threads (``round(cores - 1-minute load average) < threads``), else None; also None when the thread count was
    chosen (``$OMP_NUM_THREADS`` set) or is already one.

    The threads then wait for each other at every operation: ``python -m benchmarks.threads`` measures it, and finds
    the two settings' weights differ in their last bits, which is why the command says it rather than choosing the
    count itself (the same ``--seed`` would give other weights on a busier machine). ``load``, ``cores``,
    ``threads``: the machine's (``os.getloadavg``, the process's affinity, ``torch.get_num_threads``) unless given."""
    import os

    if os.environ.get(THREADS_ENV):
        return None
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (OSError, AttributeError):  # Windows has no load average
            return None
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = torch.get_num_threads() if threads is None else threads
    free = max(0, round(cores - load))
    if threads <= 1 or free >= threads:
        return None
    return (f"{command}: note: the load average is {load:.1f} on {cores} cores, so fewer cores are free ({free}) than "
            f"torch's {threads} threads, which then wait for each other; one thread is usually several times faster "
            f"here: {THREADS_ENV}=1 {command} ...")
