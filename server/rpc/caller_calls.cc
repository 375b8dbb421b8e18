#include "server/rpc/caller_calls.h"

#include <algorithm>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/auth.h"

namespace zeroshard {

CallerCalls::Caller CallerCalls::CallerOf(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata, absl::string_view peer) {
  auto it = metadata.find(kAuthorizationMetadataKey);
  if (it != metadata.end()) {
    return Caller{absl::HashOf(absl::string_view("token"),
                               absl::string_view(it->second.data(), it->second.size())),
                  true};
  }
  // "ipv4:10.0.0.1:5000", "ipv6:[::1]:5000": the host, without the port;
  // "unix:/path" has no port.
  if (!absl::StartsWith(peer, "unix:")) {
    const size_t colon = peer.rfind(':');
    if (colon != absl::string_view::npos && colon > peer.find(':')) peer = peer.substr(0, colon);
  }
  return Caller{absl::HashOf(absl::string_view("peer"), peer), false};
}

void CallerCalls::Started(uint64_t key) {
  absl::MutexLock lock(&mu_);
  ++in_flight_[key];
}

void CallerCalls::Ended(uint64_t key) {
  absl::MutexLock lock(&mu_);
  auto it = in_flight_.find(key);
  if (it == in_flight_.end()) return;
  if (--it->second <= 0) in_flight_.erase(it);
}

int CallerCalls::LimitOf(const Caller& caller) const {
  return caller.has_token ? limit_ : std::min(limit_, kTokenlessCallsPerAddress);
}

bool CallerCalls::Within(const Caller& caller) const {
  return InFlight(caller.key) <= LimitOf(caller);
}

absl::Status CallerCalls::Admit(const grpc::ServerContext& call) const {
  const Caller caller = CallerOf(call.client_metadata(), call.peer());
  const int held = InFlight(caller.key);
  const int limit = LimitOf(caller);
  if (held <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "this caller (its token) already has ", held - 1,
      " calls in flight on this daemon, its limit (--max_calls_per_caller=", limit,
      "); wait for some to end, or raise the daemon's --max_calls_per_caller and "
      "--max_rpc_threads"));
}

int CallerCalls::InFlight(uint64_t key) const {
  absl::MutexLock lock(&mu_);
  auto it = in_flight_.find(key);
  return it == in_flight_.end() ? 0 : it->second;
}

size_t CallerCalls::callers() const {
  absl::MutexLock lock(&mu_);
  return in_flight_.size();
}

namespace {

// gRPC's own services, which no handler of ours answers: past the limit
// the interceptor cancels their calls itself.
bool IsZeroshardMethod(const char* method) {
  return absl::StartsWith(method == nullptr ? "" : method, "/zeroshard.");
}

class CallerCallsInterceptor final : public grpc::experimental::Interceptor {
 public:
  CallerCallsInterceptor(CallerCalls* calls, grpc::experimental::ServerRpcInfo* info)
      : calls_(calls), info_(info) {}
  // The call has ended: the server destroys its interceptors with it.
  ~CallerCallsInterceptor() override {
    if (counted_) calls_->Ended(key_);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      grpc::ServerContextBase* context = info_->server_context();
      const CallerCalls::Caller caller = CallerCalls::CallerOf(
          *methods->GetRecvInitialMetadata(), context == nullptr ? std::string() : context->peer());
      key_ = caller.key;
      calls_->Started(key_);
      counted_ = true;
      if (!IsZeroshardMethod(info_->method()) && !calls_->Within(caller) && context != nullptr) {
        context->TryCancel();
      }
    }
    methods->Proceed();
  }

 private:
  CallerCalls* const calls_;
  grpc::experimental::ServerRpcInfo* const info_;
  uint64_t key_ = 0;
  bool counted_ = false;
};

class CallerCallsFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CallerCallsFactory(CallerCalls* calls) : calls_(calls) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new CallerCallsInterceptor(calls_, info);
  }

 private:
  CallerCalls* const calls_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
CallerCallsInterceptorFactory(CallerCalls* calls) {
  return std::make_unique<CallerCallsFactory>(calls);
}

}  // namespace zeroshard
