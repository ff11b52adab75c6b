"""The one-row int8 product of a compiled decode step, as a small C++ kernel: int8 weights times an int16 input.

Converting each int8 weight to float32 and multiplying it by the input costs the core more work per byte than
the memory delivers bytes: inductor's float loop over int8 weights (``fast.one_row``) reads them at about
17 GB/s where a plain read of the same bytes in 2 MiB pages reaches 30 (``python -m benchmarks.decode_bound``).
Integer arithmetic halves the work: the input row is rounded to int16 once per product (one scale for the row,
``s = absmax / 32767``, ``xq = round(x / s)``, ties to even), each weight is widened to int16, and AVX-512's
multiply-add of int16 pairs (``vpdpwssd`` where the CPU has AVX512_VNNI, ``vpmaddwd`` + add elsewhere) sums
them in int32 lanes, which are totalled in int64 (exact: no lane holds more than ``K / 64`` products of at most
``127 * 32767``). The output channel is ``float(total) * s * scale``. An int16 input keeps more of the row than
the bf16 input of the eager kernel wherever an entry is within 1/256 of the row's largest.

The kernel is built once per machine by inductor's own C++ toolchain and cache (``torch._inductor``'s
``CppCodeCache``, which a compiled step needs anyway) with ``-march=native``; ``load()`` says once on stderr why
it is not used where it cannot be built or the CPU lacks AVX512BW, and the compiled step then keeps the float
loop. ``int8_row_mm`` is a torch custom op, so inductor calls it as an opaque kernel inside the compiled graph;
``Int8Linear`` takes it for weights of at least ``MIN_WEIGHTS`` entries.
"""

from __future__ import annotations

import ctypes
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
#define TINYGPT_HAVE_KERNEL 1

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

/* y[n] = float(sum_k xq[k] * q[n, k]) * s * scale[n], xq = round(x / s), s = absmax(x) / 32767 */
extern "C" void tinygpt_int8_row(const float* x, const int8_t* q, const float* scale, float* y,
                                 int64_t n, int64_t k) {
    float absmax = 0.0f;
    for (int64_t j = 0; j < k; j++) absmax = fmaxf(absmax, fabsf(x[j]));
    const float s = absmax > 0.0f ? absmax / 32767.0f : 1.0f;
    const int64_t padded = (k + 127) / 128 * 128;
    int16_t* xq = (int16_t*)aligned_alloc(64, padded * sizeof(int16_t));
    for (int64_t j = 0; j < k; j++) xq[j] = (int16_t)nearbyintf(x[j] / s);
    memset(xq + k, 0, (padded - k) * sizeof(int16_t));
    const int64_t body = k / 128 * 128;
    for (int64_t r = 0; r < n; r++) {
        const int8_t* w = q + r * k;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < body; j += 128) {
            __m512i w0 = _mm512_loadu_si512(w + j), w1 = _mm512_loadu_si512(w + j + 64);
            a0 = tinygpt_dot(a0, _mm512_cvtepi8_epi16(_mm512_castsi512_si256(w0)), _mm512_load_si512(xq + j));
            a1 = tinygpt_dot(a1, _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(w0, 1)), _mm512_load_si512(xq + j + 32));
            a2 = tinygpt_dot(a2, _mm512_cvtepi8_epi16(_mm512_castsi512_si256(w1)), _mm512_load_si512(xq + j + 64));
            a3 = tinygpt_dot(a3, _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(w1, 1)), _mm512_load_si512(xq + j + 96));
        }
        int64_t total = tinygpt_total(a0) + tinygpt_total(a1) + tinygpt_total(a2) + tinygpt_total(a3);
        for (int64_t j = body; j < k; j++) total += (int64_t)xq[j] * (int64_t)w[j];
        y[r] = (float)total * s * scale[r];
    }
    free(xq);
}
#else
#define TINYGPT_HAVE_KERNEL 0
#endif

extern "C" int tinygpt_int8_row_available(void) { return TINYGPT_HAVE_KERNEL; }
"""

# The op's fixed cost per call (the custom op's dispatch, ctypes, the output's allocation) is what the kernel saves
# on about a megabyte of weights: smaller weights stay in inductor's loop, fused with their neighbours.
MIN_WEIGHTS = 1 << 20
_STATE: dict[str, Any] = {"tried": False, "lib": None}


def load() -> bool:
    """Build (first time on this machine) and load the kernel; whether it can be used. Call it before tracing:
    ``ready()`` is what a traced product asks."""
    if not _STATE["tried"]:
        _STATE["tried"] = True
        try:
            from torch._inductor.codecache import CppCodeCache

            lib = CppCodeCache.load(SOURCE, extra_flags=("-march=native",))
            if not lib.tinygpt_int8_row_available():
                raise RuntimeError("this CPU has no AVX512BW")
            lib.tinygpt_int8_row.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2
            lib.tinygpt_int8_row.restype = None
            _STATE["lib"] = lib
        except Exception as err:  # no compiler, another ISA: the compiled step keeps inductor's float loop
            print(f"tinygpt: the one-row int8 kernel is not used ({type(err).__name__}: "
                  f"{str(err).splitlines()[0] if str(err) else ''}); compiled int8 steps use the float loop",
                  file=sys.stderr)
    return _STATE["lib"] is not None


def ready() -> bool:
    """Whether ``load()`` has loaded the kernel (no build: safe inside a trace)."""
    return _STATE["lib"] is not None


@torch.library.custom_op("tinygpt::int8_row_mm", mutates_args=())
def int8_row_mm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [1, in] float32 @ (qweight [out, in] int8 * scale [out] float32)^T -> [1, out] float32, the input
    rounded to int16 (the module docstring)."""
    lib = _STATE["lib"]
    if lib is None:
        raise RuntimeError("tinygpt.fast.int8_row.load() has not loaded the kernel")
    x, qweight, scale = x.contiguous().float(), qweight.contiguous(), scale.contiguous().float()
    n, k = qweight.shape
    y = torch.empty(1, n, dtype=torch.float32)
    lib.tinygpt_int8_row(x.data_ptr(), qweight.data_ptr(), scale.data_ptr(), y.data_ptr(), n, k)
    return y


@int8_row_mm.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(1, qweight.shape[0], dtype=torch.float32)


def reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What ``int8_row_mm`` computes, in plain torch from the stored bytes (exact integer sums): for tests."""
    x = x.reshape(-1).float()
    absmax = x.abs().max()
    s = absmax / 32767.0 if absmax > 0 else torch.tensor(1.0)
    xq = torch.round(x / s).long()
    total = (qweight.long() * xq[None]).sum(-1)  # [out], exact
    return (total.float() * s * scale.float())[None]
