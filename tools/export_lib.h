#pragma once

// zsctl export: a checkpoint's fp32 master parameters as one file that
// Python's `torch.load` (also with weights_only=True) and C++'s
// `torch::pickle_load` read back as a dict {tensor name: fp32 tensor of the
// tensor's shape}, in layout order. It reads the checkpoint directory only
// (no daemon), so it works on a copy of a finished job's checkpoint; every
// byte read is checked against the parts' CRC-32Cs.
//
// Kept apart from zsctl_commands because it links libtorch.
//
// Errors: InvalidArgument for a bad --checkpoint path or --out; the
// checkpoint's own errors pass through (common/checkpoint_files.h: NotFound,
// FailedPrecondition for an incomplete checkpoint or part files missing
// here, DataLoss on a checksum mismatch); ResourceExhausted when the output
// disk is full; Internal for other I/O errors. Every function blocks on disk
// I/O; thread-compatible.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/zeroshard/v1/checkpoint.pb.h"
#include <ATen/core/Tensor.h>

namespace zeroshard::tools {

// DIR/JOB/NAME split into its parts.
struct CheckpointPath {
  std::string root;  // the daemons' --checkpoint_dir
  std::string job_id;
  std::string name;  // a checkpoint name or "latest"
};
// Splits "DIR/JOB/NAME" (trailing slashes ignored; DIR may be relative and
// defaults to "." when absent). InvalidArgument ("--checkpoint: ...") for a
// path without a job and a name, an invalid job id or checkpoint name.
absl::StatusOr<CheckpointPath> SplitCheckpointPath(absl::string_view path);

// Tensors up to this many elements are read together through one window of
// this size, so a block of a part file that many small tensors share is read
// and checked once per window, not once per tensor.
inline constexpr uint64_t kExportWindowElements = 16ull << 20;  // 64 MiB of fp32

// Every tensor of `manifest`'s layout, read from the checkpoint's master.f32
// files under `root`: one contiguous tensor per layout entry, not views of a
// shared storage, under its name and then (a tied tensor) each of its
// aliases, sharing the tensor. Holds the whole model in memory
// plus the read window.
// Adds the bytes read from disk to *bytes_read (may be null).
absl::StatusOr<std::vector<std::pair<std::string, at::Tensor>>> ReadMasterTensors(
    const std::string& root, const v1::CheckpointManifest& manifest, uint64_t* bytes_read,
    uint64_t window_elements = kExportWindowElements);

// Writes `tensors` (CPU tensors) to `path` as a dict in torch.save's zip
// format: a plain dict, no type tags, so weights_only loaders accept it.
// Written under a temporary name in the same directory, fsynced and renamed
// over `path`: a failed export leaves an existing `path` untouched.
absl::Status WriteTensorDict(const std::string& path,
                             const std::vector<std::pair<std::string, at::Tensor>>& tensors);

struct ExportOptions {
  std::string checkpoint;  // DIR/JOB/NAME; NAME may be "latest"
  std::string out;         // the file to write, e.g. model.pt
};
// The whole command; returns the summary zsctl prints.
absl::StatusOr<std::string> RunExport(const ExportOptions& options);

}  // namespace zeroshard::tools
