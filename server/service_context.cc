#include "absl/strings/str_cat.h"
#include "server/grpc_status.h"
#include "server/services.h"

namespace zeroshard {

grpc::Status ServiceContext::Done(const char* rpc, const absl::Status& status) {
  metrics->RecordRequest(rpc, status);
  return ToGrpc(status);
}

absl::StatusOr<TokenDigest> ServiceContext::CallerToken(const grpc::ServerContext& call,
                                                        absl::string_view what) const {
  std::optional<std::string> token = PresentedToken(call.client_metadata());
  if (!token.has_value()) {
    return absl::UnauthenticatedError(absl::StrCat(
        what,
        " needs a token: send \"authorization: Bearer <token>\" (the job's token: "
        "ZS_JOB_TOKEN, ClientConfig.job_token, zsctl --token_file; or the admin token)"));
  }
  return TokenDigest::Of(*token);
}

absl::StatusOr<std::shared_ptr<Job>> ServiceContext::FindJob(const grpc::ServerContext& call,
                                                             const std::string& id) const {
  absl::StatusOr<TokenDigest> caller = CallerToken(call, absl::StrCat("job ", id.substr(0, 140)));
  if (!caller.ok()) return caller.status();
  absl::StatusOr<std::shared_ptr<Job>> job = jobs->Find(id);
  if (!job.ok()) return job.status();
  if (!(*job)->token().Matches(*caller) && !(admin.has_value() && admin->Matches(*caller))) {
    return absl::PermissionDeniedError(
        absl::StrCat("the token presented does not open job ", id, "; nothing was changed"));
  }
  return job;
}

absl::Status ServiceContext::RequireAdmin(const grpc::ServerContext& call) const {
  absl::StatusOr<TokenDigest> caller = CallerToken(call, "this request");
  if (!caller.ok()) return caller.status();
  if (!admin.has_value()) {
    return absl::PermissionDeniedError(
        "this request needs the admin token, and this zeroshardd has none (--admin_token_file)");
  }
  if (!admin->Matches(*caller)) {
    return absl::PermissionDeniedError("this request needs the admin token (--admin_token_file)");
  }
  return absl::OkStatus();
}

absl::Status ServiceContext::AuthorizeJobFiles(const grpc::ServerContext& call,
                                               const std::string& id) const {
  absl::StatusOr<TokenDigest> caller = CallerToken(call, absl::StrCat("job ", id.substr(0, 140)));
  if (!caller.ok()) return caller.status();
  if (admin.has_value() && admin->Matches(*caller)) return absl::OkStatus();
  absl::StatusOr<std::shared_ptr<Job>> job = jobs->Find(id);
  if (job.ok() && (*job)->token().Matches(*caller)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "job ", id.substr(0, 140), "'s checkpoints are readable with the job's token while it ",
      "is registered here, and with the admin token"));
}

bool ServiceContext::MayOpen(const grpc::ServerContext& call, const Job& job) const {
  std::optional<std::string> token = PresentedToken(call.client_metadata());
  if (!token.has_value()) return false;
  const TokenDigest caller = TokenDigest::Of(*token);
  return job.token().Matches(caller) || (admin.has_value() && admin->Matches(caller));
}

}  // namespace zeroshard
