// Internal to //server/optimizer: the kernel bodies, written once over an
// instruction-set traits class and included once by each kernels_*.cc.
//
// No include guard on purpose: every kernels_*.cc includes this file once,
// after defining
//   ZS_ISA_NAMESPACE   a namespace name unique to that file, so the
//                      instantiations of each file stay distinct symbols;
//   ZS_KERNEL_TARGET   the function attribute that enables its instruction
//                      set (empty for the scalar path);
// and after including everything this file uses (kernels.h, common/dtype.h).
//
// An Isa traits class provides, for a vector type V of kWidth floats:
//   Set1, Load, Store<stream>, Mul, Add, Div, Sqrt, Fma(a, b, c) = a*b+c
//   with one rounding, StoreBf16<stream>, StoreFp16<stream>, LoadBf16,
//   LoadFp16, Fence (after streaming stores); and for sums of squares a
//   Squares accumulator of kSumLanes doubles: ZeroSquares(),
//   AddSquares(acc, x, i) (the squares of x, the vector of elements i.., in
//   double, each into lane element % kSumLanes, as SumSquaresFn does) and
//   StoreSquares(acc, lanes).
//
// Numerics: the order of operations and the places of fused multiply-adds
// follow PyTorch 1.13's CPU kernels as built for AVX2 (the builds that ship
// contract `a + alpha * b` into an FMA):
//   add_(t, alpha)          -> fma(t, alpha, self)
//   addcmul_(t1, t2, value) -> fma(value * t1, t2, self)
//   addcdiv_(t1, t2, value) -> self + (value * t1) / t2
//   mul_ / div by a scalar  -> one fp32 multiply / divide
// Every operation here is IEEE-exact given its inputs, so the scalar path and
// every vector path produce the same bits. The library is built with
// -ffp-contract=off so the compiler adds no fusions of its own.

#ifndef ZS_ISA_NAMESPACE
#error "define ZS_ISA_NAMESPACE before including kernels_inl.h"
#endif
#ifndef ZS_KERNEL_TARGET
#error "define ZS_KERNEL_TARGET before including kernels_inl.h"
#endif

