#pragma once

// The "inproc" transport: both sides live in one address space (unit tests,
// single-process runs). Descriptors carry real addresses; Put and Get are
// memcpy on the initiator's executor thread, checked against a process-wide
// table of live regions, so an access to a region (or a peer Transport) that
// has been destroyed fails with Unavailable instead of touching freed memory.
// Destroying a Region waits for copies into or out of it that are under way.
// Access flags are enforced (PermissionDenied). AllocateRegion uses the heap.
// Each Connection runs its operations in order on one executor thread of
// the initiating Transport (InprocTransportOptions::progress_threads of
// them), copying in pieces of TransportOptions::max_piece_bytes.
// enforces_remote_keys() is true.
//
// Abort of an operation that has not started copying finishes it at once
// with Cancelled; one that is copying stops after the piece under way and
// finishes with Cancelled, the pieces before it written.

#include <memory>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace zeroshard::transport::inproc {

// Also reachable as CreateTransport("inproc", options), which passes
// options.inproc. InvalidArgument when progress_threads or
// common.max_piece_bytes is not positive.
absl::StatusOr<std::unique_ptr<Transport>> CreateInprocTransport(
    const InprocTransportOptions& options = {});

}  // namespace zeroshard::transport::inproc
