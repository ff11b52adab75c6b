"""Two one-row products of a compiled decode step as small C++ kernels: bf16 weights and int8 weights.

At batch 1 a decode step's time is its weights' bytes over the rate its loops read them. In 2 MiB pages
(``fast.pages``) inductor's loops over the weights (``fast.one_row``) read them well below a plain read of the same
bytes (``python -m benchmarks.decode_bound`` times both):

- bf16: inductor's loop keeps one float32 accumulator pair per output channel, so each row's sum waits on its own
  additions. ``tinygpt_bf16_row`` keeps four (64 weights a step), which reads faster. Each product of the
  bf16-rounded input and a bf16 weight is exact in float32; the sums are float32, in another order than
  inductor's (equal up to float32 rounding).
- int8: converting each weight to float32 costs more work per byte than the memory delivers bytes; integer
  arithmetic halves it. The input row is rounded to int16 once per product (one scale for the row,
  ``s = absmax / 32767``, ``xq = round(x / s)``, ties to even), each weight widened to int16, and AVX-512's
  multiply-add of int16 pairs (``vpdpwssd`` where the CPU has AVX512_VNNI, ``vpmaddwd`` + add elsewhere) sums them
  in int32 lanes, totalled in int64 every 16,384 inputs (exact: no lane then holds more than 256 products of at
  most ``127 * 32767``). The output channel is ``float(total) * s * scale``. An int16 input keeps more of the row than
  the eager kernel's bf16 input wherever an entry is within 1/256 of the row's largest.

The kernels are built once per machine with ``-march=native`` by torch's extension builder
(``torch.utils.cpp_extension.load_inline``: the system's C++ compiler and ninja), which registers them as the CPU
kernels of two torch ops, ``tinygpt::bf16_row_mm`` and ``tinygpt::int8_row_mm``: inductor calls them as opaque
kernels inside a compiled graph, and an ahead-of-time step (``inference.aot_step``) reaches them through the
dispatcher without Python in between (a Python op there costs more per call than a small product takes).
``load()`` says once on stderr why they are not used where they cannot be built or the CPU lacks AVX512BW, and the
compiled step then keeps inductor's loops. ``Bf16Linear`` and ``Int8Linear`` take them for weights of at least
``MIN_WEIGHTS`` entries.
"""

from __future__ import annotations

import hashlib
import platform
import sys
from typing import Any

import torch

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* a lane takes 2 products per 128 inputs, each at most 127 * 32767: 16384 inputs keep it under 2^31 */
#define TINYGPT_CHUNK 16384

static inline __m512i tinygpt_dot(__m512i acc, __m512i w16, __m512i x16) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w16, x16);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w16, x16));
#endif
}

static inline int64_t tinygpt_total(__m512i a) {
    return _mm512_reduce_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(a)))
         + _mm512_reduce_add_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(a, 1)));
}

/* y[n] = float(sum_k xq[k] * q[n, k]) * s * scale[n], xq = round(x / s), s = absmax(x) / 32767; 0, or 1 where
   the int16 row could not be allocated (y untouched) */
