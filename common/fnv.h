#pragma once

// FNV-1a, 64-bit: a fast non-cryptographic hash for fingerprints and
// integrity checks of small envelopes (not for adversarial input).

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace zeroshard {

inline constexpr uint64_t kFnv1aOffset = 0xcbf29ce484222325ull;
inline constexpr uint64_t kFnv1aPrime = 0x100000001b3ull;

// Folds n bytes at `data` into `h`.
inline void Fnv1aMix(uint64_t& h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= kFnv1aPrime;
  }
}

// The hash of `bytes` from the standard offset basis.
inline uint64_t Fnv1a(absl::string_view bytes) {
  uint64_t h = kFnv1aOffset;
  Fnv1aMix(h, bytes.data(), bytes.size());
  return h;
}

}  // namespace zeroshard
