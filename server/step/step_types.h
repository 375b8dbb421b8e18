#pragma once

// What the step engine takes and answers: plain structs, no protobuf and no
// gRPC. server/rpc decodes the Shard service's messages into these and
// encodes the answers (shard_service.cc); the engine checks every field
// itself, in the order it always has, so its errors name the wire fields
// ("chunk 2.range", "lr") whatever the caller.
//
// Views: a chunk that comes in (ParameterChunkIn, GradientChunkIn,
// StateChunkIn) points into the caller's buffers (the request messages, a
// staging slot), which must stay valid and unchanged for the call; nothing
// bulk is copied to build one. A chunk that goes out (ParameterChunkOut,
// StateChunkOut) owns its data as a std::string the engine reuses from one
// chunk to the next: the writer may swap it out into its own message (no
// copy) as long as it swaps a string back before it returns.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "common/flat_range.h"
#include "server/step/reduction.h"

namespace zeroshard {

// A dtype or a state array as the caller sent it (the zeroshard.v1 enum's
// number, possibly not a valid one): checked by the engine, which names the
// field, so that the first bad field of the first bad chunk is the one
// reported.
using WireEnum = int;

// A tensor's update count (its optimizer steps).
struct TensorStepCount {
  uint32_t tensor = 0;  // layout index
  uint64_t steps = 0;
};

// ---- Data ----

// One chunk of initial parameters (Shard.InitParameters).
struct ParameterChunkIn {
  FlatRange range;
  WireEnum dtype = 0;      // must be fp32
  absl::string_view data;  // range.size() * 4 bytes
  uint32_t crc32c = 0;     // of data; 0 = not checked
};

// One chunk of a rank's gradient push (Shard.PushGradient).
struct GradientChunkIn {
  uint64_t step = 0;
  uint32_t rank = 0;
  uint64_t incarnation = 0;  // the sender's process, checked by the job
  FlatRange range;
  WireEnum dtype = 0;  // fp32 or the job's precision
  uint32_t crc32c = 0;  // of the payload; 0 = not checked
  uint32_t micro_batch = 0;
  uint32_t micro_batches = 0;  // 0 reads as 1
  bool staged = false;  // the payload lies in the rank's staging slot
  // The payload lies in the rank's push memory (staged, read in place).
  bool pulled = false;
  // Layout indices, ascending, of tensors overlapping `range` with no
  // gradient.
  absl::Span<const uint32_t> no_grad_tensors;
  // range.size() * DTypeSize(dtype) bytes: the chunk's data, or its part of
  // the staging slot.
  absl::string_view payload;
};

struct PushResult {
  uint64_t elements = 0;        // accepted in this push
  uint32_t ranks_complete = 0;  // world_size once every owned range is complete, else 0
};

// One chunk of a gather, for the writer to send. `data` holds
// range.size() * DTypeSize(dtype) bytes (see the file comment).
struct ParameterChunkOut {
  FlatRange range;
  DType dtype = DType::kFp32;
  uint64_t step = 0;  // the committed step the data is at
  std::string data;
  uint32_t crc32c = 0;  // of data
};

// ---- Step ----

struct PrepareResult {
  double grad_sq_sum = 0;  // of the unscaled reduced gradient over the owned elements
  bool found_inf_nan = false;
  uint64_t elements = 0;  // unpadded elements owned
  float loss_scale = 0;
  bool backup_in_sync = false;
};

// The leader's commit (Shard.CommitStep), also what a replicated primary
// sends its backup.
struct CommitRequest {
  uint64_t step = 0;
  float clip_coef = 0;  // (0, 1]; 0 reads as 1
  bool skip = false;
  float lr = 0;
  float grad_norm = 0;
  uint32_t rank = 0;  // must be 0 (the job checks)
  uint64_t incarnation = 0;
  std::vector<float> group_lrs;  // empty, or one per parameter group
};

struct CommitResult {
  uint64_t committed_step = 0;
  float loss_scale = 0;  // for the next step
  bool skipped = false;
};

// The open step as the engine sees it (no ranks).
struct StepProgress {
  uint64_t committed_step = 0;
  uint32_t world_size = 0;
  float loss_scale = 0;
  // The last commit's; zero before the first.
  bool last_skipped = false;
  float last_clip_coef = 0;
  float last_grad_norm = 0;
  float last_lr = 0;
  bool prepared = false;
  uint64_t complete_elements = 0;
  uint64_t owned_elements = 0;
  std::vector<MissingRange> missing;  // empty when asked for brief
};

// ---- State dicts ----

// One chunk of a state write (Shard.WriteState).
struct StateChunkIn {
  uint32_t rank = 0;  // checked by the job
  uint64_t incarnation = 0;
  WireEnum array = 0;  // MASTER (1), EXP_AVG (2), EXP_AVG_SQ (3)
  FlatRange range;     // may be empty when only update counts are carried
  absl::string_view data;  // range.size() * 4 bytes
  uint32_t crc32c = 0;     // of data; 0 = not checked
  std::vector<TensorStepCount> tensor_steps;
};

// One chunk of a state read, for the writer to send (see the file comment;
// the first carries the update counts of the tensors the range overlaps).
struct StateChunkOut {
  FlatRange range;
  std::string data;  // range.size() floats
  uint32_t crc32c = 0;
  std::vector<TensorStepCount> tensor_steps;
};

struct WriteStateResult {
  uint64_t elements = 0;      // written; 0 when nothing changed
  uint32_t tensor_steps = 0;  // counts set; 0 when nothing changed
};

// ---- Remote access ----

// A region of the model states a trainer may read one-sided.
struct ParameterRegion {
  enum class Purpose : uint8_t { kMaster, kHalf };
  Purpose purpose = Purpose::kMaster;
  uint64_t address = 0;
  uint64_t length = 0;
  std::string rkey;
  FlatRange range;  // the owned (padded) range it maps
};

}  // namespace zeroshard
