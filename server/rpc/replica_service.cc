#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/auth.h"
#include "server/rpc/peer_role.h"
#include "server/rpc/job_wire.h"
#include "server/rpc/services.h"

namespace zeroshard {
namespace {

// The longest a backup reads a primary's state for one transfer.
constexpr absl::Duration kMaxTransferWait = absl::Minutes(30);
// The longest a backup waits for its primary's daemon to say whether it
// still serves, before a trainer's Promote: a live daemon answers in
// milliseconds; a stopped or cut-off one is taken as gone after this.
constexpr absl::Duration kPrimaryCheckWait = absl::Seconds(1);

// The replica group of a copy: FailedPrecondition for a job that is not
// replicated.
absl::StatusOr<ReplicaGroup*> GroupOf(const absl::StatusOr<std::shared_ptr<Job>>& job) {
  if (!job.ok()) return job.status();
  if (ReplicaGroup* group = (*job)->replica(); group != nullptr) return group;
  return absl::FailedPreconditionError(absl::StrCat(
      "job ", (*job)->config().job_id, " is not replicated (its spec has replicas = 1)"));
}

}  // namespace

absl::Status ReplicaService::FillState(const grpc::ServerContext& call, const std::string& id,
                                       v1::ReplicaState* out) {
  absl::StatusOr<std::shared_ptr<Job>> home = ctx_->FindCopy(call, id, ~0u);
  if (!home.ok()) return home.status();
  out->set_job_id(id);
  for (const std::shared_ptr<Job>& job : ctx_->jobs->All()) {
    if (job->config().job_id != id) continue;
    v1::ReplicaGroupState* group = out->add_groups();
    if (std::optional<ReplicaGroupStatus> r = job->ReplicaState(); r.has_value()) {
      ToWire(*r, group);
    }
  }
  return absl::OkStatus();
}

// GetReplicaState and Promote demand no certificate role: trainers call them
// on failover (client/replica_placement.cc) with the trainer role, and a
// trainer's Promote takes effect only once the backup finds its primary
// gone (ReplicaGroup::CheckPrimaryGone). The calls between daemons below
// demand the daemon role under mutual TLS.
bool ReplicaService::MayReplaceLivePrimary(const grpc::ServerContext& call) const {
  if (ctx_->RequireAdmin(call).ok()) return true;
  return ctx_->tls && (RequirePeerRole(call, PeerRole::kDaemon, true).ok() ||
                       RequirePeerRole(call, PeerRole::kAdmin, true).ok());
}

grpc::Status ReplicaService::GetReplicaState(grpc::ServerContext* call,
                                             const v1::GetReplicaStateRequest* req,
                                             v1::ReplicaState* resp) {
  return ctx_->Done(__func__, FillState(*call, req->job_id(), resp));
}

grpc::Status ReplicaService::Promote(grpc::ServerContext* call, const v1::PromoteRequest* req,
                                     v1::ReplicaState* resp) {
  // The job is held for the whole call: the check below waits on the network.
  const absl::StatusOr<std::shared_ptr<Job>> job =
      ctx_->FindCopy(*call, req->job_id(), req->group());
  absl::StatusOr<ReplicaGroup*> group = GroupOf(job);
  if (!group.ok()) return ctx_->Done(__func__, group.status());
  // A trainer (or any other holder of the job's token) promotes only a
  // backup whose primary is gone for the backup too: it cannot demote a
  // primary that serves. The backup waits its own full time for the
  // primary's answer, so that a caller's short deadline cannot make a live
  // primary look gone.
  if (!MayReplaceLivePrimary(*call)) {
    const absl::Time check_deadline = absl::Now() + kPrimaryCheckWait;
    if (absl::FromChrono(call->deadline()) < check_deadline + absl::Milliseconds(100)) {
      return ctx_->Done(__func__, absl::DeadlineExceededError(absl::StrCat(
                                      "Promote: the call's deadline leaves less than ",
                                      absl::FormatDuration(kPrimaryCheckWait),
                                      " to ask the group's primary whether it is gone; nothing "
                                      "was changed")));
    }
    const std::string token = PresentedToken(call->client_metadata()).value_or("");
    if (absl::Status s = (*group)->CheckPrimaryGone(token, check_deadline); !s.ok()) {
      return ctx_->Done(__func__, s);
    }
    if (call->IsCancelled()) {
      return ctx_->Done(__func__, absl::CancelledError("Promote: the caller cancelled the call; "
                                                       "nothing was changed"));
    }
  }
  if (absl::Status s = (*group)->Promote(*req); !s.ok()) return ctx_->Done(__func__, s);
  return ctx_->Done(__func__, FillState(*call, req->job_id(), resp));
}

namespace {

// Checks the call's token, reads the stream's first chunk and finds the
// copy it names: the handlers' common start.
template <typename Chunk>
absl::StatusOr<std::shared_ptr<Job>> FirstChunk(ServiceContext* ctx, const char* rpc,
                                                grpc::ServerContext* call, StreamWatch* watch,
                                                grpc::ServerReader<Chunk>* reader, Chunk* first) {
  if (absl::Status s = ctx->CheckStreamCaller(*call, rpc); !s.ok()) return s;
  if (!watch->Wait([&] { return reader->Read(first); })) {
    if (watch->expired()) return ctx->IdleStreamError(rpc);
    return absl::InvalidArgumentError("the stream carried no chunk");
  }
  return ctx->FindCopy(*call, first->job_id(), first->group());
}

// Reads the next chunk. That later chunks name the first one's job (or
// none) is checked by the job with the rest of each chunk, so that a stream
// refused for it applies nothing.
template <typename Chunk>
bool NextChunk(StreamWatch* watch, grpc::ServerReader<Chunk>* reader, Chunk* chunk) {
  return watch->Wait([&] { return reader->Read(chunk); });
}

}  // namespace

grpc::Status ReplicaService::TransferState(grpc::ServerContext* call,
                                           grpc::ServerReader<v1::ReplicaStateChunk>* reader,
                                           v1::TransferStateResponse* resp) {
  if (absl::Status s = RequirePeerRole(*call, PeerRole::kDaemon, ctx_->tls); !s.ok()) {
    return ctx_->Done(__func__, s);
  }
  const std::unique_ptr<StreamWatch> watch = ctx_->WatchStream(call);
  v1::ReplicaStateChunk first;
  // Held for the whole transfer (it may read for minutes).
  const absl::StatusOr<std::shared_ptr<Job>> job =
      FirstChunk(ctx_, __func__, call, watch.get(), reader, &first);
  absl::StatusOr<ReplicaGroup*> group = GroupOf(job);
  if (!group.ok()) return ctx_->Done(__func__, group.status());
  // A bulk transfer reads the primary's arrays within the caller's deadline.
  const absl::Time deadline =
      std::min(absl::FromChrono(call->deadline()), absl::Now() + kMaxTransferWait);
  absl::StatusOr<v1::TransferStateResponse> r = (*group)->AcceptState(
      first, [&](v1::ReplicaStateChunk* c) { return NextChunk(watch.get(), reader, c); },
      deadline);
  if (watch->expired()) return ctx_->Done(__func__, ctx_->IdleStreamError(__func__));
  if (!r.ok()) return ctx_->Done(__func__, r.status());
  *resp = *std::move(r);
  return ctx_->Done(__func__, absl::OkStatus());
}

grpc::Status ReplicaService::ForwardGradient(grpc::ServerContext* call,
                                             grpc::ServerReader<v1::ForwardedGradientChunk>* reader,
                                             v1::ForwardGradientResponse* resp) {
  if (absl::Status s = RequirePeerRole(*call, PeerRole::kDaemon, ctx_->tls); !s.ok()) {
    return ctx_->Done(__func__, s);
  }
  const std::unique_ptr<StreamWatch> watch = ctx_->WatchStream(call);
  v1::ForwardedGradientChunk first;
  const absl::StatusOr<std::shared_ptr<Job>> job =
      FirstChunk(ctx_, __func__, call, watch.get(), reader, &first);
  absl::StatusOr<ReplicaGroup*> group = GroupOf(job);
  if (!group.ok()) return ctx_->Done(__func__, group.status());
  absl::StatusOr<v1::ForwardGradientResponse> r = (*group)->AcceptGradient(
      first, [&](v1::ForwardedGradientChunk* c) { return NextChunk(watch.get(), reader, c); });
  if (watch->expired()) return ctx_->Done(__func__, ctx_->IdleStreamError(__func__));
  if (!r.ok()) return ctx_->Done(__func__, r.status());
  *resp = *std::move(r);
  return ctx_->Done(__func__, absl::OkStatus());
}

grpc::Status ReplicaService::CommitReplica(grpc::ServerContext* call,
                                           const v1::CommitReplicaRequest* req,
                                           v1::CommitStepResponse* resp) {
  if (absl::Status s = RequirePeerRole(*call, PeerRole::kDaemon, ctx_->tls); !s.ok()) {
    return ctx_->Done(__func__, s);
  }
  // Held for the call: the commit waits for the commit lock.
  const absl::StatusOr<std::shared_ptr<Job>> job =
      ctx_->FindCopy(*call, req->job_id(), req->group());
  absl::StatusOr<ReplicaGroup*> group = GroupOf(job);
  if (!group.ok()) return ctx_->Done(__func__, group.status());
  absl::StatusOr<v1::CommitStepResponse> r = (*group)->CommitReplica(*req);
  if (!r.ok()) return ctx_->Done(__func__, r.status());
  *resp = *std::move(r);
  return ctx_->Done(__func__, absl::OkStatus());
}

grpc::Status ReplicaService::ReleaseReplica(grpc::ServerContext* call,
                                            const v1::ReleaseReplicaRequest* req,
                                            v1::ReleaseReplicaResponse*) {
  if (absl::Status s = RequirePeerRole(*call, PeerRole::kDaemon, ctx_->tls); !s.ok()) {
    return ctx_->Done(__func__, s);
  }
  absl::StatusOr<std::shared_ptr<Job>> job = ctx_->FindCopy(*call, req->job_id(), req->group());
  if (!job.ok()) return ctx_->Done(__func__, job.status());
  // Only the group's current primary releases its backup.
  absl::StatusOr<ReplicaGroup*> group = GroupOf(job);
  if (!group.ok()) return ctx_->Done(__func__, group.status());
  if (absl::Status s = (*group)->CheckDrivenBy(req->epoch(), /*transfer=*/false); !s.ok()) {
    return ctx_->Done(__func__, s);
  }
  ctx_->jobs->Remove(*job);
  ctx_->metrics->SetJobs(ctx_->jobs->size());
  return ctx_->Done(__func__, absl::OkStatus());
}

}  // namespace zeroshard
