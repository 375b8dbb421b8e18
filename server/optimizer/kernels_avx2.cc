// The AVX2 + FMA + F16C kernels (8 floats per vector). Compiled with a target
// attribute on every function, so the library itself builds with default
// flags; optimizer.cc calls them only after checking the CPU.

#include "server/optimizer/kernels.h"

#if defined(__x86_64__)

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

#define ZS_ISA_NAMESPACE avx2
#define ZS_KERNEL_TARGET __attribute__((target("avx2,fma,f16c")))
#include "server/optimizer/kernels_inl.h"

namespace zeroshard::optimizer_internal {
namespace avx2 {
namespace {

struct Avx2Isa {
  using V = __m256;
  static constexpr size_t kWidth = 8;
  ZS_KERNEL_TARGET static inline V Set1(float x) { return _mm256_set1_ps(x); }
  ZS_KERNEL_TARGET static inline V Load(const float* p) { return _mm256_loadu_ps(p); }
  template <bool kStream>
  ZS_KERNEL_TARGET static inline void Store(float* p, V x) {
    if constexpr (kStream) {
      _mm256_stream_ps(p, x);
    } else {
      _mm256_storeu_ps(p, x);
    }
  }
  ZS_KERNEL_TARGET static inline V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  ZS_KERNEL_TARGET static inline V Add(V a, V b) { return _mm256_add_ps(a, b); }
  ZS_KERNEL_TARGET static inline V Div(V a, V b) { return _mm256_div_ps(a, b); }
  ZS_KERNEL_TARGET static inline V Sqrt(V a) { return _mm256_sqrt_ps(a); }
  ZS_KERNEL_TARGET static inline V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }

  template <bool kStream>
  ZS_KERNEL_TARGET static inline void Store128(uint16_t* p, __m128i x) {
    if constexpr (kStream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(p), x);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), x);
    }
  }
  // Same bits as FloatToBf16: round to nearest even on the integer image,
  // NaN -> (bits >> 16) | 0x40.
  template <bool kStream>
  ZS_KERNEL_TARGET static inline void StoreBf16(uint16_t* p, V x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i nan_bits = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i r = _mm256_blendv_epi8(rounded, nan_bits, is_nan);
    // Every lane is in [0, 0xffff], so the saturating pack is exact.
    Store128<kStream>(p, _mm_packus_epi32(_mm256_castsi256_si128(r),
                                          _mm256_extracti128_si256(r, 1)));
  }
  // F16C rounds to nearest even like FloatToHalf; NaNs are first made the
  // quiet NaN of the same sign so the payload matches FloatToHalf's 0x7e00.
  template <bool kStream>
  ZS_KERNEL_TARGET static inline void StoreFp16(uint16_t* p, V x) {
    const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256 quiet = _mm256_or_ps(
        _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN))),
        _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)));
    const __m256 y = _mm256_blendv_ps(x, quiet, is_nan);
    Store128<kStream>(p, _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT));
  }
  ZS_KERNEL_TARGET static inline V LoadBf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  ZS_KERNEL_TARGET static inline V LoadFp16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  ZS_KERNEL_TARGET static inline void Fence() { _mm_sfence(); }
  // Four accumulators of 4 doubles hold lanes 0..15 of kSumLanes: a vector
  // of 8 elements at i fills lanes 0..7 or 8..15 by i % 16.
  struct Squares {
    __m256d a0, a1, a2, a3;
  };
  ZS_KERNEL_TARGET static inline Squares ZeroSquares() {
    const __m256d z = _mm256_setzero_pd();
    return Squares{z, z, z, z};
  }
  ZS_KERNEL_TARGET static inline void AddSquares(Squares& acc, V x, size_t i) {
    const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    if ((i & 8) == 0) {
      acc.a0 = _mm256_fmadd_pd(d0, d0, acc.a0);
      acc.a1 = _mm256_fmadd_pd(d1, d1, acc.a1);
    } else {
      acc.a2 = _mm256_fmadd_pd(d0, d0, acc.a2);
      acc.a3 = _mm256_fmadd_pd(d1, d1, acc.a3);
    }
  }
  ZS_KERNEL_TARGET static inline void StoreSquares(const Squares& acc, double* lanes) {
    _mm256_storeu_pd(lanes + 0, acc.a0);
    _mm256_storeu_pd(lanes + 4, acc.a1);
    _mm256_storeu_pd(lanes + 8, acc.a2);
    _mm256_storeu_pd(lanes + 12, acc.a3);
  }
};

// Lanes as Avx2Isa::Squares holds them.
ZS_KERNEL_TARGET double SumSquares(const float* g, size_t n, float scale) {
  static_assert(kSumLanes == 16, "lane layout below assumes 16 lanes");
  const __m256 s = _mm256_set1_ps(scale);
  Avx2Isa::Squares acc = Avx2Isa::ZeroSquares();
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    Avx2Isa::AddSquares(acc, _mm256_mul_ps(_mm256_loadu_ps(g + i), s), i);
    Avx2Isa::AddSquares(acc, _mm256_mul_ps(_mm256_loadu_ps(g + i + 8), s), i + 8);
  }
  double lanes[kSumLanes];
  Avx2Isa::StoreSquares(acc, lanes);
  SumSquaresTail(g, i, n, scale, lanes);
  return ReduceLanes(lanes);
}

}  // namespace
}  // namespace avx2

const KernelSet* Avx2Kernels() {
  static const KernelSet kSet = avx2::MakeKernelSet<avx2::Avx2Isa>(
      "avx2", sizeof(__m256), &avx2::SumSquares);
  return &kSet;
}

}  // namespace zeroshard::optimizer_internal

#else  // !defined(__x86_64__)

namespace zeroshard::optimizer_internal {
const KernelSet* Avx2Kernels() { return nullptr; }
}  // namespace zeroshard::optimizer_internal

#endif