static int tinygpt_int8_row(const float* x, const int8_t* q, const float* scale, float* y,
                                int64_t n, int64_t k) {
    float absmax = 0.0f;
    for (int64_t j = 0; j < k; j++) absmax = fmaxf(absmax, fabsf(x[j]));
    const float s = absmax > 0.0f ? absmax / 32767.0f : 1.0f;
    const int64_t padded = (k + 127) / 128 * 128;
    int16_t* xq = (int16_t*)aligned_alloc(64, padded * sizeof(int16_t));
    if (xq == NULL) return 1;
    for (int64_t j = 0; j < k; j++) xq[j] = (int16_t)nearbyintf(x[j] / s);
    memset(xq + k, 0, (padded - k) * sizeof(int16_t));
    const int64_t body = k / 128 * 128;
    for (int64_t r = 0; r < n; r++) {
        const int8_t* w = q + r * k;
        int64_t total = 0;
        /* the int32 lanes go into the int64 total every TINYGPT_CHUNK inputs, before any could overflow */
        for (int64_t start = 0; start < body; start += TINYGPT_CHUNK) {
            const int64_t stop = start + TINYGPT_CHUNK < body ? start + TINYGPT_CHUNK : body;
            __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t j = start; j < stop; j += 128) {
                __m512i w0 = _mm512_loadu_si512(w + j), w1 = _mm512_loadu_si512(w + j + 64);
                a0 = tinygpt_dot(a0, _mm512_cvtepi8_epi16(_mm512_castsi512_si256(w0)), _mm512_load_si512(xq + j));
                a1 = tinygpt_dot(a1, _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(w0, 1)),
                                 _mm512_load_si512(xq + j + 32));
                a2 = tinygpt_dot(a2, _mm512_cvtepi8_epi16(_mm512_castsi512_si256(w1)), _mm512_load_si512(xq + j + 64));
                a3 = tinygpt_dot(a3, _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(w1, 1)),
                                 _mm512_load_si512(xq + j + 96));
            }
            total += tinygpt_total(a0) + tinygpt_total(a1) + tinygpt_total(a2) + tinygpt_total(a3);
        }
        for (int64_t j = body; j < k; j++) total += (int64_t)xq[j] * (int64_t)w[j];
        y[r] = (float)total * s * scale[r];
    }
    free(xq);
    return 0;
}

static inline __m512 tinygpt_widen(__m256i h) {  /* 16 bf16 -> 16 float32: the bits moved up 16 places */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* y[n] = sum_k x[k] * w[n, k], w bf16 (as uint16 bits), x float32, four accumulators of 16 lanes */
static void tinygpt_bf16_row(const float* x, const uint16_t* q, float* y, int64_t n, int64_t k) {
    const int64_t body = k / 64 * 64;
    for (int64_t r = 0; r < n; r++) {
        const uint16_t* w = q + r * k;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < body; j += 64) {
            __m512i u = _mm512_loadu_si512(w + j), v = _mm512_loadu_si512(w + j + 32);
            a0 = _mm512_fmadd_ps(tinygpt_widen(_mm512_castsi512_si256(u)), _mm512_loadu_ps(x + j), a0);
            a1 = _mm512_fmadd_ps(tinygpt_widen(_mm512_extracti64x4_epi64(u, 1)), _mm512_loadu_ps(x + j + 16), a1);
            a2 = _mm512_fmadd_ps(tinygpt_widen(_mm512_castsi512_si256(v)), _mm512_loadu_ps(x + j + 32), a2);
            a3 = _mm512_fmadd_ps(tinygpt_widen(_mm512_extracti64x4_epi64(v, 1)), _mm512_loadu_ps(x + j + 48), a3);
        }
        float total = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        for (int64_t j = body; j < k; j++) {
            union { uint32_t bits; float value; } weight = {(uint32_t)w[j] << 16};
            total += x[j] * weight.value;
        }
        y[r] = total;
    }
}

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

static at::Tensor tinygpt_bf16_row_mm(const at::Tensor& x, const at::Tensor& weight) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2
                && x.numel() == weight.size(1), "bf16_row_mm takes x [1, in] float32 and weight [out, in] bfloat16, "
                "got x ", x.sizes(), " ", x.scalar_type(), " and weight ", weight.sizes(), " ", weight.scalar_type());
    const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
    at::Tensor y = at::empty({1, wc.size(0)}, xc.options());
    tinygpt_bf16_row(xc.data_ptr<float>(), reinterpret_cast<const uint16_t*>(wc.data_ptr()), y.data_ptr<float>(),
                     wc.size(0), wc.size(1));
    return y;
}

static at::Tensor tinygpt_int8_row_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && qweight.scalar_type() == at::kChar && qweight.dim() == 2
                && x.numel() == qweight.size(1) && scale.scalar_type() == at::kFloat
                && scale.numel() == qweight.size(0), "int8_row_mm takes x [1, in] float32, qweight [out, in] int8 "
                "and scale [out] float32, got x ", x.sizes(), " ", x.scalar_type(), ", qweight ", qweight.sizes(), " ",
                qweight.scalar_type(), " and scale ", scale.sizes(), " ", scale.scalar_type());
    const at::Tensor xc = x.contiguous(), qc = qweight.contiguous(), sc = scale.contiguous();
    at::Tensor y = at::empty({1, qc.size(0)}, xc.options());
    const int failed = tinygpt_int8_row(xc.data_ptr<float>(), qc.data_ptr<int8_t>(), sc.data_ptr<float>(),
                                        y.data_ptr<float>(), qc.size(0), qc.size(1));
    TORCH_CHECK_WITH(OutOfMemoryError, !failed, "int8_row_mm: no memory for the int16 copy of a ", qc.size(1),
                     "-long input row");
    return y;
}

