"""The ladder from the GPT-2 block to the modern one, one change at a time, each rung trained for the same CPU time.

Rung 0 is GPT-2's block as the seeds build it (LayerNorm, tanh GELU, learned positions, biases, a tied head) trained
with AdamW. Each further rung keeps everything above it and adds one change (``RUNGS``): Muon for the blocks'
matrices, then the config switches one by one, ending at the ``modern`` preset's block (``config.MODERN_BLOCK``)
trained with Muon. Every run goes through the product's own loop (``tinygpt.training.train``) with a time budget
counted in this process's CPU seconds on one thread (``--budget-clock cpu``): a shared machine slows the wall clock
of a run, not the work it gets. The same character-level data, the same seeds (3 by default) on every rung, so
rung i and rung i - 1 are compared seed by seed.

A rung *helps* when it lowers the final validation bits per byte on every seed, *hurts* when it raises it on every
seed, and otherwise shows no clear change: with 3 seeds that is the most the data can say. ``ladder_table``
recomputes the table from the runs in ``ladder.json``.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..config import GPTConfig
from ..corpus import embedded_corpus_text
from .report import ExperimentReport, check_seed, finish, format_table, new_figure, output_dir

# (name, what the rung adds, config switches, optimizer); each rung keeps every change above it.
RUNGS: tuple[tuple[str, str, dict[str, Any], str], ...] = (
    ("gpt2", "GPT-2 block, AdamW", {}, "adamw"),
    ("muon", "+ Muon on the blocks' matrices", {}, "muon"),
    ("rmsnorm", "+ RMSNorm", {"norm": "rmsnorm"}, "muon"),
    ("rope", "+ RoPE", {"pos_emb": "rope"}, "muon"),
    ("no-bias", "+ no biases", {"bias": False, "qkv_bias": False}, "muon"),
    ("untied", "+ untied head", {"tie_weights": False}, "muon"),
    ("relu2", "+ ReLU^2 FFN", {"ffn": "relu2"}, "muon"),
    ("qk-norm", "+ QK-norm", {"qk_norm": True}, "muon"),
    ("zero-init", "+ zero-init projections", {"zero_init_proj": True}, "muon"),
)
RUNG_NAMES = tuple(name for name, *_ in RUNGS)
# The GPT-2 block at nanoGPT's shakespeare-char CPU size (vocab_size: the data's characters).
BASE = dict(context_length=64, emb_dim=128, n_heads=4, n_layers=4, drop_rate=0.0, qkv_bias=True, bias=True,
            tie_weights=True)


def rung_configs(vocab_size: int, names: Sequence[str] = RUNG_NAMES) -> list[tuple[str, GPTConfig, str]]:
    """(name, config, optimizer) of each named rung, every change above it included."""
    unknown = [n for n in names if n not in RUNG_NAMES]
    if unknown:
        raise ValueError(f"unknown rung {unknown[0]!r}; the rungs are {', '.join(RUNG_NAMES)}")
    switches: dict[str, Any] = {}
    out = []
    for name, _, change, optimizer in RUNGS:
        switches.update(change)
        if name in names:
            out.append((name, GPTConfig(vocab_size=vocab_size, **{**BASE, **switches}), optimizer))
    return out


def ladder_table(runs: list[dict[str, Any]], rungs: Sequence[str]) -> list[dict[str, Any]]:
    """One row per rung from the runs' final validation bits per byte: mean and range over seeds, and against the
    rung before it the per-seed differences (mean, min, max) and the verdict."""
    final = {(r["rung"], r["seed"]): r["val_bpb"] for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    rows: list[dict[str, Any]] = []
    for i, rung in enumerate(rungs):
        values = [final[(rung, s)] for s in seeds]
        row: dict[str, Any] = {"rung": rung, "val_bpb_mean": statistics.fmean(values), "val_bpb_min": min(values),
                               "val_bpb_max": max(values),
                               "steps_mean": statistics.fmean(r["steps"] for r in runs if r["rung"] == rung)}
        if i > 0:
            deltas = [final[(rung, s)] - final[(rungs[i - 1], s)] for s in seeds]
            verdict = "helps" if max(deltas) < 0 else "hurts" if min(deltas) > 0 else "no clear change"
            row.update(delta_mean=statistics.fmean(deltas), delta_min=min(deltas), delta_max=max(deltas),
                       verdict=verdict)
        rows.append(row)
    return rows


def _train_rung(config: GPTConfig, optimizer: str, seed: int, prepared: Path, run_dir: Path, budget: str,
                lr: float, muon_lr: float, batch_size: int, eval_every: int) -> dict[str, Any]:
    from ..training import TrainingOptions, train

    result = train(TrainingOptions(
        prepared=str(prepared), config=config, out_dir=str(run_dir), time_budget=budget, budget_clock="cpu",
        optimizer=optimizer, lr=lr, muon_lr=muon_lr, batch_size=batch_size, warmup_steps=20, eval_every=eval_every,
        eval_iters=10, sample_tokens=0, progress=False, device="cpu", seed=seed, beta2=0.99))
    curve = [[r["budget_seconds"], r["val_bpb"]] for r in result.records if "val_bpb" in r]
    return {"val_bpb": result.last_eval["val_bpb"], "val_loss": result.last_eval["val_loss"], "steps": result.step,
            "curve": curve}


def run_ladder(out: str | Path | None = None, seed: int = 123, *, seeds: int = 3, budget: str = "20s",
               rungs: Sequence[str] = RUNG_NAMES, data: str | Path | None = None, max_chars: int = 400_000,
               lr: float = 1e-3, muon_lr: float = 0.04, batch_size: int = 12, eval_every: int = 25,
               jobs: int = 1, progress: Callable[[str], None] | None = None) -> ExperimentReport:
    """Train every rung of ``rungs`` (in ladder order) for ``budget`` CPU seconds on one thread under ``seeds``
    seeds (``seed``, ``seed + 1``, ...), on ``data`` (default: the embedded corpus) cut to ``max_chars``
    characters; print the table, write ``ladder.json`` and ``ladder.png`` (val bits per byte against CPU time).
    ``jobs`` > 1 trains that many runs at once, each in a process of its own (the budget counts each one's own CPU
    seconds, so running side by side changes how soon the ladder ends, not how much work each run gets)."""
    from ..training.data import prepare_corpus
    from ..training.options import parse_duration
    from .prepost import _read_text

    check_seed(seed)
    parse_duration("budget", budget)
    if seeds < 1 or jobs < 1:
        raise ValueError(f"seeds={seeds} and jobs={jobs} must be >= 1")
    rungs = [name for name in RUNG_NAMES if name in rungs] if set(rungs) <= set(RUNG_NAMES) else list(rungs)
    directory = output_dir("ladder", out)
    text = embedded_corpus_text(max_chars=max_chars) if data is None else _read_text(data, max_chars)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU seconds on one thread: the same work for every rung whatever the load
    runs: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            source = Path(scratch) / "text.txt"
            source.write_text(text, encoding="utf-8")
            prepared = Path(scratch) / "data"
            prepare_corpus([str(source)], "char", prepared, progress=False)
            from ..training import PreparedCorpus

            vocab = PreparedCorpus.open(prepared).vocab_size
            configs = rung_configs(vocab, rungs)
            tasks = [(name, config, optimizer, s) for name, config, optimizer in configs
                     for s in range(seed, seed + seeds)]

            def task_args(name: str, config: GPTConfig, optimizer: str, s: int) -> tuple:
                return (config, optimizer, s, prepared, Path(scratch) / f"{name}-{s}", budget, lr, muon_lr,
                        batch_size, eval_every)

            def done(name: str, optimizer: str, s: int, run: dict[str, Any]) -> None:
                runs.append({"rung": name, "seed": s, "optimizer": optimizer, **run})
                if progress is not None:
                    progress(f"{name} seed {s}: val {run['val_bpb']:.4f} bits/byte after {run['steps']} steps")

            if jobs == 1:
                for name, config, optimizer, s in tasks:
                    done(name, optimizer, s, _train_rung(*task_args(name, config, optimizer, s)))
            else:
                import multiprocessing
                from concurrent.futures import ProcessPoolExecutor

                with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=torch.set_num_threads, initargs=(1,)) as pool:
                    futures = [(task, pool.submit(_train_rung, *task_args(*task))) for task in tasks]
                    for (name, _, optimizer, s), future in futures:
                        done(name, optimizer, s, future.result())
    finally:
        torch.set_num_threads(threads)
    rungs = [name for name, _, _ in configs]
    table = ladder_table(runs, rungs)
    changes = {name: change for name, change, *_ in RUNGS}
    printed = format_table(
        ["rung", "change", "val bits/byte (min-max)", "vs rung above, per seed: mean (min..max)", "verdict", "steps"],
        [[r["rung"], changes[r["rung"]], f"{r['val_bpb_mean']:.4f} ({r['val_bpb_min']:.4f}-{r['val_bpb_max']:.4f})",
          "" if "delta_mean" not in r else f"{r['delta_mean']:+.4f} ({r['delta_min']:+.4f}..{r['delta_max']:+.4f})",
          r.get("verdict", ""), round(r["steps_mean"])] for r in table])
    findings = [f"{r['rung']} ({changes[r['rung']]}): {r['verdict']} ({r['delta_mean']:+.4f} bits/byte, per seed "
                f"{r['delta_min']:+.4f}..{r['delta_max']:+.4f})" for r in table if "verdict" in r]
    data_out = {"settings": {"budget": budget, "budget_clock": "cpu, one thread", "seeds": seeds, "seed": seed,
                             "data": "embedded corpus" if data is None else str(data), "max_chars": max_chars,
                             "lr": lr, "muon_lr": muon_lr, "batch_size": batch_size, "base": BASE},
                "rungs": rungs, "configs": {name: config.to_dict() for name, config, _ in configs},
                "runs": runs, "table": table}
    title = f"the ladder: GPT-2 block -> modern, {budget} of CPU time per run, {seeds} seed(s)"
    return finish("ladder", directory, title, [printed], data_out, findings, {"ladder": _figure(runs, rungs)})


def _figure(runs: list[dict[str, Any]], rungs: Sequence[str]) -> Any:
    """Validation bits per byte against CPU seconds, one colour per rung, one line per seed."""
    fig = new_figure(8.0, 5.0)
    ax = fig.add_subplot(1, 1, 1)
    colours = [f"C{i % 10}" for i in range(len(rungs))]
    for rung, colour in zip(rungs, colours):
        for i, run in enumerate(r for r in runs if r["rung"] == rung):
            times, values = zip(*run["curve"]) if run["curve"] else ((), ())
            ax.plot(times, values, color=colour, alpha=0.8, linewidth=1, label=rung if i == 0 else None)
    ax.set_xlabel("training time, CPU seconds (one thread)")
    ax.set_ylabel("validation bits per byte")
    ax.set_title("the ladder: each rung adds one change to the one above")
    ax.legend(fontsize=8)
    return fig
