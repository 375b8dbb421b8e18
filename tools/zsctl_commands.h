#pragma once

// The commands behind zsctl, returning the text they print, so tests can call
// them without a process. status/memory block on RPCs up to timeout_ms each;
// checkpoint commands up to timeout_ms in all. (zsctl export, which links
// libtorch, is in tools/export_lib.h.)

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

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

// zsctl checkpoint save|load|list|verify: drives the job's daemons through
// client/checkpoint_driver.h. Every RPC of one command shares one deadline,
// timeout_ms from the start (a save waits for the daemons' writes, a load
// and a verify read whole checkpoints: large models need minutes).
//   save    snapshots the job's committed step (GetStepState on daemon 0)
//           under `name`, waits for every part, writes the manifest;
//   load    replaces the job's state with checkpoint `name` (or "latest");
//           run it before training resumes: it drops the open step;
//   list    the checkpoints complete on every daemon, by step;
//   verify  every daemon re-reads its part of `name` (default "latest") and
//           checks every CRC-32C.
// InvalidArgument naming the flag for bad input (checked before any RPC);
// the daemons' errors pass through, naming the daemon.
struct CheckpointOptions {
  std::string daemons;  // the job's daemons, comma-separated, in the job's order
  std::string job;
  std::string name;
  int timeout_ms = 600000;
};
absl::StatusOr<std::string> RunCheckpoint(absl::string_view action,
                                          const CheckpointOptions& options);

}  // namespace zeroshard::tools
