#pragma once

// Calls in flight per caller, so that one caller cannot hold every thread of
// the daemon's gRPC server (--max_calls_per_caller). A caller is the bearer
// token its zeroshard calls present (every rank of a job, and the job's
// daemons calling each other for it, share one).
//
// A server interceptor (CallerCallsInterceptorFactory) decides each call
// once, when its metadata arrives and before any handler runs: a call that
// would give its caller more than the limit in flight is refused, the
// others are counted until the call ends, whatever the handler does. A
// zeroshard handler reads the decision through Admit(), called from
// ServiceContext::CallerToken before anything is read, and answers a
// refused call RESOURCE_EXHAUSTED. Calls without a token are not counted
// (every zeroshard handler answers them UNAUTHENTICATED at once), nor are
// gRPC's health checks (answered without a thread of their own). Server
// reflection, whose stream holds a thread for as long as its peer keeps it
// open and needs no token, is bounded by the address it comes from
// (kReflectionCallsPerAddress); past it the interceptor cancels the call.
//
// Thread-safe; the interceptor's hooks run on gRPC's threads and never
// block beyond this object's lock.

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/server_interceptor.h"

namespace zeroshard {

class CallerCalls {
 public:
  // Reflection streams one address may have open at once.
  static constexpr int kReflectionCallsPerAddress = 16;

  // `limit`: calls one token may have in flight, at least 1.
  explicit CallerCalls(int limit) : limit_(limit) {}
  CallerCalls(const CallerCalls&) = delete;
  CallerCalls& operator=(const CallerCalls&) = delete;

  int limit() const { return limit_; }

  // The caller key of calls presenting `authorization` metadata `value`.
  static uint64_t TokenKey(absl::string_view value);
  // The caller key of reflection calls from `peer` (grpc::ServerContext::
  // peer(): "ipv4:HOST:PORT", "ipv6:[HOST]:PORT", "unix:PATH").
  static uint64_t AddressKey(absl::string_view peer);

  // The interceptor: counts a call of `key` if the caller holds fewer than
  // `limit` calls, and returns whether it did; otherwise remembers `call`
  // as refused. End() undoes either, once the call has ended.
  bool Start(const void* call, uint64_t key, int limit);
  void End(const void* call, uint64_t key, bool counted);

  // OK unless the interceptor refused `call`; then RESOURCE_EXHAUSTED
  // naming the limit and its flag. Never blocks beyond the lock.
  absl::Status Admit(const grpc::ServerContext& call) const;

  // Calls of `key` in flight now (tests).
  int InFlight(uint64_t key) const;

 private:
  const int limit_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, int> in_flight_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<const void*> refused_ ABSL_GUARDED_BY(mu_);
};

// Makes the interceptor that decides and counts every call of a server in
// `calls` (which must outlive the server).
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
CallerCallsInterceptorFactory(CallerCalls* calls);

}  // namespace zeroshard
