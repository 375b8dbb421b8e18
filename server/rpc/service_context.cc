#include "absl/strings/str_cat.h"
#include "common/channel.h"
#include "common/checkpoint_files.h"
#include "common/format.h"
#include "common/peer_identity.h"
#include "common/status_macros.h"
#include "server/rpc/grpc_status.h"
#include "server/rpc/services.h"

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
  if (absl::Status s = ValidateToken(*token, "the bearer token"); !s.ok()) {
    return absl::UnauthenticatedError(s.message());
  }
  if (caller_calls != nullptr) RETURN_IF_ERROR(caller_calls->Admit(call));
  return TokenDigest::Of(*token);
}

absl::StatusOr<std::shared_ptr<Job>> ServiceContext::FindJob(const grpc::ServerContext& call,
                                                             const std::string& id,
                                                             bool serving) const {
  absl::StatusOr<std::optional<ReplicaTarget>> target = ReplicaTargetOf(call.client_metadata());
  if (!target.ok()) return target.status();
  absl::StatusOr<std::shared_ptr<Job>> job =
      target->has_value() ? FindCopy(call, id, (*target)->group) : FindCopy(call, id, ~0u);
  if (!job.ok()) return job.status();
  if (serving) {
    if (!target->has_value() && (*job)->replica() != nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", id, " is replicated: its requests name the replica group and the epoch they "
          "expect (metadata ", kReplicaGroupMetadataKey, " and ", kReplicaEpochMetadataKey,
          ", from Replica.GetReplicaState), so that a replaced copy serves nobody; nothing was "
          "changed"));
    }
    std::optional<uint64_t> epoch;
    if (target->has_value()) epoch = (*target)->epoch;
    if (absl::Status s = (*job)->CheckServing(epoch); !s.ok()) return s;
  }
  return job;
}

absl::StatusOr<std::shared_ptr<Job>> ServiceContext::FindCopy(const grpc::ServerContext& call,
                                                              const std::string& id,
                                                              uint32_t group) const {
  absl::StatusOr<TokenDigest> caller = CallerToken(call, absl::StrCat("job ", id.substr(0, 140)));
  if (!caller.ok()) return caller.status();
  absl::StatusOr<std::shared_ptr<Job>> job = group == ~0u ? jobs->Find(id) : jobs->Find(id, group);
  if (!job.ok()) return job.status();
  if (!(*job)->token().Matches(*caller) && !(admin.has_value() && admin->Matches(*caller))) {
    return absl::PermissionDeniedError(
        absl::StrCat("the token presented does not open job ", id, "; nothing was changed"));
  }
  return job;
}

bool ServiceContext::MayCreateJobs(const grpc::ServerContext& call,
                                   const TokenDigest& caller) const {
  if (!registration.has_value()) return true;
  if (admin.has_value() && admin->Matches(caller)) return true;
  const std::optional<std::string> presented = PresentedRegistrationToken(call.client_metadata());
  return presented.has_value() && registration->Matches(TokenDigest::Of(*presented));
}

JobManager::Registrant ServiceContext::RegistrantOf(const grpc::ServerContext& call,
                                                    const TokenDigest& caller) const {
  JobManager::Registrant r;
  r.may_create = MayCreateJobs(call, caller);
  if (admin.has_value() && admin->Matches(caller)) {
    r.identity = "admin";
    r.exempt = true;
    return r;
  }
  if (tls) {
    const std::string subject = PeerSubjectOf(call.auth_context().get());
    if (!subject.empty()) {
      r.identity = absl::StrCat("cert:", subject);
      return r;
    }
  }
  r.identity = registration.has_value() ? "registration token" : "anonymous";
  return r;
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
  if (!checkpoint_dir.empty()) {
    absl::StatusOr<std::string> owner = ReadCheckpointOwner(checkpoint_dir, id);
    if (!owner.ok()) return owner.status();
    if (!owner->empty()) return CheckFilesOwner(id, *caller);
  }
  absl::StatusOr<std::shared_ptr<Job>> job = jobs->Find(id);
  if (job.ok() && (*job)->token().Matches(*caller)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "job ", id.substr(0, 140), "'s checkpoints are readable with the token of the job that ",
      "saved them, and with the admin token"));
}

absl::Status ServiceContext::CheckFilesOwner(const std::string& job_id,
                                             const TokenDigest& token) const {
  if (checkpoint_dir.empty()) return absl::OkStatus();
  absl::StatusOr<std::string> owner = ReadCheckpointOwner(checkpoint_dir, job_id);
  if (!owner.ok()) return owner.status();
  if (owner->empty()) return absl::OkStatus();
  if (admin.has_value() && admin->Matches(token)) return absl::OkStatus();
  const std::optional<TokenDigest> recorded = TokenDigest::FromHex(*owner);
  if (recorded.has_value() && recorded->Matches(token)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "job ", job_id, "'s checkpoints on this daemon were saved with another job token: to "
      "resume it, use that run's token (ZS_JOB_TOKEN), or choose another job id"));
}

namespace {

// What a save's checks of the checkpoint directory need, by value: they may
// run on the disk worker after the handler stopped waiting for them.
struct SaveClaim {
  std::string dir;
  std::string job_id;
  TokenDigest token;
  // The job's registrant; nullopt when it is no longer registered.
  std::optional<JobManager::Registrant> registrant;
  uint64_t checkpoint_bytes = 0;  // of one save of the job on this daemon
  uint64_t quota = 0;             // 0: no bound

