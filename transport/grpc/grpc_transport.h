#pragma once

// The "grpc" transport: one-sided Put and Get into registered regions,
// carried as chunked gRPC streams (service RegionAccess in
// region_access.proto) over plain TCP. It needs no special hardware or
// library beyond gRPC, and every byte is copied by the serving side's CPU.
//
// Serving side: each Transport runs its own grpc::Server on
// GrpcTransportOptions::listen_address ("HOST:PORT"; empty: "127.0.0.1:0").
// LocalAddress() is "HOST:PORT" with the port actually bound and, as HOST,
// GrpcTransportOptions::advertise_host when set, else the listen host; a
// wildcard listen host (0.0.0.0, [::]) is replaced by this machine's primary
// address (PrimaryHostAddress(), transport/host_address.h), never advertised
// itself. Region descriptors carry no address: peers reach a region through
// a Connection to LocalAddress(). Incoming Puts and
// Gets run on gRPC's own server threads, which copy straight between the
// stream's messages and the region's memory.
//
// Initiating side: Connect() opens a gRPC channel of its own (one TCP
// connection per Connection), waits until it is connected and asks the peer
// for its name (peer_name()). Each Connection has one worker thread that runs
// its operations one at a time in issue order, each as one RPC: a later Put
// wins, and a Get sees every earlier Put. Put/Get never block; Flush waits
// for the operations issued before it and then pings the peer (Unavailable
// if it is gone). Operations are sent in chunks of min(max_piece_bytes,
// 1 MiB), paced by gRPC's flow control. Every RPC carries a deadline of its own
// (60 s plus 1 s per MiB), so a stuck peer cannot hold the worker forever;
// the RPC then fails with Unavailable.
//
// Semantics beyond transport.h:
// - Regions: the descriptor's address is the base pointer, its rkey a region
//   id plus a random 64-bit token. The server refuses an unknown id or a
//   wrong token with Unavailable ("region no longer exists"), a range outside
//   the region or a mismatched address with InvalidArgument, and a direction
//   the region's Access does not allow with PermissionDenied. All of this is
//   checked, in software, before the first byte is written or read, so
//   enforces_remote_keys() is true (TLS keeps keys secret in transit;
//   without it they cross the network in plaintext).
// - Destroying a Region revokes it: it waits for chunk copies into or out of
//   it that are under way (at most one chunk each) and later accesses fail
//   with Unavailable, so no write lands in freed memory. A Put that the
//   revocation interrupts has written its earlier chunks.
// - AllocateRegion returns zeroed, 64-byte aligned heap memory.
// - Abort() of a queued operation finishes it at once with Cancelled and it
//   is never sent. Abort() of a running one cancels its RPC and finishes it
//   with Cancelled once the worker has let go of the buffer (promptly); bytes
//   that already reached the target stay written. Other operations on the
//   Connection are not affected.
// - Errors: a peer that is gone, unreachable or shut down, or that breaks a
//   stream, is Unavailable naming the peer; the server's InvalidArgument and
//   PermissionDenied come back with its message. Connect(): InvalidArgument
//   for bytes that are not "HOST:PORT"; otherwise it retries connecting until
//   the deadline and then returns Unavailable if the last attempt failed,
//   DeadlineExceeded if it was still under way.
// - Destroying the Transport shuts its server down (in-flight incoming RPCs
//   get 0.5 s, then are cancelled), so peers see Unavailable, and closes its
//   Connections: their running RPCs are cancelled, and their queued and later
//   operations fail with FailedPrecondition. Regions and Connections may
//   outlive it. Destroying a Connection cancels its running RPC, finishes its
//   queued operations with Cancelled and joins its worker thread.

#include <memory>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace zeroshard::transport::grpc {

// Also reachable as CreateTransport("grpc", options), which passes
// options.grpc. InvalidArgument if listen_address is not "HOST:PORT",
// advertise_host is not a host (CanonicalHost) or common.max_piece_bytes is
// 0; FailedPrecondition if listen_address's host is a wildcard, advertise_host
// is empty and this machine has no primary address (nothing started);
// Unavailable if the server cannot bind it (e.g. the port is taken); the TLS
// files' errors (common/tls.h). Blocks while the server starts, and while
// this machine's name resolves (wildcard without advertise_host).
absl::StatusOr<std::unique_ptr<Transport>> CreateGrpcTransport(
    const GrpcTransportOptions& options = {});

}  // namespace zeroshard::transport::grpc
