"""The one-row product of a compiled decode step (``tinygpt.fast.one_row``): the same values as ``F.linear``, and
only for one row inside a ``torch.compile`` trace."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from inference_support import variant_model
from tinygpt import generate
from tinygpt.fast.one_row import one_row_compiled, one_row_linear
from tinygpt.fast.weights import convert_weights


def test_one_row_linear_is_f_linear_up_to_float32_rounding():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(1, 1, 48, generator=g), torch.randn(40, 48, generator=g), torch.randn(40, generator=g)
    got = one_row_linear(x, w, b)
    assert got.shape == (1, 1, 40) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    q = torch.randint(-127, 128, (40, 48), dtype=torch.int8, generator=g)  # read in its stored dtype
    exact = x[0].double().matmul(q.double().T).float()
    torch.testing.assert_close(one_row_linear(x[0], q), exact, rtol=1e-5, atol=1e-4)


def test_one_row_is_only_taken_inside_a_compile_trace():
    assert not one_row_compiled(torch.zeros(1, 1, 8))  # eager: the library kernels
    seen = []

    def probe(x):
        seen.append((tuple(x.shape), one_row_compiled(x)))
        return x + 1

    torch.compile(probe, backend="eager")(torch.zeros(1, 8))
    torch.compile(probe, backend="eager")(torch.zeros(3, 8))
    assert seen == [((1, 8), True), ((3, 8), False)]


@pytest.mark.slow
@pytest.mark.parametrize("weight_type", ["float32", "bfloat16", "int8"])
def test_the_compiled_one_row_step_gives_the_eager_tokens_with_each_weight_type(weight_type):
    # The real inductor (it needs a C++ compiler): the compiled batch-1 decode step takes the one-row products;
    # its sums are ordered differently from the library kernels', so the claim is the greedy tokens and close
    # logits, which a tiny model keeps apart.
    from tinygpt.inference import runner

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("inductor's CPU backend needs a C++ compiler (g++ or c++ on PATH)")
    model = variant_model("gpt2", torch.float32)
    convert_weights(model, weight_type)
    prompt = [3, 1, 4, 1, 5]
    eager = generate(model, [prompt], max_new_tokens=6).rows()
    assert generate(model, [prompt], max_new_tokens=6, compile=True).rows() == eager
    assert model not in runner._COMPILE_FAILED  # the compiled step really ran: no fallback to eager
    one = torch.tensor([[7]])  # one row through the whole model, compiled as the decode step is
    with torch.no_grad():
        ref = model(one)
        got = torch.compile(model, options={"realize_acc_reads_threshold": 1})(one)
    bound = 1e-5 if weight_type == "float32" else 1e-2 * float(ref.abs().max())
    torch.testing.assert_close(got, ref, rtol=0, atol=bound)


@pytest.mark.slow
def test_a_compiled_batch_of_rows_with_int8_weights_decodes_compiled():
    # Widths that are multiples of 16 take torch's int8 kernel, whose own inductor lowering failed on a batch of
    # rows (and a failure sends the model eager for good, its one-row steps too): the kernel is an opaque op there.
    from tinygpt import GPTConfig, GPTModel
    from tinygpt.inference import runner

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("inductor's CPU backend needs a C++ compiler (g++ or c++ on PATH)")
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=61, context_length=32, emb_dim=32, n_heads=2, n_layers=2)).eval()
    convert_weights(model, "int8")
    prompts = [[3, 1, 4, 1], [5, 9, 2, 6]]  # the same length: one decode group, every step compiled
    eager = generate(model, prompts, max_new_tokens=5).rows()
    assert generate(model, prompts, max_new_tokens=5, compile=True).rows() == eager
    assert generate(model, prompts[:1], max_new_tokens=5, compile=True).rows() == eager[:1]
    assert model not in runner._COMPILE_FAILED
