"""fast.int8_row: the one-row int8 kernel equals, bit for bit, the product computed in torch from the stored bytes
(input rounded to int16, exact integer sums), stays within int8's tolerance of the float product, is an opaque op
inside a compiled graph, and where it cannot be built says so once and leaves the float loop in charge."""

from __future__ import annotations

import shutil

import pytest
import torch

from tinygpt.fast import int8_row



@pytest.fixture(scope="module")
def kernel():
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("the kernel is built by inductor's C++ compiler (g++ or c++ on PATH)")
    if not int8_row.load():
        pytest.skip("this CPU has no AVX512BW: the kernel is not built (the float loop is used)")
    return int8_row


@pytest.mark.parametrize("n, k", [(1, 1), (5, 7), (33, 200), (64, 128), (17, 3072), (300, 768)])
def test_the_kernel_equals_the_reference_from_the_stored_bytes(kernel, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) * 0.01
    x = torch.randn(1, k, generator=g) * 3
    got = kernel.int8_row_mm(x, q, scale)
    assert got.shape == (1, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, kernel.reference(x, q, scale), rtol=0, atol=0)
    exact = x.double() @ (q.double() * scale.double()[:, None]).t()
    torch.testing.assert_close(got.double(), exact, rtol=1e-4, atol=1e-4 * exact.abs().max().item())


def test_extreme_rows_neither_overflow_nor_divide_by_zero(kernel):
    q = torch.full((3, 4096), 127, dtype=torch.int8)
    q[1] = -127
    scale = torch.ones(3)
    x = torch.full((1, 4096), 1e30)  # every product at int16 x int8's largest: the total needs int64
    got = kernel.int8_row_mm(x, q, scale)
    torch.testing.assert_close(got, kernel.reference(x, q, scale), rtol=0, atol=0)
    torch.testing.assert_close(got[0, 0], torch.tensor(4096 * 127 * 1e30), rtol=1e-6, atol=0)
    assert torch.equal(kernel.int8_row_mm(torch.zeros(1, 4096), q, scale), torch.zeros(1, 3))


@pytest.mark.slow
def test_the_kernel_runs_inside_a_compiled_graph(kernel):
    q = torch.randint(-127, 128, (48, 256), dtype=torch.int8)
    scale, x = torch.rand(48), torch.randn(1, 256)
    step = torch.compile(lambda x: torch.tanh(kernel.int8_row_mm(x * 2, q, scale)), dynamic=False)
    torch.testing.assert_close(step(x), torch.tanh(kernel.reference(x * 2, q, scale)), rtol=0, atol=0)


def test_a_kernel_that_cannot_be_built_says_so_once(monkeypatch, capsys):
    from torch._inductor import codecache

    monkeypatch.setattr(int8_row, "_STATE", {"tried": False, "lib": None})

    def no_compiler(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(codecache.CppCodeCache, "load", no_compiler)
    assert int8_row.load() is False and int8_row.load() is False
    assert not int8_row.ready()
    err = capsys.readouterr().err
    assert err.count("the one-row int8 kernel is not used") == 1 and "InvalidCxxCompiler" in err
    with pytest.raises(RuntimeError, match="has not loaded the kernel"):
        int8_row.int8_row_mm(torch.randn(1, 8), torch.zeros(2, 8, dtype=torch.int8), torch.ones(2))
