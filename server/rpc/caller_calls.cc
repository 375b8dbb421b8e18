#include "server/rpc/caller_calls.h"

#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/auth.h"

namespace zeroshard {

uint64_t CallerCalls::TokenKey(absl::string_view value) {
  return absl::HashOf(absl::string_view("token"), value);
}

uint64_t CallerCalls::AddressKey(absl::string_view peer) {
  // The host, without the port; "unix:PATH" has none.
  if (!absl::StartsWith(peer, "unix:")) {
    const size_t colon = peer.rfind(':');
    if (colon != absl::string_view::npos && colon > peer.find(':')) peer = peer.substr(0, colon);
  }
  return absl::HashOf(absl::string_view("address"), peer);
}

bool CallerCalls::Start(const void* call, uint64_t key, int limit) {
  absl::MutexLock lock(&mu_);
  int& held = in_flight_[key];
  if (held < limit) {
    ++held;
    return true;
  }
  if (held == 0) in_flight_.erase(key);
  refused_.insert(call);
  return false;
}

void CallerCalls::End(const void* call, uint64_t key, bool counted) {
  absl::MutexLock lock(&mu_);
  if (!counted) {
    refused_.erase(call);
    return;
  }
  auto it = in_flight_.find(key);
  if (it != in_flight_.end() && --it->second <= 0) in_flight_.erase(it);
}

absl::Status CallerCalls::Admit(const grpc::ServerContext& call) const {
  const void* id = static_cast<const grpc::ServerContextBase*>(&call);
  {
    absl::MutexLock lock(&mu_);
    if (!refused_.contains(id)) return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "this caller (its token) already has ", limit_,
      " calls in flight on this daemon, its limit (--max_calls_per_caller=", limit_,
      "); nothing was read: retry once some have ended, or raise the daemon's "
      "--max_calls_per_caller and --max_rpc_threads"));
}

int CallerCalls::InFlight(uint64_t key) const {
  absl::MutexLock lock(&mu_);
  auto it = in_flight_.find(key);
  return it == in_flight_.end() ? 0 : it->second;
}

namespace {

class CallerCallsInterceptor final : public grpc::experimental::Interceptor {
 public:
  CallerCallsInterceptor(CallerCalls* calls, grpc::experimental::ServerRpcInfo* info)
      : calls_(calls), info_(info) {}
  // The call has ended: the server destroys its interceptors with it.
  ~CallerCallsInterceptor() override {
    if (decided_) calls_->End(call_, key_, counted_);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (!decided_ && methods->QueryInterceptionHookPoint(
                         grpc::experimental::InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      Decide(*methods->GetRecvInitialMetadata());
    }
    methods->Proceed();
  }

 private:
  void Decide(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) {
    grpc::ServerContextBase* context = info_->server_context();
    const absl::string_view method = info_->method() == nullptr ? "" : info_->method();
    if (context == nullptr) return;
    call_ = context;
    if (absl::StartsWith(method, "/zeroshard.")) {
      auto it = metadata.find(kAuthorizationMetadataKey);
      if (it == metadata.end()) return;  // answered UNAUTHENTICATED at once
      key_ = CallerCalls::TokenKey(absl::string_view(it->second.data(), it->second.size()));
      decided_ = true;
      counted_ = calls_->Start(context, key_, calls_->limit());
      return;
    }
    if (!absl::StartsWith(method, "/grpc.reflection.")) return;
    key_ = CallerCalls::AddressKey(context->peer());
    decided_ = true;
    counted_ = calls_->Start(context, key_, CallerCalls::kReflectionCallsPerAddress);
    if (!counted_) context->TryCancel();
  }

  CallerCalls* const calls_;
  grpc::experimental::ServerRpcInfo* const info_;
  const void* call_ = nullptr;  // the call's context, as Admit() finds it
  uint64_t key_ = 0;
  bool decided_ = false;
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