namespace zeroshard::optimizer_internal::ZS_ISA_NAMESPACE {

// One float at a time: the reference path, and the tail of the vector paths.
struct ScalarIsa {
  using V = float;
  static constexpr size_t kWidth = 1;
  ZS_KERNEL_TARGET static inline V Set1(float x) { return x; }
  ZS_KERNEL_TARGET static inline V Load(const float* p) { return *p; }
  template <bool kStream>
  ZS_KERNEL_TARGET static inline void Store(float* p, V x) { *p = x; }
  ZS_KERNEL_TARGET static inline V Mul(V a, V b) { return a * b; }
  ZS_KERNEL_TARGET static inline V Add(V a, V b) { return a + b; }
  ZS_KERNEL_TARGET static inline V Div(V a, V b) { return a / b; }
  ZS_KERNEL_TARGET static inline V Sqrt(V a) { return __builtin_sqrtf(a); }
  ZS_KERNEL_TARGET static inline V Fma(V a, V b, V c) { return __builtin_fmaf(a, b, c); }
  template <bool kStream>
  ZS_KERNEL_TARGET static inline void StoreBf16(uint16_t* p, V x) { *p = FloatToBf16(x); }
  template <bool kStream>
  ZS_KERNEL_TARGET static inline void StoreFp16(uint16_t* p, V x) { *p = FloatToHalf(x); }
  ZS_KERNEL_TARGET static inline V LoadBf16(const uint16_t* p) { return Bf16ToFloat(*p); }
  ZS_KERNEL_TARGET static inline V LoadFp16(const uint16_t* p) { return HalfToFloat(*p); }
  ZS_KERNEL_TARGET static inline void Fence() {}
  struct Squares {
    double lanes[kSumLanes];
  };
  ZS_KERNEL_TARGET static inline Squares ZeroSquares() { return Squares{}; }
  ZS_KERNEL_TARGET static inline void AddSquares(Squares& acc, V x, size_t i) {
    const double d = static_cast<double>(x);
    acc.lanes[i % kSumLanes] += d * d;
  }
  ZS_KERNEL_TARGET static inline void StoreSquares(const Squares& acc, double* lanes) {
    for (size_t l = 0; l < kSumLanes; ++l) lanes[l] = acc.lanes[l];
  }
};

// The step constants broadcast to vectors once per range.
template <class Isa>
struct VecConstants {
  using V = typename Isa::V;
  ZS_KERNEL_TARGET explicit VecConstants(const StepConstants& c)
      : grad_scale(Isa::Set1(c.grad_scale)),
        weight_decay(Isa::Set1(c.weight_decay)),
        decay(Isa::Set1(c.decay)),
        beta1(Isa::Set1(c.beta1)),
        one_minus_beta1(Isa::Set1(c.one_minus_beta1)),
        beta2(Isa::Set1(c.beta2)),
        one_minus_beta2(Isa::Set1(c.one_minus_beta2)),
        bias_correction2_sqrt(Isa::Set1(c.bias_correction2_sqrt)),
        neg_step_size(Isa::Set1(c.neg_step_size)),
        eps(Isa::Set1(c.eps)),
        momentum(Isa::Set1(c.momentum)),
        one_minus_dampening(Isa::Set1(c.one_minus_dampening)),
        neg_lr(Isa::Set1(c.neg_lr)) {}
  V grad_scale, weight_decay, decay, beta1, one_minus_beta1, beta2,
      one_minus_beta2, bias_correction2_sqrt, neg_step_size, eps, momentum,
      one_minus_dampening, neg_lr;
};

template <class Isa, CopyKind kCopy, bool kStream>
ZS_KERNEL_TARGET inline void StoreCopy(void* copy, size_t i, typename Isa::V p) {
  if constexpr (kCopy == CopyKind::kFp32) {
    Isa::template Store<kStream>(static_cast<float*>(copy) + i, p);
  } else if constexpr (kCopy == CopyKind::kBf16) {
    Isa::template StoreBf16<kStream>(static_cast<uint16_t*>(copy) + i, p);
  } else if constexpr (kCopy == CopyKind::kFp16) {
    Isa::template StoreFp16<kStream>(static_cast<uint16_t*>(copy) + i, p);
  }
}

// Updates Isa::kWidth elements starting at i.
template <class Isa, StepKind kKind, CopyKind kCopy, bool kStreamCopy>
ZS_KERNEL_TARGET inline void StepAt(const VecConstants<Isa>& k,
                                    const StepConstants& c,
                                    const StepBuffers& b, size_t i) {
  using V = typename Isa::V;
  // torch: clip_grad_norm_ / unscale multiply the gradient in place.
  V g = Isa::Mul(Isa::Load(b.grad + i), k.grad_scale);
  V p = Isa::Load(b.param + i);
  if constexpr (kKind == StepKind::kAdamW || kKind == StepKind::kAdam) {
    if constexpr (kKind == StepKind::kAdamW) {
      if (c.apply_weight_decay) p = Isa::Mul(p, k.decay);  // p.mul_(1 - lr*wd)
    } else {
      if (c.apply_weight_decay) g = Isa::Fma(p, k.weight_decay, g);  // g.add(p, wd)
    }
    // exp_avg.mul_(beta1).add_(g, 1 - beta1)
    const V m = Isa::Fma(g, k.one_minus_beta1,
                         Isa::Mul(Isa::Load(b.exp_avg + i), k.beta1));
    // exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)
    const V v = Isa::Fma(Isa::Mul(k.one_minus_beta2, g), g,
                         Isa::Mul(Isa::Load(b.exp_avg_sq + i), k.beta2));
    // denom = (exp_avg_sq.sqrt() / sqrt(bc2)).add_(eps)
    const V denom =
        Isa::Add(Isa::Div(Isa::Sqrt(v), k.bias_correction2_sqrt), k.eps);
    // p.addcdiv_(exp_avg, denom, -step_size)
    p = Isa::Add(p, Isa::Div(Isa::Mul(k.neg_step_size, m), denom));
    Isa::template Store<false>(b.exp_avg + i, m);
    Isa::template Store<false>(b.exp_avg_sq + i, v);
  } else {
    if (c.apply_weight_decay) g = Isa::Fma(p, k.weight_decay, g);  // d_p.add(p, wd)
    if (c.use_momentum) {
      // First step: buf = clone(d_p); then buf.mul_(mu).add_(d_p, 1 - dampening).
      const V m = c.first_step
                      ? g
                      : Isa::Fma(g, k.one_minus_dampening,
                                 Isa::Mul(Isa::Load(b.exp_avg + i), k.momentum));
      Isa::template Store<false>(b.exp_avg + i, m);
      g = m;
    }
    p = Isa::Fma(g, k.neg_lr, p);  // p.add_(d_p, -lr)
  }
  Isa::template Store<false>(b.param + i, p);
  StoreCopy<Isa, kCopy, kStreamCopy>(b.copy, i, p);
}

template <class Isa, StepKind kKind, CopyKind kCopy, bool kStreamCopy>
ZS_KERNEL_TARGET void StepRange(const StepConstants& constants,
                                const StepBuffers& buffers, size_t begin,
                                size_t end) {
  constexpr size_t kW = Isa::kWidth;
  // Local copies: the compiler cannot keep fields reached through the
  // references in registers across the streaming stores.
  const StepConstants c = constants;
  const StepBuffers b = buffers;
  const VecConstants<Isa> k(c);
  size_t i = begin;
  for (; i + kW <= end; i += kW) StepAt<Isa, kKind, kCopy, kStreamCopy>(k, c, b, i);
  if constexpr (kW > 1) {
    if (i < end) {
      const VecConstants<ScalarIsa> ks(c);
      for (; i < end; ++i) StepAt<ScalarIsa, kKind, kCopy, false>(ks, c, b, i);
    }
  }
  if constexpr (kStreamCopy) Isa::Fence();
}

template <class Isa, CopyKind kSrc>
ZS_KERNEL_TARGET inline typename Isa::V LoadAs(const void* src, size_t i) {
  if constexpr (kSrc == CopyKind::kFp32) {
    return Isa::Load(static_cast<const float*>(src) + i);
  } else if constexpr (kSrc == CopyKind::kBf16) {
    return Isa::LoadBf16(static_cast<const uint16_t*>(src) + i);
  } else {
    return Isa::LoadFp16(static_cast<const uint16_t*>(src) + i);
  }
}

template <class Isa, CopyKind kSrc>
ZS_KERNEL_TARGET void Accumulate(float* dst, const void* src, size_t n) {
  constexpr size_t kW = Isa::kWidth;
  size_t i = 0;
  for (; i + kW <= n; i += kW) {
    Isa::template Store<false>(
        dst + i, Isa::Add(Isa::Load(dst + i), LoadAs<Isa, kSrc>(src, i)));
  }
  for (; i < n; ++i) dst[i] = dst[i] + LoadAs<ScalarIsa, kSrc>(src, i);
}

// Adds (double)(g[i] * scale)^2 for i in [begin, n) to lanes[i % kSumLanes].
// The square of a float is exact in double, so a fused multiply-add and a
// multiply then add give the same sum.
ZS_KERNEL_TARGET inline void SumSquaresTail(const float* g, size_t begin, size_t n, float scale,
                                            double* lanes) {
  for (size_t i = begin; i < n; ++i) {
    const double x = static_cast<double>(g[i] * scale);
    lanes[i % kSumLanes] += x * x;
  }
}

ZS_KERNEL_TARGET inline double ReduceLanes(const double* lanes) {
  double sum = 0.0;
  for (size_t l = 0; l < kSumLanes; ++l) sum += lanes[l];
  return sum;
}

// kStream: dst must be aligned to one vector, and is not read back.
// kSquares: returns the sum of squares of the result times `scale`, with the
// bits of SumSquaresFn on it, taken in the same pass (0 without).
template <class Isa, CopyKind kSrc, bool kStream, bool kSquares>
ZS_KERNEL_TARGET double SumSources(float* dst, const void* const* srcs, size_t k, size_t n,
                                   bool overwrite, float scale) {
  constexpr size_t kW = Isa::kWidth;
  const typename Isa::V s = Isa::Set1(scale);
  typename Isa::Squares squares = Isa::ZeroSquares();
  size_t i = 0;
  for (; i + kW <= n; i += kW) {
    typename Isa::V acc = LoadAs<Isa, kSrc>(srcs[0], i);
    if (!overwrite) acc = Isa::Add(Isa::Load(dst + i), acc);
    for (size_t j = 1; j < k; ++j) acc = Isa::Add(acc, LoadAs<Isa, kSrc>(srcs[j], i));
    Isa::template Store<kStream>(dst + i, acc);
    if constexpr (kSquares) Isa::AddSquares(squares, Isa::Mul(acc, s), i);
  }
  double lanes[kSumLanes];
  Isa::StoreSquares(squares, lanes);
  for (; i < n; ++i) {
    float acc = LoadAs<ScalarIsa, kSrc>(srcs[0], i);
    if (!overwrite) acc = dst[i] + acc;
    for (size_t j = 1; j < k; ++j) acc = acc + LoadAs<ScalarIsa, kSrc>(srcs[j], i);
    dst[i] = acc;
    if constexpr (kSquares) {
      const double x = static_cast<double>(acc * scale);
      lanes[i % kSumLanes] += x * x;
    }
  }
  if constexpr (kStream) Isa::Fence();
  return kSquares ? ReduceLanes(lanes) : 0.0;
}

// kStream: dst must be aligned to one vector.
template <class Isa, CopyKind kSrc, bool kStream>
ZS_KERNEL_TARGET void ConvertIn(float* dst, const void* src, size_t n) {
  constexpr size_t kW = Isa::kWidth;
  size_t i = 0;
  for (; i + kW <= n; i += kW) {
    Isa::template Store<kStream>(dst + i, LoadAs<Isa, kSrc>(src, i));
  }
  for (; i < n; ++i) dst[i] = LoadAs<ScalarIsa, kSrc>(src, i);
  if constexpr (kStream) Isa::Fence();
}

template <class Isa, CopyKind kDst>
ZS_KERNEL_TARGET void ConvertOut(void* dst, const float* src, size_t n) {
  constexpr size_t kW = Isa::kWidth;
  size_t i = 0;
  for (; i + kW <= n; i += kW) {
    StoreCopy<Isa, kDst, false>(dst, i, Isa::Load(src + i));
  }
  for (; i < n; ++i) StoreCopy<ScalarIsa, kDst, false>(dst, i, src[i]);
}

template <class Isa>
constexpr KernelSet MakeKernelSet(const char* name, size_t vector_bytes,
                                  SumSquaresFn sum_squares) {
  KernelSet s{};
  s.name = name;
  s.vector_bytes = vector_bytes;
#define ZS_STEP_ROW(kind)                                                     \
  s.step[static_cast<int>(kind)][0][0] = &StepRange<Isa, kind, CopyKind::kNone, false>; \
  s.step[static_cast<int>(kind)][0][1] = &StepRange<Isa, kind, CopyKind::kNone, true>;  \
  s.step[static_cast<int>(kind)][1][0] = &StepRange<Isa, kind, CopyKind::kFp32, false>; \
  s.step[static_cast<int>(kind)][1][1] = &StepRange<Isa, kind, CopyKind::kFp32, true>;  \
  s.step[static_cast<int>(kind)][2][0] = &StepRange<Isa, kind, CopyKind::kBf16, false>; \
  s.step[static_cast<int>(kind)][2][1] = &StepRange<Isa, kind, CopyKind::kBf16, true>;  \
  s.step[static_cast<int>(kind)][3][0] = &StepRange<Isa, kind, CopyKind::kFp16, false>; \
  s.step[static_cast<int>(kind)][3][1] = &StepRange<Isa, kind, CopyKind::kFp16, true>
  ZS_STEP_ROW(StepKind::kAdamW);
  ZS_STEP_ROW(StepKind::kAdam);
  ZS_STEP_ROW(StepKind::kSgd);
#undef ZS_STEP_ROW
  s.accumulate[1] = &Accumulate<Isa, CopyKind::kFp32>;
  s.accumulate[2] = &Accumulate<Isa, CopyKind::kBf16>;
  s.accumulate[3] = &Accumulate<Isa, CopyKind::kFp16>;
  s.convert_in[1][0] = &ConvertIn<Isa, CopyKind::kFp32, false>;
  s.convert_in[2][0] = &ConvertIn<Isa, CopyKind::kBf16, false>;
  s.convert_in[3][0] = &ConvertIn<Isa, CopyKind::kFp16, false>;
  s.convert_in[1][1] = &ConvertIn<Isa, CopyKind::kFp32, true>;
  s.convert_in[2][1] = &ConvertIn<Isa, CopyKind::kBf16, true>;
  s.convert_in[3][1] = &ConvertIn<Isa, CopyKind::kFp16, true>;
#define ZS_SUM_SOURCES_ROW(index, type)                              \
  s.sum_sources[index][0][0] = &SumSources<Isa, type, false, false>; \
  s.sum_sources[index][0][1] = &SumSources<Isa, type, false, true>;  \
  s.sum_sources[index][1][0] = &SumSources<Isa, type, true, false>;  \
  s.sum_sources[index][1][1] = &SumSources<Isa, type, true, true>
  ZS_SUM_SOURCES_ROW(1, CopyKind::kFp32);
  ZS_SUM_SOURCES_ROW(2, CopyKind::kBf16);
  ZS_SUM_SOURCES_ROW(3, CopyKind::kFp16);
#undef ZS_SUM_SOURCES_ROW
  s.convert_out[1] = &ConvertOut<Isa, CopyKind::kFp32>;
  s.convert_out[2] = &ConvertOut<Isa, CopyKind::kBf16>;
  s.convert_out[3] = &ConvertOut<Isa, CopyKind::kFp16>;
  s.sum_squares = sum_squares;
  return s;
}

}  // namespace zeroshard::optimizer_internal::ZS_ISA_NAMESPACE
