#pragma once

// Helpers for tests that run a job's ranks as threads of one process.

#include <cstdint>
#include <functional>
#include <string>

#include "absl/strings/string_view.h"

namespace zeroshard::testing {

// A new empty directory under $TEST_TMPDIR (or /tmp), named
// "<prefix>-XXXXXX"; fails the test (and returns the template) if it cannot
// be made.
std::string FreshDir(absl::string_view prefix);

// Runs fn(0) .. fn(world - 1) on `world` threads and joins them all.
void RunRanks(uint32_t world, const std::function<void(uint32_t)>& fn);

}  // namespace zeroshard::testing
