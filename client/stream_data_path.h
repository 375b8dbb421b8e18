#pragma once

// DataPath over the Shard service's streaming RPCs ("stream", the
// always-available data path): a push is one PushGradient stream of one
// chunk, initial parameters one InitParameters stream of <= 4 MiB chunks, a
// gather one Gather stream read straight into the caller's buffer.
//
// Every chunk sent carries its CRC-32C; every chunk received is checked
// against its CRC-32C, its range and its size (DataLoss otherwise). Because
// a pushed chunk carries its checksum, the daemon answers a repeated push of
// a contribution it holds with ALREADY_EXISTS only when the checksums match
// (shard.proto), so this path reports that as delivered.

#include <memory>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "client/data_path.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard/v1/shard.grpc.pb.h"

namespace zeroshard {

// The chunk of `push` without payload or checksum: job, step, rank,
// incarnation, range, dtype, micro-batch.
v1::GradientChunk GradientChunkHeader(const GradientPush& push);

// How errors name a push and a gather: "PushGradient step S range [b, e)",
// "Gather after step S range [b, e)".
std::string DescribePush(const GradientPush& push);
std::string DescribeGather(const GatherRequestSpec& request);

// The Gather request for `request` (wait_ms clamped to kMaxWaitMs).
v1::GatherRequest GatherRequestProto(const GatherRequestSpec& request);

// The payload bytes of `push`: range.size() * DTypeSize(dtype).
uint64_t PushBytes(const GradientPush& push);

// Sends one chunk per push, in order, as one PushGradient stream on `stub`
// (`chunk_of(i, chunk)` fills push i's, one at a time) and checks that the
// daemon at `address` accepted every push's elements. Blocks until the
// daemon answers or `deadline` (the daemon may read memory the chunks refer
// to until then). Errors name the daemon, the step and the ranges; the
// daemon's codes pass through (ALREADY_EXISTS included).
absl::Status SendGradientChunks(v1::Shard::Stub* stub, absl::Span<const GradientPush> pushes,
                                absl::FunctionRef<void(size_t, v1::GradientChunk*)> chunk_of,
                                absl::Time deadline, absl::string_view address);
// How errors name the pushes of one stream: DescribePush of the first, and
// how many more.
std::string DescribePushes(absl::Span<const GradientPush> pushes);

class StreamDataPath final : public DataPath {
 public:
  // `channel` is the daemon's channel (shared with the control plane).
  StreamDataPath(std::string address, std::shared_ptr<grpc::Channel> channel);

  const std::string& address() const override { return address_; }
  const char* name() const override { return "stream"; }

  // OK also when the daemon already holds this contribution with the same
  // CRC-32C (ALREADY_EXISTS: an earlier attempt delivered these bytes).
  absl::StatusOr<uint64_t> PushGradient(const GradientPush& push, absl::Time deadline) override;
  // One PushGradient stream with a chunk per push, which the daemon applies
  // as one batch: all of them or none. When it refuses the batch because it
  // holds some of them already (ALREADY_EXISTS), each is sent again alone.
  std::vector<absl::StatusOr<uint64_t>> PushGradients(const std::vector<GradientPush>& pushes,
                                                      absl::Time deadline) override;
  absl::StatusOr<uint64_t> InitParameters(const ParameterUpload& upload,
                                          absl::Time deadline) override;
  // Read again (up to 3 times) when a commit tears the stream (ABORTED).
  absl::StatusOr<uint64_t> Gather(const GatherRequestSpec& request, void* dst,
                                  absl::Time deadline) override;

  // A Gather with wait_only: blocks until the daemon has checked `request`
  // and the step it asks for is committed, or `deadline`; moves no data.
  // Reports `unreported_read_bytes` (GatherRequest.unreported_read_bytes).
  absl::Status AwaitCommitted(const GatherRequestSpec& request, absl::Time deadline,
                              uint64_t unreported_read_bytes = 0);

  // The Shard stub on the daemon's channel, for data paths that share it.
  v1::Shard::Stub* stub() const { return stub_.get(); }

 private:
  // Sends `pushes` with their payloads and CRC-32Cs in one stream.
  absl::Status SendInline(absl::Span<const GradientPush> pushes, absl::Time deadline);
  absl::StatusOr<uint64_t> GatherOnce(const GatherRequestSpec& request, void* dst,
                                      absl::Time deadline);

  const std::string address_;
  std::unique_ptr<v1::Shard::Stub> stub_;
};

}  // namespace zeroshard
