// The AVX-512F kernels (16 floats per vector). Compiled with a target
// attribute on every function, so the library itself builds with default
// flags; optimizer.cc calls them only after checking the CPU. Uses AVX-512F
// instructions only (no DQ/BW/VL/BF16), and F16C's 512-bit form.

#include "server/optimizer/kernels.h"

#if defined(__x86_64__)

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

// GCC 12's AVX-512 intrinsics start from _mm*_undefined_*() values, which
// its -Wmaybe-uninitialized reports at every inlined use.
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define ZS_ISA_NAMESPACE avx512
#define ZS_KERNEL_TARGET __attribute__((target("avx512f,avx2,fma,f16c")))
#include "server/optimizer/kernels_inl.h"

namespace zeroshard::optimizer_internal {
namespace avx512 {
namespace {

struct Avx512Isa {
  using V = __m512;
  static constexpr size_t kWidth = 16;
  ZS_KERNEL_TARGET static inline V Set1(float x) { return _mm512_set1_ps(x); }
  ZS_KERNEL_TARGET static inline V Load(const float* p) { return _mm512_loadu_ps(p); }
  template <bool kStream>
  ZS_KERNEL_TARGET static inline void Store(float* p, V x) {
    if constexpr (kStream) {
      _mm512_stream_ps(p, x);
    } else {
      _mm512_storeu_ps(p, x);
    }
  }
  ZS_KERNEL_TARGET static inline V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  ZS_KERNEL_TARGET static inline V Add(V a, V b) { return _mm512_add_ps(a, b); }
  ZS_KERNEL_TARGET static inline V Div(V a, V b) { return _mm512_div_ps(a, b); }
  ZS_KERNEL_TARGET static inline V Sqrt(V a) { return _mm512_sqrt_ps(a); }
  ZS_KERNEL_TARGET static inline V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }

  template <bool kStream>
  ZS_KERNEL_TARGET static inline void Store256(uint16_t* p, __m256i x) {
    if constexpr (kStream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), x);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
    }
  }
  // Same bits as FloatToBf16 (see kernels_avx2.cc).
  template <bool kStream>
  ZS_KERNEL_TARGET static inline void StoreBf16(uint16_t* p, V x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7f800000));
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i nan_bits = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __m512i r = _mm512_mask_blend_epi32(is_nan, rounded, nan_bits);
    Store256<kStream>(p, _mm512_cvtepi32_epi16(r));  // lanes fit in 16 bits
  }
  template <bool kStream>
  ZS_KERNEL_TARGET static inline void StoreFp16(uint16_t* p, V x) {
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i quiet = _mm512_or_si512(
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)),
        _mm512_set1_epi32(0x7fc00000));
    const __m512 y = _mm512_mask_blend_ps(is_nan, x, _mm512_castsi512_ps(quiet));
    Store256<kStream>(p, _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  ZS_KERNEL_TARGET static inline V LoadBf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  ZS_KERNEL_TARGET static inline V LoadFp16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  ZS_KERNEL_TARGET static inline void Fence() { _mm_sfence(); }
  // Lanes 0..7 and 8..15 of kSumLanes: one vector is all sixteen.
  struct Squares {
    __m512d a0, a1;
  };
  ZS_KERNEL_TARGET static inline Squares ZeroSquares() {
    return Squares{_mm512_setzero_pd(), _mm512_setzero_pd()};
  }
  ZS_KERNEL_TARGET static inline void AddSquares(Squares& acc, V x, size_t) {
    const __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d d1 =
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    acc.a0 = _mm512_fmadd_pd(d0, d0, acc.a0);
    acc.a1 = _mm512_fmadd_pd(d1, d1, acc.a1);
  }
  ZS_KERNEL_TARGET static inline void StoreSquares(const Squares& acc, double* lanes) {
    _mm512_storeu_pd(lanes + 0, acc.a0);
    _mm512_storeu_pd(lanes + 8, acc.a1);
  }
};

// Two accumulators of 8 doubles hold lanes 0..15 of kSumLanes.
ZS_KERNEL_TARGET double SumSquares(const float* g, size_t n, float scale) {
  static_assert(kSumLanes == 16, "lane layout below assumes 16 lanes");
  const __m512 s = _mm512_set1_ps(scale);
  Avx512Isa::Squares acc = Avx512Isa::ZeroSquares();
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    Avx512Isa::AddSquares(acc, _mm512_mul_ps(_mm512_loadu_ps(g + i), s), i);
  double lanes[kSumLanes];
  Avx512Isa::StoreSquares(acc, lanes);
  SumSquaresTail(g, i, n, scale, lanes);
  return ReduceLanes(lanes);
}

}  // namespace
}  // namespace avx512

const KernelSet* Avx512Kernels() {
  static const KernelSet kSet = avx512::MakeKernelSet<avx512::Avx512Isa>(
      "avx512", sizeof(__m512), &avx512::SumSquares);
  return &kSet;
}

}  // namespace zeroshard::optimizer_internal

#else  // !defined(__x86_64__)

namespace zeroshard::optimizer_internal {
const KernelSet* Avx512Kernels() { return nullptr; }
}  // namespace zeroshard::optimizer_internal

#endif
