"""fast.pages: the weights moved into one huge-page mapping keep every value, shape, stride, tie and module type;
the move is idempotent, leaves oneDNN's packed weights and small tensors alone, and the kernel backs the mapping
with 2 MiB pages where transparent huge pages are not switched off."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from torch import nn

from inference_support import variant_model
from tinygpt.fast import pages
from tinygpt.fast.pages import huge_pages, in_huge_pages
from tinygpt.fast.weights import convert_weights, onednn_bf16

pytestmark = pytest.mark.skipif(not pages.supported(), reason="madvise(MADV_HUGEPAGE) is Linux's")


@pytest.fixture
def every_tensor(monkeypatch):
    monkeypatch.setattr(pages, "MIN_BYTES", 0)  # the tiny test models' tensors count too


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if v.layout == torch.strided}


def test_moved_weights_keep_their_values_ties_and_outputs(every_tensor):
    model = variant_model("gpt2").eval()
    model.out_head.weight = model.tok_emb.weight  # tied: one storage, two modules
    params = {name: p for name, p in model.named_parameters()}
    before, idx = _tensors(model), torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        expected = model(idx)
    moved = huge_pages(model)
    assert moved >= sum(p.numel() * p.element_size() for p in params.values())
    after = model.state_dict()
    for name, value in before.items():
        assert torch.equal(after[name], value) and after[name].stride() == value.stride(), name
        assert in_huge_pages(after[name]), name
    assert {name: p for name, p in model.named_parameters()} == params  # the same Parameter objects
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())
    assert model.out_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()  # still one storage
    with torch.no_grad():
        torch.testing.assert_close(model(idx), expected, rtol=0, atol=0)
    assert huge_pages(model) == 0  # idempotent


def test_views_of_one_buffer_stay_views_of_one_copy(every_tensor):
    module = nn.Module()
    whole = torch.arange(24.0)
    module.register_buffer("a", whole[:12].view(3, 4))
    module.register_buffer("b", whole[12:].view(4, 3).t())  # a transposed view at an offset
    expected_a, expected_b = module.a.clone(), module.b.clone()
    assert huge_pages(module) == whole.numel() * 4  # one storage copied once
    assert torch.equal(module.a, expected_a) and torch.equal(module.b, expected_b)
    assert module.b.stride() == (1, 3)
    assert module.a.untyped_storage().data_ptr() == module.b.untyped_storage().data_ptr()
    module.a[0, 0] = 100.0
    assert module.a[0, 0] == 100.0 and module.b[0, 0] == expected_b[0, 0]


def test_small_tensors_and_packed_bf16_weights_stay_where_they_are(monkeypatch):
    model = variant_model("gpt2").eval()
    assert huge_pages(model) == 0  # every tensor of the tiny model is under MIN_BYTES
    if onednn_bf16():
        convert_weights(model, "bfloat16")
        packed = model.trf_blocks[0].att.qkv.weight
        assert packed.is_mkldnn
        monkeypatch.setattr(pages, "MIN_BYTES", 0)
        assert huge_pages(model) > 0  # the float32 embeddings, norms and biases move
        assert model.trf_blocks[0].att.qkv.weight is packed


def _anon_huge_kib(start: int, end: int) -> int:
    """AnonHugePages of this process's mappings that overlap [start, end)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and start < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def test_the_kernel_backs_the_mapping_with_huge_pages_and_frees_it_with_the_model():
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    module = nn.Linear(1024, 2048)  # 8 MiB of weight: four huge pages
    huge_pages(module)
    (start, end), = [r for r in pages._ARENAS.values() if r[0] <= module.weight.data_ptr() < r[1]]
    assert _anon_huge_kib(start, end) >= 4 * 2048
    del module
    gc.collect()
    assert (start, end) not in pages._ARENAS.values()


def test_load_pretrained_puts_a_cpu_models_weights_in_huge_pages(tmp_path, every_tensor):
    from tinygpt.checkpoint import save_model
    from tinygpt.interop.pretrained import load_pretrained

    model = variant_model("gpt2")
    save_model(model, tmp_path / "m")
    loaded, _ = load_pretrained(tmp_path / "m")
    assert all(in_huge_pages(p) for p in loaded.parameters())
    int8, _ = load_pretrained(tmp_path / "m", weights="int8")
    assert in_huge_pages(int8.trf_blocks[0].ff.layers[0].qweight)
