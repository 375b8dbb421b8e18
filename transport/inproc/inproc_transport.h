#pragma once

// The "inproc" transport: both sides live in one address space (unit tests,
// single-process runs). Descriptors carry real addresses; Put and Get are
// memcpy on the initiator's executor thread, checked against a process-wide
// table of live regions, so an access to a region (or a peer Transport) that
// has been destroyed fails with Unavailable instead of touching freed memory.
// Destroying a Region waits for copies into or out of it that are under way.
// Access flags are enforced (PermissionDenied). AllocateRegion uses the heap.
// Each Connection runs its operations in order on one executor thread of
// the initiating Transport (TransportOptions::progress_threads of them).
//
// Abort of an operation that has not started copying finishes it at once
// with Cancelled; one that is copying finishes when the copy does.

#include <memory>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace zeroshard::transport::inproc {

// Also reachable as CreateTransport("inproc", options). Uses
// options.progress_threads executor threads.
absl::StatusOr<std::unique_ptr<Transport>> CreateInprocTransport(
    const TransportOptions& options);

}  // namespace zeroshard::transport::inproc
