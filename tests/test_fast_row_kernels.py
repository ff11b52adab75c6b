"""fast.row_kernels: the one-row int8 kernel equals, bit for bit, the product computed in torch from the stored bytes
(input rounded to int16, exact integer sums) and stays within int8's tolerance of the float product; the bf16
kernel equals the float32 product of the stored bf16 weights up to float32 rounding; both are opaque ops inside a
compiled graph, and where they cannot be built the compiled step is told once and keeps inductor's loops."""

from __future__ import annotations

import shutil

import pytest
import torch

from tinygpt.fast import row_kernels



@pytest.fixture(scope="module")
def kernel():
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("the kernels are built by the system's C++ compiler (g++ or c++ on PATH)")
    if not row_kernels.load():
        pytest.skip("this CPU has no AVX512BW: the kernels are not built (inductor's loops are used)")
    return row_kernels


@pytest.mark.parametrize("n, k", [(1, 1), (5, 7), (33, 200), (64, 128), (17, 3072), (300, 768)])
def test_the_int8_kernel_equals_the_reference_from_the_stored_bytes(kernel, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) * 0.01
    x = torch.randn(1, k, generator=g) * 3
    got = kernel.int8_row_mm(x, q, scale)
    assert got.shape == (1, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, kernel.int8_reference(x, q, scale), rtol=0, atol=0)
    exact = x.double() @ (q.double() * scale.double()[:, None]).t()
    torch.testing.assert_close(got.double(), exact, rtol=1e-4, atol=1e-4 * exact.abs().max().item())


@pytest.mark.parametrize("n, k", [(1, 1), (5, 7), (33, 200), (64, 128), (17, 3072), (300, 768)])
def test_the_bf16_kernel_is_the_float32_product_of_the_stored_weights(kernel, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    weight = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16).float()  # the layer rounds its input to bf16 first
    got = kernel.bf16_row_mm(x, weight)
    assert got.shape == (1, n) and got.dtype == torch.float32
    exact = x.double() @ weight.double().t()  # each product of two bf16 values is exact; only the sums round
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5 * max(1.0, exact.abs().max().item()))


def test_a_long_row_of_the_largest_products_does_not_overflow_a_lane(kernel):
    k = 3 * 16384 + 128 + 5  # three chunks of int32 lanes, a fourth part-chunk and a scalar tail
    q = torch.full((2, k), -127, dtype=torch.int8)
    q[1, ::2] = 127
    x = torch.full((1, k), 3.0)
    got = kernel.int8_row_mm(x, q, torch.ones(2))
    torch.testing.assert_close(got, kernel.int8_reference(x, q, torch.ones(2)), rtol=0, atol=0)
    torch.testing.assert_close(got[0, 0], torch.tensor(-127.0 * 3 * k), rtol=1e-6, atol=0)


def test_extreme_rows_neither_overflow_nor_divide_by_zero(kernel):
    q = torch.full((3, 4096), 127, dtype=torch.int8)
    q[1] = -127
    scale = torch.ones(3)
    x = torch.full((1, 4096), 1e30)  # every product at int16 x int8's largest: the total needs int64
    got = kernel.int8_row_mm(x, q, scale)
    torch.testing.assert_close(got, kernel.int8_reference(x, q, scale), rtol=0, atol=0)
    torch.testing.assert_close(got[0, 0], torch.tensor(4096 * 127 * 1e30), rtol=1e-6, atol=0)
    assert torch.equal(kernel.int8_row_mm(torch.zeros(1, 4096), q, scale), torch.zeros(1, 3))


@pytest.mark.slow
def test_the_kernels_run_inside_a_compiled_graph(kernel):
    q = torch.randint(-127, 128, (48, 256), dtype=torch.int8)
    scale, x = torch.rand(48), torch.randn(1, 256)
    step = torch.compile(lambda x: torch.tanh(kernel.int8_row_mm(x * 2, q, scale)), dynamic=False)
    torch.testing.assert_close(step(x), torch.tanh(kernel.int8_reference(x * 2, q, scale)), rtol=0, atol=0)


def test_a_kernel_that_cannot_be_built_says_so_once(monkeypatch, capsys):
    from torch.utils import cpp_extension

    monkeypatch.setattr(row_kernels, "_STATE", {"tried": False, "loaded": False})

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load_inline", no_compiler)
    assert row_kernels.load() is False and row_kernels.load() is False
    assert not row_kernels.ready()
    err = capsys.readouterr().err
    assert err.count("the one-row kernels are not used") == 1 and "Ninja is required" in err
    with pytest.raises(RuntimeError, match="has not loaded the kernels"):
        row_kernels.int8_row_mm(torch.randn(1, 8), torch.zeros(2, 8, dtype=torch.int8), torch.ones(2))
    with pytest.raises(RuntimeError, match="has not loaded the kernels"):
        row_kernels.bf16_row_mm(torch.randn(1, 8), torch.zeros(2, 8, dtype=torch.bfloat16))


def test_the_ops_refuse_tensors_of_other_types_by_name(kernel):
    with pytest.raises(RuntimeError, match=r"bf16_row_mm takes x \[1, in\] float32 and weight \[out, in\] bfloat16"):
        kernel.bf16_row_mm(torch.randn(1, 8), torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match=r"int8_row_mm takes x \[1, in\] float32, qweight \[out, in\] int8"):
        kernel.int8_row_mm(torch.randn(1, 8), torch.zeros(2, 9, dtype=torch.int8), torch.ones(2))