TORCH_LIBRARY_IMPL(tinygpt, CPU, m) {
    m.impl("bf16_row_mm", &tinygpt_bf16_row_mm);
    m.impl("int8_row_mm", &tinygpt_int8_row_mm);
}
#endif
"""

# An op's fixed cost per call (the dispatch, the output's allocation) is what the kernel saves on about a million
# weights: smaller weights stay in inductor's loops, fused with their neighbours.
MIN_WEIGHTS = 1 << 20
_STATE: dict[str, Any] = {"tried": False, "loaded": False}

# The ops' schemas and shapes (for tracing) are defined here; their CPU kernels only by ``load()``.
torch.library.define("tinygpt::bf16_row_mm", "(Tensor x, Tensor weight) -> Tensor")
torch.library.define("tinygpt::int8_row_mm", "(Tensor x, Tensor qweight, Tensor scale) -> Tensor")


@torch.library.register_fake("tinygpt::bf16_row_mm")
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(1, weight.shape[0], dtype=torch.float32)


@torch.library.register_fake("tinygpt::int8_row_mm")
def _(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(1, qweight.shape[0], dtype=torch.float32)


def load() -> bool:
    """Build (first time on this machine) and load the kernels; whether they can be used. Call it before tracing:
    ``ready()`` is what a traced product asks."""
    if not _STATE["tried"]:
        _STATE["tried"] = True
        try:
            from torch.utils import cpp_extension

            cpp_extension.load_inline(f"tinygpt_row_kernels_{_cpu_digest()}", cpp_sources=[SOURCE],
                                      is_python_module=False, extra_cflags=["-O3", "-march=native"])
            if not torch._C._dispatch_has_kernel_for_dispatch_key("tinygpt::bf16_row_mm", "CPU"):
                raise RuntimeError("this CPU has no AVX512BW")
            _STATE["loaded"] = True
        except Exception as err:  # no compiler or ninja, another ISA: the compiled step keeps inductor's loops
            print(f"tinygpt: the one-row kernels are not used ({type(err).__name__}: "
                  f"{str(err).splitlines()[0] if str(err) else ''}); compiled steps use inductor's loops",
                  file=sys.stderr)
    return _STATE["loaded"]


def _cpu_digest() -> str:
    """The CPU's feature flags, hashed: the build is ``-march=native``, so a home folder shared by machines of other
    CPUs keeps one build per kind."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def ready() -> bool:
    """Whether ``load()`` has loaded the kernels (no build: safe inside a trace)."""
    return _STATE["loaded"]


def _check_loaded() -> None:
    if not _STATE["loaded"]:
        raise RuntimeError("tinygpt.fast.row_kernels.load() has not loaded the kernels")


def bf16_row_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, in] float32 @ weight [out, in] bf16 ^T -> [1, out] float32 (float32 sums, four accumulators)."""
    _check_loaded()
    return torch.ops.tinygpt.bf16_row_mm.default(x, weight)


def int8_row_mm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [1, in] float32 @ (qweight [out, in] int8 * scale [out] float32)^T -> [1, out] float32, the input
    rounded to int16 (the module docstring)."""
    _check_loaded()
    return torch.ops.tinygpt.int8_row_mm.default(x, qweight, scale)


def int8_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What ``int8_row_mm`` computes, in plain torch from the stored bytes (exact integer sums): for tests."""
    x = x.reshape(-1).float()
    absmax = x.abs().max()
    s = absmax / 32767.0 if absmax > 0 else torch.tensor(1.0)
    xq = torch.round(x / s).long()
    total = (qweight.long() * xq[None]).sum(-1)  # [out], exact
    return (total.float() * s * scale.float())[None]
