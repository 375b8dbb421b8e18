#include "common/channel.h"

#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/auth.h"
#include "grpcpp/support/client_interceptor.h"

namespace zeroshard {
namespace {

using MetadataPairs = std::vector<std::pair<std::string, std::string>>;

// Adds fixed pairs (the bearer token, the replica target) to every call's
// initial metadata. Call credentials would do the same for the token but
// gRPC sends them only over TLS; tokens also guard plaintext loopback
// daemons.
class MetadataInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit MetadataInterceptor(const MetadataPairs* pairs) : pairs_(pairs) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      for (const auto& [key, value] : *pairs_) {
        methods->GetSendInitialMetadata()->insert({key, value});
      }
    }
    methods->Proceed();
  }

 private:
  const MetadataPairs* const pairs_;  // owned by the factory, which outlives the channel's calls
};

class MetadataInterceptorFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit MetadataInterceptorFactory(MetadataPairs pairs) : pairs_(std::move(pairs)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new MetadataInterceptor(&pairs_);
  }

 private:
  const MetadataPairs pairs_;
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

absl::StatusOr<std::optional<ReplicaTarget>> ReplicaTargetOf(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) {
  auto value = [&](const char* key) -> std::optional<std::string> {
    auto it = metadata.find(key);
    if (it == metadata.end()) return std::nullopt;
    return std::string(it->second.data(), it->second.size());
  };
  const std::optional<std::string> group = value(kReplicaGroupMetadataKey);
  const std::optional<std::string> epoch = value(kReplicaEpochMetadataKey);
  if (!group.has_value() && !epoch.has_value()) return std::optional<ReplicaTarget>();
  ReplicaTarget t;
  if (!group.has_value() || !epoch.has_value() || !absl::SimpleAtoi(*group, &t.group) ||
      !absl::SimpleAtoi(*epoch, &t.epoch)) {
    return absl::InvalidArgumentError(absl::StrCat("metadata ", kReplicaGroupMetadataKey, " and ",
                                                   kReplicaEpochMetadataKey,
                                                   " go together, as decimal numbers"));
  }
  return std::optional<ReplicaTarget>(t);
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const ChannelSecurity& security,
                                           grpc::ChannelArguments args,
                                           std::optional<ReplicaTarget> target) {
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      security.credentials != nullptr ? security.credentials : grpc::InsecureChannelCredentials();
  MetadataPairs pairs;
  if (!security.token.empty()) {
    pairs.emplace_back(kAuthorizationMetadataKey, absl::StrCat(kBearerPrefix, security.token));
  }
  if (target.has_value()) {
    pairs.emplace_back(kReplicaGroupMetadataKey, absl::StrCat(target->group));
    pairs.emplace_back(kReplicaEpochMetadataKey, absl::StrCat(target->epoch));
  }
  if (pairs.empty()) return grpc::CreateCustomChannel(address, credentials, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
  factories.push_back(std::make_unique<MetadataInterceptorFactory>(std::move(pairs)));
  return grpc::experimental::CreateCustomChannelWithInterceptors(address, credentials, args,
                                                                 std::move(factories));
}

}  // namespace zeroshard
