#pragma once

// glibc's non-temporal copy threshold (glibc.cpu.x86_non_temporal_threshold
// in GLIBC_TUNABLES): the size above which memcpy writes with non-temporal
// stores. glibc reads GLIBC_TUNABLES once, when a process starts, so a
// launcher sets it for the processes it starts (zsrun) and a benchmark
// reports what it ran with.

#include <cstdint>
#include <optional>

#include "absl/strings/string_view.h"

namespace zeroshard {

inline constexpr absl::string_view kNonTemporalThresholdTunable =
    "glibc.cpu.x86_non_temporal_threshold";
// The least value glibc takes (0x4040); it ignores smaller ones.
inline constexpr uint64_t kGlibcMinNonTemporalThreshold = 0x4040;

// The threshold's value as `tunables` (a GLIBC_TUNABLES value,
// "name=value:name=value...") sets it, as written; nullopt when it does not
// name the tunable.
std::optional<absl::string_view> NonTemporalThresholdIn(absl::string_view tunables);

}  // namespace zeroshard
