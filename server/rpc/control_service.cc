#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/job_id.h"
#include "common/protocol.h"
#include "server/rpc/job_wire.h"
#include "server/rpc/services.h"

namespace zeroshard {
namespace {

void Log(const std::string& line) { std::fprintf(stderr, "zeroshardd: %s\n", line.c_str()); }

}  // namespace

grpc::Status ControlService::RegisterJob(grpc::ServerContext* call,
                                         const v1::RegisterJobRequest* req,
                                         v1::RegisterJobResponse* resp) {
  absl::StatusOr<TokenDigest> token = ctx_->CallerToken(*call, "RegisterJob");
  if (!token.ok()) return ctx_->Done(__func__, token.status());
  // A job id with checkpoints here opens only with their owner's token
  // (an invalid id is refused by the registration itself).
  if (IsValidJobId(req->spec().job_id())) {
    absl::Status s = ctx_->CheckFilesOwner(req->spec().job_id(), *token);
    if (!s.ok()) return ctx_->Done(__func__, s);
  }
  bool created = false;
  absl::StatusOr<std::shared_ptr<Job>> job = ctx_->jobs->Register(
      *req, *token, ctx_->draining.load(), ctx_->RegistrantOf(*call, *token), &created);
  if (!job.ok()) return ctx_->Done(__func__, job.status());
  const JobConfig& c = (*job)->config();
  resp->set_created(created);
  FillPartitionMap(c, resp->mutable_partition_map());
  for (uint32_t p : (*job)->owned_partitions()) resp->add_owned_partitions(p);
  ctx_->metrics->SetJobs(ctx_->jobs->size());
  if (created) {
    ctx_->metrics->SetRanks(c.job_id, 0, c.world_size);
    Log(absl::StrCat("job ", c.job_id, " registered: stage ", c.stage, ", N_d ", c.world_size,
                     ", Ψ ", c.layout.parameter_count(), ", partitions ",
                     (*job)->owned_partitions().size(), " owned here, by ",
                     ctx_->RegistrantOf(*call, *token).identity,
                     (*job)->state_disk_bytes() == 0
                         ? std::string()
                         : absl::StrCat("; masters and moments on --state_dir (",
                                        (*job)->state_disk_bytes(), " bytes)")));
  }
  return ctx_->Done(__func__, absl::OkStatus());
}

grpc::Status ControlService::JoinJob(grpc::ServerContext* call, const v1::JoinJobRequest* req,
                                     v1::JoinJobResponse* resp) {
  absl::StatusOr<std::shared_ptr<Job>> job = ctx_->FindJob(*call, req->job_id());
  if (!job.ok()) return ctx_->Done(__func__, job.status());
  absl::StatusOr<JoinResult> joined = (*job)->Join(FromWire(*req));
  if (joined.ok()) ToWire(*joined, resp);
  const absl::Status s = joined.status();
  if (s.ok()) {
    const uint32_t world = (*job)->config().world_size;
    ctx_->metrics->SetRanks(req->job_id(),
                            (*job)->RanksConnected(ctx_->jobs->options().rank_timeout), world);
    std::string replaced;
    if (resp->replaced_incarnation() != 0) {
      replaced =
          absl::StrCat(", replacing incarnation ", resp->replaced_incarnation(), " (",
                       resp->dropped_contributions(), " of its buffered contributions to step ",
                       resp->committed_step() + 1, " dropped)");
    }
    Log(absl::StrCat("job ", req->job_id(), " rank ", req->rank(), " joined as incarnation ",
                     req->incarnation(), replaced, " (", resp->ranks_connected(), "/", world,
                     " joined)"));
  }
  return ctx_->Done(__func__, s);
}

grpc::Status ControlService::GetPartitionMap(grpc::ServerContext* call,
                                             const v1::GetPartitionMapRequest* req,
                                             v1::PartitionMap* resp) {
  absl::StatusOr<std::shared_ptr<Job>> job = ctx_->FindJob(*call, req->job_id(), /*serving=*/false);
  if (!job.ok()) return ctx_->Done(__func__, job.status());
  FillPartitionMap((*job)->config(), resp);
  return ctx_->Done(__func__, absl::OkStatus());
}

grpc::Status ControlService::Heartbeat(grpc::ServerContext* call, const v1::HeartbeatRequest* req,
                                       v1::HeartbeatResponse*) {
  absl::StatusOr<std::shared_ptr<Job>> job = ctx_->FindJob(*call, req->job_id());
  if (!job.ok()) return ctx_->Done(__func__, job.status());
  return ctx_->Done(__func__, (*job)->CheckRank(req->rank(), req->incarnation(), ""));
}

grpc::Status ControlService::Leave(grpc::ServerContext* call, const v1::LeaveRequest* req,
                                   v1::LeaveResponse* resp) {
  absl::StatusOr<std::shared_ptr<Job>> job = ctx_->FindJob(*call, req->job_id());
  if (!job.ok()) return ctx_->Done(__func__, job.status());
  if (req->unreported_read_bytes() > kMaxUnreportedReadBytes) {
    return ctx_->Done(__func__, absl::InvalidArgumentError(absl::StrCat(
                                    "unreported_read_bytes: at most ", kMaxUnreportedReadBytes,
                                    ", got ", req->unreported_read_bytes())));
  }
  absl::StatusOr<bool> last = (*job)->Leave(req->rank(), req->incarnation());
  if (!last.ok()) return ctx_->Done(__func__, last.status());
  if (req->unreported_read_bytes() != 0 && ctx_->bulk != nullptr) {
    ctx_->metrics->RecordTraffic(req->job_id(), "gather", ctx_->bulk->kind(),
                                 req->unreported_read_bytes());
  }
  Log(absl::StrCat("job ", req->job_id(), " rank ", req->rank(), " left"));
  const uint32_t world = (*job)->config().world_size;
  ctx_->metrics->SetRanks(req->job_id(),
                          (*job)->RanksConnected(ctx_->jobs->options().rank_timeout), world);
  if (*last) {
    // The job was marked removed under its rank lock (no staging can be
    // created for it any more); its memory stays for the read lease.
    ctx_->jobs->Remove(*job);
    ctx_->metrics->SetJobs(ctx_->jobs->size());
    Log(absl::StrCat("job ", req->job_id(), " removed: every rank has left"));
    if ((*job)->replicated() && ctx_->replica_link != nullptr) {
      // The backup's copy goes too; best effort (an unreachable backup is
      // released when its own daemon's ranks leave, or with the daemon).
      v1::ReleaseReplicaRequest release;
      release.set_job_id(req->job_id());
      release.set_group((*job)->daemon_index());
      release.set_epoch((*job)->epoch());
      absl::Status s = ctx_->replica_link->ReleaseReplica(
          (*job)->peer_address(), PresentedToken(call->client_metadata()).value_or(""), release,
          absl::Now() + ctx_->replica_timeout);
      if (!s.ok())
        Log(absl::StrCat("job ", req->job_id(), ": the backup was not released: ", s.message()));
    }
  }
  resp->set_job_removed(*last);
  return ctx_->Done(__func__, absl::OkStatus());
}

grpc::Status ControlService::Drain(grpc::ServerContext* call, const v1::DrainRequest*,
                                   v1::DrainResponse* resp) {
  if (absl::Status s = ctx_->RequireAdmin(*call); !s.ok()) return ctx_->Done(__func__, s);
  ctx_->draining = true;
  for (grpc::HealthCheckServiceInterface* health :
       {ctx_->health.load(), ctx_->probe_health.load()}) {
    if (health != nullptr) health->SetServingStatus(false);
  }
  resp->set_jobs(static_cast<uint32_t>(ctx_->jobs->size()));
  Log("draining: new jobs are refused");
  return ctx_->Done(__func__, absl::OkStatus());
}

}  // namespace zeroshard
