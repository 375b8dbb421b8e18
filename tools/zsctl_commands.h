#pragma once

// The commands behind zsctl, returning the text they print, so tests can call
// them without a process. status/memory block on RPCs up to timeout_ms each.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace zeroshard::tools {

// "7.5e9", "7.5B", "350M", "12k", "1T" -> count. InvalidArgument otherwise.
absl::StatusOr<double> ParseCount(absl::string_view text);
// "32GiB", "32GB", "80e9", "512MiB", "1024" (bytes) -> bytes.
absl::StatusOr<double> ParseBytes(absl::string_view text);

struct EstimateOptions {
  std::string params;
  uint32_t world_size = 1;
  std::string device_memory;  // empty: no largest-model column
  double optimizer_k = 12;
};
absl::StatusOr<std::string> RunEstimate(const EstimateOptions& options);

struct AdminOptions {
  std::string daemons;  // comma-separated HOST:PORT
  std::string job;      // empty: all jobs
  int timeout_ms = 5000;
};
absl::StatusOr<std::string> RunStatus(const AdminOptions& options);
absl::StatusOr<std::string> RunMemory(const AdminOptions& options);

}  // namespace zeroshard::tools
