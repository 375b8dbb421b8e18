#include "common/channel.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/auth.h"
#include "grpcpp/support/client_interceptor.h"

namespace zeroshard {
namespace {

// Adds the bearer token to every call's initial metadata. Call credentials
// would do the same but gRPC sends them only over TLS; tokens also guard
// plaintext loopback daemons.
class TokenInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit TokenInterceptor(const std::string* value) : value_(value) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({kAuthorizationMetadataKey, *value_});
    }
    methods->Proceed();
  }

 private:
  const std::string* const value_;  // owned by the factory, which outlives the channel's calls
};

class TokenInterceptorFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit TokenInterceptorFactory(const std::string& token)
      : value_(absl::StrCat(kBearerPrefix, token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new TokenInterceptor(&value_);
  }

 private:
  const std::string value_;
};

}  // namespace

ChannelSecurity ChannelSecurity::Plaintext(std::string token) {
  ChannelSecurity s;
  s.credentials = grpc::InsecureChannelCredentials();
  s.token = std::move(token);
  return s;
}

absl::StatusOr<ChannelSecurity> MakeChannelSecurity(const TlsFiles& tls, std::string token,
                                                    absl::string_view prefix) {
  if (!token.empty()) {
    if (absl::Status s = ValidateToken(token, absl::StrCat(prefix, "token")); !s.ok()) return s;
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      MakeChannelCredentials(tls, prefix);
  if (!credentials.ok()) return credentials.status();
  ChannelSecurity s;
  s.credentials = *std::move(credentials);
  s.token = std::move(token);
  s.tls = tls.enabled();
  return s;
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const ChannelSecurity& security,
                                           grpc::ChannelArguments args) {
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      security.credentials != nullptr ? security.credentials : grpc::InsecureChannelCredentials();
  if (security.token.empty()) return grpc::CreateCustomChannel(address, credentials, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
  factories.push_back(std::make_unique<TokenInterceptorFactory>(security.token));
  return grpc::experimental::CreateCustomChannelWithInterceptors(address, credentials, args,
                                                                 std::move(factories));
}

}  // namespace zeroshard
