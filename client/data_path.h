#pragma once

// The bulk-data seam between a trainer and ONE daemon: gradient pushes,
// initial parameters, parameter gathers. Implementations: the Shard streaming
// RPCs ("stream", client/stream_data_path.h, always available) and one-sided
// Put/Get over any transport::Transport ("ucx", "grpc", "inproc";
// client/bulk_data_path.h). The control plane (jobs, step phases) always goes
// over gRPC and is not part of this interface.
//
// Threads: every method is thread-safe and may be called concurrently from
// several threads; each call blocks its calling thread until done or until
// its deadline.
//
// Buffers: the caller owns every buffer; an implementation reads or writes
// it only during the call (it may not keep a pointer after returning).
//
// Errors (one meaning per code), with the daemon's address in the message:
//   Unavailable       the daemon went away or cannot be reached;
//   DeadlineExceeded  the deadline passed first;
//   DataLoss          a checksum or a reply's shape did not match;
//   others            as the daemon returned them (InvalidArgument,
//                     FailedPrecondition, NotFound, ResourceExhausted...).
//
// A push returns OK only when the daemon holds exactly these bytes for this
// contribution: applied now, or applied by an earlier attempt (this
// process's, or a fenced predecessor's of the same rank) whose bytes were
// shown equal (the daemon's ALREADY_EXISTS, given when the CRC-32C of the
// chunk, sent or computed from the staged bytes, matches the one held; a
// fenced staging slot whose generation was applied), or, for a new process
// replaying the open step, held from its predecessor's staged push, which
// carried no CRC-32C (ALREADY_EXISTS too: kept, not compared). A duplicate
// with other bytes is an error, never "delivered".

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "common/flat_range.h"
#include "common/protocol.h"

namespace zeroshard {

// One atomic gradient contribution: a single chunk (one bucket).
struct GradientPush {
  std::string job_id;
  uint64_t step = 0;
  uint32_t rank = 0;
  uint64_t incarnation = 0;  // the rank's (JoinJobRequest.incarnation), >= 1
  uint32_t micro_batch = 0;
  uint32_t micro_batches = 1;
  FlatRange range;             // inside the daemon's range (trainer collective: one partition)
  DType dtype = DType::kFp32;  // of `data`
  const void* data = nullptr;  // range.size() * DTypeSize(dtype) bytes
  // Layout indices (ascending, overlapping `range`) of the tensors this
  // contribution has no gradient for (GradientChunk.no_grad_tensors).
  std::vector<uint32_t> no_grad_tensors;
};

// Initial fp32 parameters for a range the daemon owns.
struct ParameterUpload {
  std::string job_id;
  uint32_t rank = 0;
  FlatRange range;
  const float* values = nullptr;  // range.size() elements
};

struct GatherRequestSpec {
  std::string job_id;
  uint32_t rank = 0;
  uint64_t incarnation = 0;  // the rank's; bulk paths exchange endpoints with it
  uint64_t after_step = 0;  // served once this step is committed
  FlatRange range;          // inside the daemon's parameters
  DType dtype = DType::kFp32;
  absl::Duration wait = absl::ZeroDuration();  // how long the daemon may wait for the commit
};

class DataPath {
 public:
  virtual ~DataPath() = default;

  // "HOST:PORT" of the daemon.
  virtual const std::string& address() const = 0;
  // Data path name: "stream", or the bulk transport's ("ucx", "grpc", "inproc").
  virtual const char* name() const = 0;

  // Sends one contribution; returns the payload bytes sent once the daemon
  // has applied it (see above for duplicates). On error the daemon applied
  // nothing of it, or the implementation could not find out (Unavailable,
  // DeadlineExceeded): the caller may push the same bytes again.
  virtual absl::StatusOr<uint64_t> PushGradient(const GradientPush& push, absl::Time deadline) = 0;

  // A push memory (client/push_memories.h) this daemon reads pushes from
  // itself, only announced to it (pulls).
  struct PullMemory {
    uint64_t serial = 0;  // unique in this process; 0: none
    uintptr_t begin = 0;  // the memory's first byte
    uint64_t bytes = 0;
    // Whether a push of `n` bytes at `p` is pulled from this memory too:
    // inside it, at an offset any element size divides, and no larger
    // than a chunk (common/protocol.h).
    bool Holds(const void* p, uint64_t n) const {
      const uintptr_t at = reinterpret_cast<uintptr_t>(p);
      return serial != 0 && n > 0 && n <= kMaxChunkBytes && at >= begin &&
             at - begin <= bytes && n <= bytes - (at - begin) && (at - begin) % 4 == 0;
    }
  };

  // The push memory this daemon reads a push of `bytes` bytes at `data`
  // from, or none (serial 0) when the push would carry its bytes (or is not
  // known to be pulled yet). Pushes it Holds may share one PushGradients
  // call whatever their bytes: its request carries none of them. Never
  // blocks on the network.
  virtual PullMemory PullMemoryOf(const void* data, uint64_t bytes) const { return {}; }

  // Sends several contributions (to this daemon, together at most
  // MaxPushStreamBytes of the job's C_B, common/protocol.h, where a push
  // PullMemoryOf names counts kPushChunkOverheadBytes); one result per push,
  // in order, each with PushGradient's meaning. Blocks until every one is
  // answered or `deadline`. This default sends them one by one; a path
  // that can carry them in one request overrides it.
  virtual std::vector<absl::StatusOr<uint64_t>> PushGradients(
      const std::vector<GradientPush>& pushes, absl::Time deadline) {
    std::vector<absl::StatusOr<uint64_t>> results;
    results.reserve(pushes.size());
    for (const GradientPush& push : pushes) results.push_back(PushGradient(push, deadline));
    return results;
  }

  // Stores initial parameters; returns the payload bytes sent once the
  // daemon confirmed every element. The payload is at most kMaxChunkBytes
  // (common/protocol.h) per call.
  virtual absl::StatusOr<uint64_t> InitParameters(const ParameterUpload& upload,
                                                  absl::Time deadline) = 0;

  // Writes range.size() elements of `request.dtype` into `dst`; returns the
  // payload bytes received. On error `dst` may be partly written.
  virtual absl::StatusOr<uint64_t> Gather(const GatherRequestSpec& request, void* dst,
                                          absl::Time deadline) = 0;
};

}  // namespace zeroshard