  // ServiceContext::ClaimFiles.
  absl::Status ClaimFiles() const {
    if (dir.empty()) return absl::OkStatus();
    absl::StatusOr<std::string> owner = ReadCheckpointOwner(dir, job_id);
    if (!owner.ok()) return owner.status();
    if (owner->empty()) {
      RETURN_IF_ERROR(WriteCheckpointOwner(dir, job_id, token.ToHex()));
    } else {
      const std::optional<TokenDigest> recorded = TokenDigest::FromHex(*owner);
      if (!recorded.has_value() || !recorded->Matches(token)) {
        return absl::PermissionDeniedError(absl::StrCat(
            "job ", job_id, "'s checkpoints on this daemon were saved with another job token; "
            "this job cannot save beside them (choose another job id)"));
      }
    }
    if (!registrant.has_value() || registrant->exempt || registrant->identity.empty()) {
      return absl::OkStatus();
    }
    absl::StatusOr<std::string> identity = ReadCheckpointIdentity(dir, job_id);
    if (!identity.ok()) return identity.status();
    if (!identity->empty()) return absl::OkStatus();
    return WriteCheckpointIdentity(dir, job_id, registrant->identity);
  }

  // ServiceContext::CheckCheckpointQuota.
  absl::Status CheckQuota() const {
    if (dir.empty() || quota == 0) return absl::OkStatus();
    absl::StatusOr<std::string> identity = ReadCheckpointIdentity(dir, job_id);
    if (!identity.ok()) return identity.status();
    if (identity->empty()) {
      if (!registrant.has_value() || registrant->exempt) return absl::OkStatus();
      *identity = registrant->identity;
    }
    absl::StatusOr<uint64_t> used = CheckpointBytesOfIdentity(dir, *identity);
    if (!used.ok()) return used.status();
    if (checkpoint_bytes > quota || *used > quota - checkpoint_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "job ", job_id, ": a checkpoint of ", FormatBytes(checkpoint_bytes),
          " would take the checkpoints of ", *identity, " on this daemon to ",
          FormatBytes(*used + checkpoint_bytes), ", past its ",
          "--max_checkpoint_bytes_per_identity of ", FormatBytes(quota),
          "; nothing was saved: have the daemon's operator remove old checkpoints of its jobs "
          "from --checkpoint_dir"));
    }
    return absl::OkStatus();
  }
};

SaveClaim SaveClaimOf(const ServiceContext& ctx, const Job& job) {
  SaveClaim c;
  c.dir = ctx.checkpoint_dir;
  c.job_id = job.config().job_id;
  c.token = job.token();
  absl::StatusOr<JobManager::Registrant> registrant = ctx.jobs->RegisteredBy(c.job_id);
  if (registrant.ok()) c.registrant = *std::move(registrant);
  c.checkpoint_bytes =
      job.owned_unpadded().size() * sizeof(float) * ArrayFilesOf(job.spec()).size();
  c.quota = ctx.max_checkpoint_bytes_per_identity;
  return c;
}

}  // namespace

absl::Status ServiceContext::ClaimFiles(const Job& job) const {
  return SaveClaimOf(*this, job).ClaimFiles();
}

absl::Status ServiceContext::CheckCheckpointQuota(const Job& job) const {
  return SaveClaimOf(*this, job).CheckQuota();
}

absl::Status ServiceContext::PrepareSave(const Job& job) const {
  if (checkpoint_dir.empty()) return absl::OkStatus();
  const SaveClaim claim = SaveClaimOf(*this, job);
  return OnCheckpointDisk([claim] {
    RETURN_IF_ERROR(claim.ClaimFiles());
    return claim.CheckQuota();
  });
}

absl::Status ServiceContext::CheckStreamCaller(const grpc::ServerContext& call,
                                               absl::string_view rpc) const {
  absl::StatusOr<TokenDigest> caller = CallerToken(call, rpc);
  if (!caller.ok()) return caller.status();
  if (admin.has_value() && admin->Matches(*caller)) return absl::OkStatus();
  for (const std::shared_ptr<Job>& job : jobs->All()) {
    if (job->token().Matches(*caller)) return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat(
      rpc, ": no job registered on this daemon opens with the token presented; nothing was read"));
}

std::unique_ptr<StreamWatch> ServiceContext::WatchStream(grpc::ServerContext* call) const {
  if (stream_watchdog == nullptr) return std::make_unique<StreamWatch>();
  return stream_watchdog->Watch([call] { call->TryCancel(); });
}

absl::Status ServiceContext::IdleStreamError(absl::string_view what) const {
  return absl::DeadlineExceededError(absl::StrCat(
      what, ": the peer sent or read nothing for ",
      absl::FormatDuration(stream_watchdog != nullptr ? stream_watchdog->idle() : absl::ZeroDuration()),
      " (--stream_idle_timeout_seconds); the stream was cancelled and nothing was applied"));
}

bool ServiceContext::MayOpen(const grpc::ServerContext& call, const Job& job) const {
  std::optional<std::string> token = PresentedToken(call.client_metadata());
  if (!token.has_value()) return false;
  const TokenDigest caller = TokenDigest::Of(*token);
  return job.token().Matches(caller) || (admin.has_value() && admin->Matches(caller));
}

}  // namespace zeroshard
