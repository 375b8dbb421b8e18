#pragma once

// The "ucx" transport: UCP one-sided RMA (ucp_put_nbx / ucp_get_nbx) between
// processes, over whatever UCX_TLS selects: "posix,cma,self" (shared memory
// on one node), "tcp", or RDMA ("rc", "dc", ...).
//
// Threads: each progress thread owns one ucp_worker, which no other thread
// touches; Put/Get/Flush/Connect post requests to that thread through a queue
// and return (or wait) on a completion. The progress thread polls (yielding
// the core) for a short while after any activity and otherwise sleeps on the
// worker's event fd, so the serving side's thread also drives incoming
// traffic for transports that emulate RMA in software (tcp; shm on
// registered memory).
//
// Semantics beyond transport.h:
// - Put completion is remote completion (the endpoint is flushed before the
//   handle is done); Get completion means the bytes are in `dst`.
// - Operations longer than TransportOptions::max_piece_bytes are split into
//   pieces, at most UcxTransportOptions::max_pieces_in_flight outstanding
//   per operation.
// - enforces_remote_keys() (ucx_tls.h): true when UCX_TLS names only
//   shared-memory transports and every transport UCX selected for it is one
//   of them; false over tcp and RDMA, and for an empty UCX_TLS, "all" or an
//   exclusion list, which leave the choice to UCX.
// - Memory from AllocateRegion is UCX-allocated (shared memory when posix or
//   sysv is enabled): peers on the node then copy straight into and out of
//   it. UCX's posix files live in a directory private to the process
//   (/dev/shm/zeroshard-ucx.<pid>.*, or under $UCX_POSIX_DIR), created on
//   first use with a small forked process ("zs-shm-reaper") that removes it
//   once this process has ended, however it ended (SIGKILL included). Memory given to
//   RegisterRegion is reached through UCX's software RMA over shm or tcp, which the owner's
//   progress thread serves (over shm the bytes pass through UCX's FIFO, one extra copy). With RDMA
//   hardware both are one-sided.
// - Peer death: endpoints are created with UCX's peer error handling
//   (UCP_ERR_HANDLING_MODE_PEER) whenever UCX_TLS allows it, and a failure
//   is reported as Unavailable naming the peer, for the failed operation and
//   every later one on that Connection. UCX 1.13's shared-memory transports
//   cannot carry that mode, and UCX picks them for a peer on this host where
//   UCX_TLS allows, so a peer on this host (whatever UCX_TLS) is watched
//   instead: its process through a pidfd (tested before each
//   operation; a sleeping progress thread wakes when it exits; without pidfd
//   support, /proc is read at most every 100 ms), or, for a peer in this
//   process, its Transport. Operations waiting on a peer found gone are
//   handed back with Unavailable.
// - Abort(): UCX cannot cancel an RMA request it has accepted. With peer
//   error handling, aborting an operation that has pieces in flight
//   force-closes its Connection: that operation and every other one pending
//   on it finish with Cancelled, and later ones fail; connect again. Without
//   it (a peer on this host), nothing more is posted and the pieces in flight
//   are waited for (a peer found gone releases them). Aborting a Flush, or an
//   operation none of whose pieces is in flight, touches nothing else.
// - Destroying a Region unmaps it, but peers using software-emulated RMA
//   (tcp, shm on registered memory) are not refused: see the note on Region
//   in transport.h.
// - Addresses and rkeys are UCX's packed bytes wrapped with a magic number,
//   length and checksum, so bytes of the wrong kind or damaged in transit
//   are refused with InvalidArgument before UCX parses them. An address also
//   carries the owner's host boot id, pid, process start time and Transport
//   instance, used only for the liveness checks above.

#include <memory>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace zeroshard::transport::ucx {

// Also reachable as CreateTransport("ucx", options), which passes
// options.ucx. Unavailable (with UCX's reason) when UCX cannot initialise
// for options.tls, e.g. a TLS name that is unknown or has no usable device
// here; InvalidArgument for counts that are not positive;
// FailedPrecondition (saying why) when common.require_enforced_remote_keys
// is set and enforces_remote_keys() would be false, decided before any
// worker starts, so nothing was reachable.
absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(
    const UcxTransportOptions& options = {});

}  // namespace zeroshard::transport::ucx
