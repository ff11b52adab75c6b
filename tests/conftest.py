"""Shared fixtures: tiny configs, seeded models, the offline GPT-2 vocabulary of ../shared/data."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch

from tinygpt import GPTConfig, get_config

# The README's command runs a pytest-xdist worker per core: one intra-op thread each, so the workers do not fight
# over the cores (tests that time or compare thread counts set their own).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
# ... and the commands the tests start as processes too: their thread count is chosen, so they print no note about a
# crowded CPU (tinygpt.devices.crowded_cpu_note) into the stderr the tests read
os.environ.setdefault("OMP_NUM_THREADS", "1")


def shared_data_dir() -> Path:
    """The public data files tests read (tokenizer vocabularies, corpora): ``$TINYGPT_SHARED_DATA``, else
    ``shared/data`` beside or above the checkout, else ``/work/shared/data`` (the benchmarks look alike)."""
    if os.environ.get("TINYGPT_SHARED_DATA"):
        return Path(os.environ["TINYGPT_SHARED_DATA"])
    candidates = [parent / "shared" / "data" for parent in Path(__file__).resolve().parents[1].parents]
    candidates.append(Path("/work/shared/data"))
    return next((c for c in candidates if c.is_dir()), candidates[0])


SHARED_DATA = shared_data_dir()
GPT2_VOCAB_DIR = SHARED_DATA / "gpt2"
VERDICT = Path(__file__).resolve().parent / "data" / "the-verdict.txt"  # in the repository: tests/data/README.md


def variant_configs(base: GPTConfig | None = None) -> list[GPTConfig]:
    """Every qkv_bias x tie_weights x pre_ln combination of a small config."""
    base = base or GPTConfig(vocab_size=37, context_length=12, emb_dim=24, n_heads=3, n_layers=2)
    return [
        base.replace(qkv_bias=q, tie_weights=t, pre_ln=p)
        for q, t, p in itertools.product((False, True), repeat=3)
    ]


@pytest.fixture
def tiny_config() -> GPTConfig:
    return get_config("tiny")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture
def gpt2_vocab_dir() -> Path:
    if not (GPT2_VOCAB_DIR / "encoder.json").exists():
        pytest.skip(f"GPT-2 vocabulary files not found in {GPT2_VOCAB_DIR}")
    return GPT2_VOCAB_DIR


@pytest.fixture
def training_text_file(tmp_path) -> Path:
    """A small deterministic text (about 12 KB, lowercase words and newlines) for training tests."""
    import random

    rng = random.Random(0)
    words = "the cat sat on a mat and the dog ran to the red barn while birds sang in old trees".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 10))) for _ in range(300)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def one_thread():
    """Tiny models on a shared machine: one intra-op thread avoids thread hand-off costs larger than the work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------- alignment
INSTRUCTION_DATA = SHARED_DATA / "instruction-data.json"
PREFERENCE_DATA = SHARED_DATA / "instruction-data-with-preference.json"


@pytest.fixture(scope="session")
def alignment_tokenizer():
    """A 400-token byte-level BPE (it has an end-of-text id) trained on the first 48 entries of both data files."""
    import json

    from tinygpt.alignment.data import format_prompt
    from tinygpt.tokenizer import BPETokenizer

    if not PREFERENCE_DATA.exists():
        pytest.skip(f"instruction data not found in {SHARED_DATA}")
    entries = json.loads(PREFERENCE_DATA.read_text(encoding="utf-8"))[:48]
    texts = [format_prompt(e["instruction"], e["input"]) + e[k] for e in entries for k in ("output", "chosen",
                                                                                           "rejected")]
    return BPETokenizer.train(texts, 400)


@pytest.fixture
def alignment_config(alignment_tokenizer) -> GPTConfig:
    return GPTConfig(vocab_size=alignment_tokenizer.vocab_size, context_length=128, emb_dim=32, n_heads=2,
                     n_layers=2, drop_rate=0.0)


@pytest.fixture
def alignment_model_dir(tmp_path, alignment_tokenizer, alignment_config) -> Path:
    """A seeded tiny GPT saved with the alignment tokenizer."""
    from tinygpt import GPTModel, save_model

    torch.manual_seed(0)
    path = tmp_path / "base"
    save_model(GPTModel(alignment_config), path, alignment_tokenizer)
    return path


@pytest.fixture
def rename_snapshots(tmp_path, monkeypatch):
    """``rename_snapshots(root)`` -> a list that fills, at every ``os.replace`` from then on, with a copy of ``root``
    taken just before the rename: the tree a SIGKILL at that instant would leave on disk."""
    import os
    import shutil

    def start(root: Path) -> list[Path]:
        shots: list[Path] = []
        real = os.replace

        def snapshot_then_replace(src, dst):
            shot = tmp_path / "_snapshots" / str(len(shots))
            shutil.copytree(root, shot, symlinks=True)
            shots.append(shot)
            return real(src, dst)

        monkeypatch.setattr(os, "replace", snapshot_then_replace)
        return shots

    return start


# ---------------------------------------------------------------------------------------------- evaluation
@pytest.fixture(scope="session")
def eval_model_dirs(tmp_path_factory):
    """(tinygpt checkpoint, its Hugging Face export): a seeded tiny GPT with GPT-2's vocabulary (so that lm-eval's HF
    class can tokenize with the exported vocab.json + merges.txt) and a 64-token context."""
    if not (GPT2_VOCAB_DIR / "encoder.json").exists():
        pytest.skip(f"GPT-2 vocabulary files not found in {GPT2_VOCAB_DIR}")
    from tinygpt import GPTModel, gpt2_tokenizer, save_model
    from tinygpt.interop.hf import export_hf

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50257, context_length=64, emb_dim=32, n_heads=4, n_layers=2, qkv_bias=True)
    model, tokenizer = GPTModel(config).eval(), gpt2_tokenizer(GPT2_VOCAB_DIR)
    root = tmp_path_factory.mktemp("eval_models")
    save_model(model, root / "tinygpt", tokenizer=tokenizer)
    export_hf(model, root / "hf", tokenizer=tokenizer)
    return root / "tinygpt", root / "hf"


def one_line_error(capsys, *fragments) -> str:
    """The stderr of a command that failed: exactly one line, no traceback, holding every fragment."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err
    return err
