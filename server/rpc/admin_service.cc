#include <set>
#include <string>

#include "common/estimator.h"
#include "server/rpc/grpc_status.h"
#include "server/rpc/job_wire.h"
#include "server/rpc/services.h"

namespace zeroshard {

// Shows the jobs the caller's token opens (all with the admin token); the
// daemon's totals are shown to every caller.
grpc::Status AdminService::MemoryReport(grpc::ServerContext* call,
                                        const v1::MemoryReportRequest* req,
                                        v1::MemoryReportResponse* resp) {
  std::vector<std::shared_ptr<Job>> jobs;
  if (!req->job_id().empty()) {
    absl::StatusOr<std::shared_ptr<Job>> job =
        ctx_->FindJob(*call, req->job_id(), /*serving=*/false);
    if (!job.ok()) return ctx_->Done(__func__, job.status());
    jobs.push_back(*job);
  } else {
    // One entry per job (its ledger bytes are the job's, whatever copies of
    // replica groups it has here): the home copy.
    std::set<std::string> seen;
    for (std::shared_ptr<Job>& job : ctx_->jobs->All()) {
      if (!ctx_->MayOpen(*call, *job) || !seen.insert(job->config().job_id).second) continue;
      absl::StatusOr<std::shared_ptr<Job>> home = ctx_->jobs->Find(job->config().job_id);
      jobs.push_back(home.ok() ? *home : job);
    }
  }
  for (const auto& job : jobs) {
    const JobConfig& c = job->config();
    v1::JobMemory* m = resp->add_jobs();
    m->set_job_id(c.job_id);
    const CategoryBytes bytes = ctx_->ledger->JobBytes(c.job_id);
    for (int i = 0; i < kNumMemoryCategories; ++i) {
      v1::CategoryBytes* cb = m->add_categories();
      cb->set_category(MemoryCategoryName(static_cast<MemoryCategory>(i)));
      cb->set_bytes(bytes[i]);
    }
    m->set_stage(c.stage);
    m->set_world_size(c.world_size);
    m->set_parameters(c.layout.parameter_count());
    m->set_owned_partitions(static_cast<uint32_t>(job->owned_partitions().size()));
    m->set_formula_bytes(DaemonModelStateFormulaBytes(c, job->owned_range()));
    m->set_state_disk_bytes(job->state_disk_bytes());
  }
  resp->set_memory_limit_bytes(ctx_->ledger->limit());
  resp->set_total_bytes(ctx_->ledger->total());
  return ctx_->Done(__func__, absl::OkStatus());
}

// Reads only atomics and the rank table: never waits for any job's step.
// Lists the jobs the caller's token opens (all with the admin token).
grpc::Status AdminService::Status(grpc::ServerContext* call, const v1::StatusRequest*,
                                  v1::StatusResponse* resp) {
  // Answered without a token too, so CallerToken may not run: the caller
  // bound is checked here.
  if (ctx_->caller_calls != nullptr) {
    if (absl::Status s = ctx_->caller_calls->Admit(*call); !s.ok()) return ctx_->Done(__func__, s);
  }
  resp->set_version(ctx_->version);
  resp->set_uptime_seconds(absl::ToDoubleSeconds(absl::Now() - ctx_->start));
  resp->set_draining(ctx_->draining.load());
  for (const auto& job : ctx_->jobs->All()) {
    if (!ctx_->MayOpen(*call, *job)) continue;
    v1::JobStatus* j = resp->add_jobs();
    j->set_job_id(job->config().job_id);
    j->set_stage(job->config().stage);
    j->set_world_size(job->config().world_size);
    j->set_ranks_connected(job->RanksConnected(ctx_->jobs->options().rank_timeout));
    j->set_committed_step(job->committed_step());
    j->set_parameters(job->config().layout.parameter_count());
    for (uint32_t p : job->owned_partitions()) j->add_owned_partitions(p);
    j->set_state_disk_bytes(job->state_disk_bytes());
    if (std::optional<ReplicaGroupStatus> r = job->ReplicaState(); r.has_value()) {
      ToWire(*r, j->mutable_replica());
    }
  }
  return ctx_->Done(__func__, absl::OkStatus());
}

grpc::Status AdminService::Estimate(grpc::ServerContext*, const v1::EstimateRequest* req,
                                    v1::EstimateResponse* resp) {
  const double k = req->optimizer_k() == 0 ? kAdamK : req->optimizer_k();
  for (int stage = 0; stage <= 3; ++stage) {
    absl::StatusOr<ModelStateEstimate> e =
        EstimateModelStates(stage, req->parameters(), req->world_size(), k);
    if (!e.ok()) return ctx_->Done(__func__, e.status());
    v1::StageEstimate* s = resp->add_stages();
    s->set_stage(stage);
    s->set_model_state_bytes(e->bytes_per_rank);
    s->set_comm_bytes_per_step(e->comm_bytes);
    if (req->device_memory_bytes() > 0) {
      absl::StatusOr<double> max = MaxParameters(
          stage, static_cast<double>(req->device_memory_bytes()), req->world_size(), k);
      if (!max.ok()) return ctx_->Done(__func__, max.status());
      s->set_max_parameters(*max);
    }
  }
  const uint32_t daemons = req->daemons() == 0 ? req->world_size() : req->daemons();
  absl::StatusOr<DaemonStateEstimate> d = EstimateDaemonStates(req->parameters(), daemons, k);
  if (!d.ok()) return ctx_->Done(__func__, d.status());
  v1::DaemonEstimate* de = resp->mutable_daemon();
  de->set_daemons(daemons);
  de->set_ram_bytes(d->ram_bytes);
  de->set_state_dir_ram_bytes(d->state_dir_ram_bytes);
  de->set_state_dir_disk_bytes(d->state_dir_disk_bytes);
  de->set_state_gradients_ram_bytes(d->state_gradients_ram_bytes);
  de->set_state_gradients_disk_bytes(d->state_gradients_disk_bytes);
  return ctx_->Done(__func__, absl::OkStatus());
}

}  // namespace zeroshard
