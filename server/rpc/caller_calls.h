#pragma once

// Calls in flight per caller, so that one caller cannot hold every thread of
// the daemon's gRPC server (--max_calls_per_caller). A caller is the bearer
// token a call presents (all ranks of a job share one), or, for a call
// without a token, the address it comes from (the host part of the peer).
//
// A server interceptor (CallerCallsInterceptorFactory) counts each call from
// the moment its metadata arrives to the moment it ends, whatever the
// handler does. A zeroshard handler asks Admit() once it has read the token
// (ServiceContext::CallerToken) and answers RESOURCE_EXHAUSTED when the
// caller holds more than the limit, its own call included. Calls without a
// token (only gRPC's health and reflection services answer those) are held
// to kTokenlessCallsPerAddress per address; past it the interceptor cancels
// them, as no handler of ours sees them.
//
// Thread-safe; the interceptor's hooks run on gRPC's threads and never
// block beyond this object's lock.

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/server_interceptor.h"

namespace zeroshard {

class CallerCalls {
 public:
  // Calls without a token one address may have in flight: health checks and
  // reflection take a moment each, and a reflection stream holds a thread
  // for as long as its peer keeps it open.
  static constexpr int kTokenlessCallsPerAddress = 16;

  // Who a call comes from.
  struct Caller {
    uint64_t key = 0;
    bool has_token = false;
  };

  // `limit`: calls one caller may have in flight, at least 1.
  explicit CallerCalls(int limit) : limit_(limit) {}
  CallerCalls(const CallerCalls&) = delete;
  CallerCalls& operator=(const CallerCalls&) = delete;

  int limit() const { return limit_; }

  // The caller of a call: a hash of its bearer token when it presents one
  // (`authorization` metadata, whatever its form), else of its peer's host.
  static Caller CallerOf(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                         absl::string_view peer);

  // Counts a call of `key` as started / ended (the interceptor).
  void Started(uint64_t key);
  void Ended(uint64_t key);

  // OK while the call's caller holds at most its limit (this call
  // included); RESOURCE_EXHAUSTED naming the limit and its flag otherwise.
  absl::Status Admit(const grpc::ServerContext& call) const;
  // The same by caller: whether it is within its limit.
  bool Within(const Caller& caller) const;
  int LimitOf(const Caller& caller) const;

  // Calls of `key` in flight now (tests, the status page).
  int InFlight(uint64_t key) const;
  // Callers with a call in flight.
  size_t callers() const;

 private:
  const int limit_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, int> in_flight_ ABSL_GUARDED_BY(mu_);
};

// Makes the interceptor that counts every call of a server in `calls`
// (which must outlive the server).
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
CallerCallsInterceptorFactory(CallerCalls* calls);

}  // namespace zeroshard
