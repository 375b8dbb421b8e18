#pragma once

// The commands behind zsctl, returning the text they print, so tests can call
// them without a process. status/memory block on RPCs up to timeout_ms each;
// checkpoint commands up to timeout_ms in all. (zsctl export, which links
// libtorch, is in tools/export_lib.h.)
//
// --output=json (estimate, status, memory): one compact JSON object and a
// newline, keys in snake_case as the protobuf fields name them, numbers as
// JSON numbers (byte counts as whole numbers, no units), values as the
// protobuf carries them (memory_limit_bytes 0: no limit; seconds_since_heard
// -1: never heard from).

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/channel.h"

namespace zeroshard::tools {

enum class OutputFormat { kText, kJson };

// "text" or "json"; InvalidArgument naming --output otherwise.
absl::StatusOr<OutputFormat> ParseOutputFormat(absl::string_view text);

// The commands that take --output=json, for usage errors.
inline constexpr char kJsonCommands[] = "estimate, status and memory";
bool SupportsJson(absl::string_view command);

// "7.5e9", "7.5B", "350M", "12k", "1T" -> count. InvalidArgument otherwise.
absl::StatusOr<double> ParseCount(absl::string_view text);
// "32GiB", "32GB", "80e9", "512MiB", "1024" (bytes) -> bytes.
absl::StatusOr<double> ParseBytes(absl::string_view text);

// After the paper's table, RunEstimate prints what one zeroshard daemon holds
// when `daemons` daemons own Ψ in equal parts (common/estimator.h
// EstimateDaemonStates): every model state in RAM, or with --state_dir the
// RAM beside the NVMe bytes of the state file.
struct EstimateOptions {
  std::string params;
  uint32_t world_size = 1;
  std::string device_memory;  // empty: no largest-model column
  double optimizer_k = 12;
  std::string daemons;        // a count >= 1; empty: world_size
};
// InvalidArgument for bad input, naming the flag or the formula's input.
absl::StatusOr<std::string> RunEstimate(const EstimateOptions& options);
// {"parameters", "world_size", "optimizer_k", "device_memory_bytes" (null
// without --device_memory), "stages": [{"stage", "name", "formula",
// "param_bytes", "grad_bytes", "optimizer_bytes", "model_state_bytes",
// "comm_elements", "comm_bytes_per_step", "max_parameters" (null without
// --device_memory)}], "daemon": {"daemons", "ram_bytes",
// "state_dir_ram_bytes", "state_dir_disk_bytes"}}, byte counts rounded to
// whole bytes. The same errors as RunEstimate, with no document.
absl::StatusOr<std::string> RunEstimateJson(const EstimateOptions& options);

// The credentials zsctl talks with (TLS and the bearer token): a job's token
// shows and drives that job, the admin token every job; without a token the
// daemons show no job. Default: plaintext, no token.
// status --job=J adds, per daemon, each rank of J as the daemon sees it
// (joined, connected, last heard, last step pushed) and what J's open step
// waits for ("step 117: daemon D waits for rank 3, ranges [a, b)").
struct AdminOptions {
  std::string daemons;  // comma-separated HOST:PORT
  std::string job;      // empty: all jobs the token opens
  int timeout_ms = 5000;
  ChannelSecurity security;
};
absl::StatusOr<std::string> RunStatus(const AdminOptions& options);
absl::StatusOr<std::string> RunMemory(const AdminOptions& options);

// --output=json: {"daemons": [...]}, one entry per daemon in options.daemons
// order, each {"address", ...its data} or {"address", "error": {"code",
// "message"}} (code as absl names it, e.g. "UNAVAILABLE"). Unlike the text
// commands, which stop at the first daemon that fails, these ask every
// daemon. Always sets *document; returns the first daemon's error (what
// RunStatus / RunMemory would return) or OK.
//   status: "version", "uptime_seconds", "draining", "jobs": [{"job_id",
//     "stage", "world_size", "ranks_connected", "committed_step",
//     "parameters", "owned_partitions": [...]}]; the job options.job adds
//     "ranks": [{"rank", "joined", "connected", "incarnation",
//     "seconds_since_heard", "last_step_pushed"}] and "open_step": {"step",
//     "prepared", "complete_elements", "owned_elements", "missing": [{"rank",
//     "begin", "end", "contributions", "expected"}]}.
//   memory: "total_bytes", "memory_limit_bytes", "jobs": [{"job_id", "stage",
//     "parameters", "world_size", "owned_partitions", "categories":
//     {"param_master", "param_half", "grad", "optim_m", "optim_v",
//     "activation", "buffer", "fragmentation", "replica", "param_cache"},
//     "model_state_bytes", "formula_bytes", "state_disk_bytes" (the job's
//     model-state file on the daemon's --state_dir, not in the categories,
//     which count RAM; 0 when in RAM)}].
absl::Status RunStatusJson(const AdminOptions& options, std::string* document);
absl::Status RunMemoryJson(const AdminOptions& options, std::string* document);

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
  ChannelSecurity security;  // the job's token (or the admin token)
};
absl::StatusOr<std::string> RunCheckpoint(absl::string_view action,
                                          const CheckpointOptions& options);

// zsctl drain: every daemon in options.daemons stops taking new jobs (its
// jobs run on). Needs the admin token.
absl::StatusOr<std::string> RunDrain(const AdminOptions& options);

// zsctl health: waits until every daemon in options.daemons answers the
// standard health check (grpc.health.v1.Health/Check, no token needed) as
// SERVING, for scripts that start daemons and then their trainers. Blocks up
// to options.timeout_ms in all, retrying a daemon that does not answer yet
// about every 100 ms; options.job is not used. Returns "daemon ADDR serving"
// lines. InvalidArgument naming --daemons for a missing or malformed list;
// Unavailable "daemon ADDR is not serving (health: NOT_SERVING; ...)" for a
// draining daemon, "daemon ADDR did not answer its health check within Ns:
// ..." at the deadline.
absl::StatusOr<std::string> RunHealth(const AdminOptions& options);

// zsctl token: a fresh secret for a job (ZS_JOB_TOKEN) or an admin token
// file, one line.
absl::StatusOr<std::string> RunToken();

}  // namespace zeroshard::tools
