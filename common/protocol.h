#pragma once

// The limits and names of the zeroshard v1 protocol that the client and the
// daemon must agree on, in one place (docs/protocol.md lists them for
// people). Everything here is a property of the wire, not a tuning knob.

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/zeroshard/v1/shard.pb.h"

namespace zeroshard {

// Bytes of payload one GradientChunk or ParameterChunk may carry, and so the
// largest bulk-transport push and the largest gather request.
inline constexpr uint64_t kMaxChunkBytes = uint64_t{64} << 20;
// Largest gRPC message either side accepts: one full chunk plus headers.
inline constexpr int kMaxGrpcMessageBytes = 80 << 20;
// Longest a Gather may ask the daemon to wait for a commit (wait_ms).
inline constexpr uint32_t kMaxWaitMs = 600000;
// GatherRequest / LeaveRequest.unreported_read_bytes: at most this (1 TiB).
inline constexpr uint64_t kMaxUnreportedReadBytes = uint64_t{1} << 40;
// Constant bucket size C_B (JobSpec.bucket_bytes).
inline constexpr uint64_t kMinBucketBytes = 4096;
inline constexpr uint64_t kMaxBucketBytes = uint64_t{1} << 30;
inline constexpr uint64_t kDefaultBucketBytes = uint64_t{32} << 20;
// A daemon address, HOST:PORT.
inline constexpr size_t kMaxAddressBytes = 256;
// A PushGradient stream (several chunks, applied as one batch) carries at
// most MaxPushStreamBytes(C_B) bytes, each chunk counted as its payload plus
// kPushChunkOverheadBytes.
inline constexpr uint64_t kPushChunkOverheadBytes = 256;
inline uint64_t MaxPushStreamBytes(uint64_t bucket_bytes) {
  return 4 * bucket_bytes > kMaxChunkBytes ? 4 * bucket_bytes : kMaxChunkBytes;
}
// StepState.missing lists at most this many ranges.
inline constexpr int kMaxMissingReported = 16;
// Largest CheckpointFile.block_bytes a reader accepts, in a MANIFEST, a PART
// file or a CompleteCheckpointRequest. A reader holds one block in memory
// per read (a daemon handler, zsctl), so this bounds what a hostile manifest
// can make it allocate: one chunk's size. Writers use 4 MiB
// (kCheckpointBlockBytes).
inline constexpr uint64_t kMaxCheckpointBlockBytes = kMaxChunkBytes;

// Activation checkpoints (activation.proto; common/activation_protocol.h
// holds the key and its validator).
// Largest model-parallel degree an ActivationKey may name (mp_size).
inline constexpr uint32_t kMaxModelParallel = 4096;
// Keys one PrefetchActivationsRequest may name; a client splits a longer
// hint into several requests.
inline constexpr int kMaxPrefetchKeys = 1024;
// Largest slice any request may name, whatever the daemon's arena (sizes
// past it are a caller's bug, not a capacity question).
inline constexpr uint64_t kMaxActivationSliceBytes = uint64_t{64} << 30;
// FetchActivationRequest.max_chunk_bytes: 0 (the daemon's default) or
// kMinActivationChunkBytes..kMaxChunkBytes.
inline constexpr uint64_t kMinActivationChunkBytes = 1024;

// Bulk-transport names (the registry's, transport/transport.h) to the
// protocol's TransportKind and back. InvalidArgument for a name that has no
// kind, naming `field`.
absl::StatusOr<v1::TransportKind> TransportKindFromName(absl::string_view name,
                                                        absl::string_view field);
// "ucx", "grpc", "inproc"; "unspecified" for anything else.
absl::string_view TransportKindName(v1::TransportKind kind);

// "GRAD_STAGING", "PARAM_MASTER", "PARAM_HALF" (for messages).
absl::string_view RegionPurposeName(v1::RegionPurpose purpose);

}  // namespace zeroshard
