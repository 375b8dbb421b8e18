#include "server/daemon.h"

#include <chrono>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/estimator.h"
#include "common/status_macros.h"
#include "proto/zeroshard/v1/admin.grpc.pb.h"
#include "proto/zeroshard/v1/control.grpc.pb.h"
#include "proto/zeroshard/v1/shard.grpc.pb.h"
#include "server/grpc_status.h"
#include "server/job_config.h"
#include "metrics/http_server.h"

namespace zeroshard {
namespace {

constexpr int kMaxMessageBytes = 80 << 20;  // a 64 MiB chunk plus headers
constexpr uint32_t kMaxWaitMs = 600000;

void Log(const std::string& line) { std::fprintf(stderr, "zeroshardd: %s\n", line.c_str()); }

// Largest payload one PushGradient / InitParameters stream may carry; the
// whole stream is held until it is applied atomically.
template <typename Chunk>
uint64_t StreamBytes(const std::vector<Chunk>& chunks) {
  uint64_t bytes = 0;
  for (const Chunk& c : chunks) bytes += c.data().size();
  return bytes;
}

uint64_t MaxStreamBytes(const JobConfig& c) { return std::max<uint64_t>(4 * c.bucket_bytes, 64 << 20); }

// A rank's gradient staging region: two slots of one bucket (at most 64 MiB)
// each, booked as `buffer` for as long as it exists.
constexpr uint64_t kStagingSlots = 2;
uint64_t StagingBytes(const JobConfig& c) {
  return kStagingSlots * std::min<uint64_t>(c.bucket_bytes, 64ull << 20);
}

struct Staging {
  Staging(MemoryLedger* ledger, std::string job, std::unique_ptr<transport::Region> region)
      : ledger(ledger), job(std::move(job)), region(std::move(region)) {}
  ~Staging() { ledger->Release(job, MemoryCategory::kBuffer, region->length()); }
  MemoryLedger* const ledger;
  const std::string job;
  const std::unique_ptr<transport::Region> region;
};

}  // namespace

// The three services share the daemon's state; each handler validates its
// request completely before touching a job.
class DaemonServices final : public v1::Control::Service,
                             public v1::Shard::Service,
                             public v1::Admin::Service {
 public:
  // `transport` (may be null: no UCX data path) must outlive the services.
  DaemonServices(const DaemonOptions& options, MemoryLedger* ledger, JobRegistry* jobs,
                 ShardOptimizer* optimizer, DaemonMetrics* metrics,
                 transport::Transport* transport, std::string transport_error)
      : options_(options), ledger_(ledger), jobs_(jobs), optimizer_(optimizer),
        metrics_(metrics), transport_(transport),
        transport_error_(std::move(transport_error)), start_(absl::Now()) {}

  std::atomic<bool> draining{false};

  // ---- Control ----
  grpc::Status RegisterJob(grpc::ServerContext*, const v1::RegisterJobRequest* req,
                           v1::RegisterJobResponse* resp) override {
    return Done(__func__, DoRegister(*req, resp));
  }

  grpc::Status JoinJob(grpc::ServerContext*, const v1::JoinJobRequest* req,
                       v1::JoinJobResponse* resp) override {
    absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Find(req->job_id());
    if (!job.ok()) return Done(__func__, job.status());
    uint32_t ranks = 0;
    uint64_t step = 0;
    absl::Status s = (*job)->Join(*req, &ranks, &step);
    if (s.ok()) {
      resp->set_ranks_connected(ranks);
      resp->set_committed_step(step);
      metrics_->SetRanks(req->job_id(), ranks, (*job)->config().world_size);
      Log(absl::StrCat("job ", req->job_id(), " rank ", req->rank(), " joined (", ranks, "/",
                       (*job)->config().world_size, " connected)"));
    }
    return Done(__func__, s);
  }

  grpc::Status GetPartitionMap(grpc::ServerContext*, const v1::GetPartitionMapRequest* req,
                               v1::PartitionMap* resp) override {
    absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Find(req->job_id());
    if (!job.ok()) return Done(__func__, job.status());
    FillPartitionMap((*job)->config(), resp);
    return Done(__func__, absl::OkStatus());
  }

  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override {
    absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Find(req->job_id());
    if (!job.ok()) return Done(__func__, job.status());
    if (req->rank() >= (*job)->config().world_size) {
      return Done(__func__, absl::InvalidArgumentError(absl::StrCat(
          "rank: must be < world_size (", (*job)->config().world_size, "), got ", req->rank())));
    }
    resp->set_committed_step((*job)->committed_step());
    return Done(__func__, absl::OkStatus());
  }

  grpc::Status Leave(grpc::ServerContext*, const v1::LeaveRequest* req,
                     v1::LeaveResponse* resp) override {
    absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Find(req->job_id());
    if (!job.ok()) return Done(__func__, job.status());
    absl::StatusOr<bool> empty = (*job)->Leave(req->rank());
    if (!empty.ok()) return Done(__func__, empty.status());
    Log(absl::StrCat("job ", req->job_id(), " rank ", req->rank(), " left"));
    metrics_->SetRanks(req->job_id(), (*job)->ranks_connected(), (*job)->config().world_size);
    if (*empty) {
      const std::string id = req->job_id();
      DropStaging(id);
      job->reset();
      jobs_->Remove(id);
      ledger_->RemoveJobIfEmpty(id);
      metrics_->RemoveJob(id);
      metrics_->SetJobs(jobs_->size());
      Log(absl::StrCat("job ", id, " removed: every rank has left"));
    }
    resp->set_job_removed(*empty);
    return Done(__func__, absl::OkStatus());
  }

  grpc::Status SaveCheckpoint(grpc::ServerContext*, const v1::SaveCheckpointRequest*,
                              v1::SaveCheckpointResponse*) override {
    return Done(__func__, absl::UnimplementedError(
        "SaveCheckpoint is not available in this version of zeroshardd"));
  }

  grpc::Status LoadCheckpoint(grpc::ServerContext*, const v1::LoadCheckpointRequest*,
                              v1::LoadCheckpointResponse*) override {
    return Done(__func__, absl::UnimplementedError(
        "LoadCheckpoint is not available in this version of zeroshardd"));
  }

  grpc::Status Drain(grpc::ServerContext*, const v1::DrainRequest*,
                     v1::DrainResponse* resp) override {
    draining = true;
    resp->set_jobs(static_cast<uint32_t>(jobs_->size()));
    Log("draining: new jobs are refused");
    return Done(__func__, absl::OkStatus());
  }

  // ---- Shard ----
  grpc::Status InitParameters(grpc::ServerContext* ctx,
                              grpc::ServerReader<v1::ParameterChunk>* reader,
                              v1::InitParametersResponse* resp) override {
    std::vector<v1::ParameterChunk> chunks;
    std::shared_ptr<Job> job;
    absl::Status s = ReadStream(ctx, reader, &chunks, &job);
    if (!s.ok()) return Done(__func__, s);
    uint64_t elements = 0;
    s = job->InitParameters(chunks, &elements);
    if (s.ok()) {
      resp->set_elements(elements);
      metrics_->RecordTraffic(job->config().id, "init", "grpc", StreamBytes(chunks));
      Log(absl::StrCat("job ", job->config().id, ": ", elements, " initial parameters loaded"));
    }
    return Done(__func__, s);
  }

  grpc::Status PushGradient(grpc::ServerContext* ctx,
                            grpc::ServerReader<v1::GradientChunk>* reader,
                            v1::PushGradientResponse* resp) override {
    std::vector<v1::GradientChunk> chunks;
    std::shared_ptr<Job> job;
    absl::Status s = ReadStream(ctx, reader, &chunks, &job);
    if (!s.ok()) return Done(__func__, s);
    // Staged chunks point into the sender's staging region, which stays
    // alive (held here) until the push is applied.
    std::vector<absl::string_view> payloads;
    std::vector<std::shared_ptr<Staging>> held;
    uint64_t staged_bytes = 0;
    s = ResolvePayloads(*job, chunks, &payloads, &held, &staged_bytes);
    if (!s.ok()) return Done(__func__, s);
    s = job->PushGradient(chunks, payloads, resp);
    if (s.ok()) {
      const uint64_t inline_bytes = StreamBytes(chunks);
      if (inline_bytes > 0) metrics_->RecordTraffic(job->config().id, "push", "grpc", inline_bytes);
      if (staged_bytes > 0) metrics_->RecordTraffic(job->config().id, "push", "ucx", staged_bytes);
    }
    return Done(__func__, s);
  }

  grpc::Status Gather(grpc::ServerContext* ctx, const v1::GatherRequest* req,
                      grpc::ServerWriter<v1::ParameterChunk>* writer) override {
    absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Find(req->job_id());
    if (!job.ok()) return Done(__func__, job.status());
    absl::StatusOr<DType> dtype = DTypeFromProto(req->dtype(), "dtype");
    if (!dtype.ok()) return Done(__func__, dtype.status());
    if (*dtype != DType::kFp32 && *dtype != (*job)->config().precision) {
      return Done(__func__, absl::InvalidArgumentError(absl::StrCat(
          "dtype: must be fp32 or the job's precision (",
          DTypeName((*job)->config().precision), "), got ", DTypeName(*dtype))));
    }
    if (req->wait_ms() > kMaxWaitMs) {
      return Done(__func__, absl::InvalidArgumentError(
          absl::StrCat("wait_ms: at most ", kMaxWaitMs, ", got ", req->wait_ms())));
    }
    absl::Time deadline = absl::Now() + absl::Milliseconds(req->wait_ms());
    const absl::Time rpc_deadline = absl::FromChrono(ctx->deadline());
    if (rpc_deadline < deadline) deadline = rpc_deadline;
    const uint64_t chunk_elements =
        std::max<uint64_t>(1, options_.max_chunk_bytes / DTypeSize(*dtype));
    if (req->wait_only()) {
      // The caller reads the range from the parameter regions itself.
      absl::Status s = (*job)->Gather(req->after_step(), {req->range().begin(), req->range().end()},
                                      *dtype, deadline, chunk_elements, nullptr);
      if (s.ok()) {
        metrics_->RecordTraffic(req->job_id(), "gather", "ucx",
                                (req->range().end() - req->range().begin()) * DTypeSize(*dtype));
      }
      return Done(__func__, s);
    }
    uint64_t bytes = 0;
    absl::Status s = (*job)->Gather(req->after_step(), {req->range().begin(), req->range().end()},
                                    *dtype, deadline, chunk_elements,
                                    [writer, &bytes](v1::ParameterChunk& c) {
                                      bytes += c.data().size();
                                      return writer->Write(c);
                                    });
    metrics_->RecordTraffic(req->job_id(), "gather", "grpc", bytes);
    return Done(__func__, s);
  }

  grpc::Status PrepareStep(grpc::ServerContext*, const v1::PrepareStepRequest* req,
                           v1::PrepareStepResponse* resp) override {
    absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Find(req->job_id());
    if (!job.ok()) return Done(__func__, job.status());
    absl::StatusOr<v1::PrepareStepResponse> r = (*job)->PrepareStep(req->step());
    if (!r.ok()) return Done(__func__, r.status());
    *resp = *r;
    return Done(__func__, absl::OkStatus());
  }

  grpc::Status CommitStep(grpc::ServerContext*, const v1::CommitStepRequest* req,
                          v1::CommitStepResponse* resp) override {
    absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Find(req->job_id());
    if (!job.ok()) return Done(__func__, job.status());
    const uint64_t before = (*job)->committed_step();
    const absl::Time start = absl::Now();
    absl::StatusOr<v1::CommitStepResponse> r = (*job)->CommitStep(*req);
    if (!r.ok()) return Done(__func__, r.status());
    if (r->committed_step() > before && !r->skipped()) {
      metrics_->RecordCommit(req->job_id(), absl::Now() - start,
                             (*job)->owned_unpadded().size());
    }
    *resp = *r;
    return Done(__func__, absl::OkStatus());
  }

  grpc::Status ExchangeEndpoint(grpc::ServerContext*, const v1::ExchangeEndpointRequest* req,
                                v1::ExchangeEndpointResponse* resp) override {
    return Done(__func__, DoExchangeEndpoint(*req, resp));
  }

  // ---- Admin ----
  grpc::Status MemoryReport(grpc::ServerContext*, const v1::MemoryReportRequest* req,
                            v1::MemoryReportResponse* resp) override {
    std::vector<std::shared_ptr<Job>> jobs;
    if (!req->job_id().empty()) {
      absl::StatusOr<std::shared_ptr<Job>> job = jobs_->Find(req->job_id());
      if (!job.ok()) return Done(__func__, job.status());
      jobs.push_back(*job);
    } else {
      jobs = jobs_->All();
    }
    for (const auto& job : jobs) {
      const JobConfig& c = job->config();
      v1::JobMemory* m = resp->add_jobs();
      m->set_job_id(c.id);
      const CategoryBytes bytes = ledger_->JobBytes(c.id);
      for (int i = 0; i < kNumMemoryCategories; ++i) {
        v1::CategoryBytes* cb = m->add_categories();
        cb->set_category(MemoryCategoryName(static_cast<MemoryCategory>(i)));
        cb->set_bytes(bytes[i]);
      }
      m->set_stage(c.stage);
      m->set_world_size(c.world_size);
      m->set_parameters(c.layout.parameter_count());
      m->set_owned_partitions(static_cast<uint32_t>(job->owned_partitions().size()));
      m->set_formula_bytes(DaemonModelStateFormulaBytes(c, job->owned_range().size()));
    }
    resp->set_memory_limit_bytes(ledger_->limit());
    resp->set_total_bytes(ledger_->total());
    return Done(__func__, absl::OkStatus());
  }

  grpc::Status Status(grpc::ServerContext*, const v1::StatusRequest*,
                      v1::StatusResponse* resp) override {
    resp->set_version(options_.version);
    resp->set_uptime_seconds(absl::ToDoubleSeconds(absl::Now() - start_));
    resp->set_draining(draining);
    for (const auto& job : jobs_->All()) {
      v1::JobStatus* j = resp->add_jobs();
      j->set_job_id(job->config().id);
      j->set_stage(job->config().stage);
      j->set_world_size(job->config().world_size);
      j->set_ranks_connected(job->ranks_connected());
      j->set_committed_step(job->committed_step());
      j->set_parameters(job->config().layout.parameter_count());
      for (uint32_t p : job->owned_partitions()) j->add_owned_partitions(p);
    }
    return Done(__func__, absl::OkStatus());
  }

  grpc::Status Estimate(grpc::ServerContext*, const v1::EstimateRequest* req,
                        v1::EstimateResponse* resp) override {
    const double k = req->optimizer_k() == 0 ? kAdamK : req->optimizer_k();
    for (int stage = 0; stage <= 3; ++stage) {
      absl::StatusOr<ModelStateEstimate> e =
          EstimateModelStates(stage, req->parameters(), req->world_size(), k);
      if (!e.ok()) return Done(__func__, e.status());
      v1::StageEstimate* s = resp->add_stages();
      s->set_stage(stage);
      s->set_model_state_bytes(e->bytes_per_rank);
      s->set_comm_bytes_per_step(e->comm_bytes);
      if (req->device_memory_bytes() > 0) {
        absl::StatusOr<double> max = MaxParameters(
            stage, static_cast<double>(req->device_memory_bytes()), req->world_size(), k);
        if (!max.ok()) return Done(__func__, max.status());
        s->set_max_parameters(*max);
      }
    }
    return Done(__func__, absl::OkStatus());
  }

 private:
  absl::Status DoExchangeEndpoint(const v1::ExchangeEndpointRequest& req,
                                  v1::ExchangeEndpointResponse* resp) {
    ASSIGN_OR_RETURN(std::shared_ptr<Job> job, jobs_->Find(req.job_id()));
    const JobConfig& c = job->config();
    if (req.rank() >= c.world_size) {
      return absl::InvalidArgumentError(absl::StrCat("rank: must be < world_size (",
                                                     c.world_size, "), got ", req.rank()));
    }
    if (req.transport() != v1::TRANSPORT_KIND_UCX) {
      return absl::InvalidArgumentError(absl::StrCat(
          "transport: only TRANSPORT_KIND_UCX has endpoints to exchange, got ",
          v1::TransportKind_Name(req.transport())));
    }
    if (transport_ == nullptr) {
      return absl::UnavailableError(absl::StrCat(
          "this zeroshardd does not serve the UCX data path (", transport_error_,
          "); use transport \"grpc\""));
    }
    std::shared_ptr<Staging> staging;
    {
      absl::MutexLock lock(&staging_mu_);
      std::shared_ptr<Staging>& slot = staging_[{c.id, req.rank()}];
      if (slot == nullptr) {
        const uint64_t bytes = StagingBytes(c);
        absl::Status s = ledger_->Reserve(c.id, MemoryCategory::kBuffer, bytes);
        absl::StatusOr<std::unique_ptr<transport::Region>> region =
            s.ok() ? transport_->AllocateRegion(bytes, transport::Access::kRemoteReadWrite)
                   : absl::StatusOr<std::unique_ptr<transport::Region>>(s);
        if (!region.ok()) {
          if (s.ok()) ledger_->Release(c.id, MemoryCategory::kBuffer, bytes);
          staging_.erase({c.id, req.rank()});
          return region.status();
        }
        slot = std::make_shared<Staging>(ledger_, c.id, *std::move(region));
        Log(absl::StrCat("job ", c.id, " rank ", req.rank(), ": UCX endpoint exchanged (",
                         bytes, " staging bytes)"));
      }
      staging = slot;
    }
    resp->set_worker_address(transport_->LocalAddress());
    v1::RemoteRegion* r = resp->add_regions();
    const transport::RegionDescriptor& d = staging->region->Descriptor();
    r->set_purpose("grad_staging");
    r->set_address(d.address);
    r->set_length(d.length);
    r->set_rkey(d.rkey);
    job->FillParameterRegions(resp);
    return absl::OkStatus();
  }

  // Points payloads[i] at chunk i's bytes: its `data`, or for a staged chunk
  // the bytes in the rank's staging region (validated here: the region
  // exists, `data` is empty, the bytes lie inside it). `held` keeps the
  // regions alive; `staged_bytes` counts what the staged chunks carry.
  absl::Status ResolvePayloads(const Job& job, const std::vector<v1::GradientChunk>& chunks,
                               std::vector<absl::string_view>* payloads,
                               std::vector<std::shared_ptr<Staging>>* held,
                               uint64_t* staged_bytes) {
    const JobConfig& config = job.config();
    payloads->reserve(chunks.size());
    for (size_t i = 0; i < chunks.size(); ++i) {
      const v1::GradientChunk& c = chunks[i];
      if (!c.staged()) {
        payloads->push_back(c.data());
        continue;
      }
      const std::string where = absl::StrCat("chunk ", i);
      if (!c.data().empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": a staged chunk carries no data, got ", c.data().size(),
                         " bytes"));
      }
      if (c.rank() >= config.world_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ".rank: must be < world_size (", config.world_size, "), got ", c.rank()));
      }
      absl::StatusOr<DType> dt = DTypeFromProto(c.dtype(), where + ".dtype");
      if (!dt.ok()) return dt.status();
      if (c.range().end() <= c.range().begin() ||
          c.range().end() - c.range().begin() > (64ull << 20)) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ".range [", c.range().begin(), ", ", c.range().end(),
            ") is empty or too long for a staged chunk"));
      }
      const uint64_t length = (c.range().end() - c.range().begin()) * DTypeSize(*dt);
      std::shared_ptr<Staging> staging;
      {
        absl::MutexLock lock(&staging_mu_);
        auto it = staging_.find({config.id, c.rank()});
        if (it != staging_.end()) staging = it->second;
      }
      if (staging == nullptr) {
        return absl::FailedPreconditionError(absl::StrCat(
            where, ": staged, but rank ", c.rank(), " of job ", config.id,
            " has no staging region here; call ExchangeEndpoint first"));
      }
      const uint64_t region_length = staging->region->length();
      if (c.staging_offset() > region_length || length > region_length - c.staging_offset()) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": staged bytes [", c.staging_offset(), ", +", length,
            ") lie outside the staging region of ", region_length, " bytes"));
      }
      payloads->push_back(absl::string_view(
          static_cast<const char*>(staging->region->base()) + c.staging_offset(), length));
      *staged_bytes += length;
      held->push_back(std::move(staging));
    }
    return absl::OkStatus();
  }

  void DropStaging(const std::string& job) {
    absl::MutexLock lock(&staging_mu_);
    staging_.erase(staging_.lower_bound({job, 0}), staging_.upper_bound({job, UINT32_MAX}));
  }

  absl::Status DoRegister(const v1::RegisterJobRequest& req, v1::RegisterJobResponse* resp) {
    ASSIGN_OR_RETURN(JobConfig config, ParseJobSpec(req.spec()));
    if (req.daemon_index() >= config.daemons.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "daemon_index: must be < the number of daemons in spec.daemons (",
          config.daemons.size(), "), got ", req.daemon_index()));
    }
    absl::StatusOr<std::shared_ptr<Job>> existing = jobs_->Find(config.id);
    if (existing.ok()) {
      const std::string diff = DescribeSpecDifference((*existing)->spec(), req.spec());
      if (!diff.empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat("job ", config.id, " is registered with a different spec: ", diff));
      }
      if ((*existing)->daemon_index() != req.daemon_index()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "daemon_index: job ", config.id, " is registered here as daemon ",
            (*existing)->daemon_index(), ", got ", req.daemon_index()));
      }
      resp->set_created(false);
      FillRegisterResponse(**existing, resp);
      return absl::OkStatus();
    }
    if (draining) {
      return absl::UnavailableError("this daemon is draining and accepts no new jobs");
    }
    const std::string id = config.id;
    ASSIGN_OR_RETURN(std::unique_ptr<Job> created,
                     Job::Create(std::move(config), req.spec(), req.daemon_index(), ledger_,
                                 optimizer_, transport_));
    bool inserted = false;
    std::shared_ptr<Job> job = jobs_->Insert(std::move(created), &inserted);
    if (!inserted) {  // lost a race with an identical registration
      const std::string diff = DescribeSpecDifference(job->spec(), req.spec());
      if (!diff.empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat("job ", id, " is registered with a different spec: ", diff));
      }
    }
    resp->set_created(inserted);
    FillRegisterResponse(*job, resp);
    metrics_->SetJobs(jobs_->size());
    metrics_->SetRanks(id, job->ranks_connected(), job->config().world_size);
    if (inserted) {
      Log(absl::StrCat("job ", id, " registered: stage ", job->config().stage, ", N_d ",
                       job->config().world_size, ", Ψ ", job->config().layout.parameter_count(),
                       ", partitions ", job->owned_partitions().size(), " owned here"));
    }
    return absl::OkStatus();
  }

  void FillRegisterResponse(const Job& job, v1::RegisterJobResponse* resp) {
    FillPartitionMap(job.config(), resp->mutable_partition_map());
    for (uint32_t p : job.owned_partitions()) resp->add_owned_partitions(p);
  }

  static void FillPartitionMap(const JobConfig& c, v1::PartitionMap* m) {
    m->set_total_elements(c.map.total_elements());
    m->set_padded_elements(c.map.padded_elements());
    m->set_partition_elements(c.map.partition_elements());
    for (uint32_t i = 0; i < c.world_size; ++i) {
      v1::Partition* p = m->add_partitions();
      p->set_index(i);
      p->mutable_range()->set_begin(c.map.Partition(i).begin);
      p->mutable_range()->set_end(c.map.Partition(i).end);
      p->set_daemon_address(c.daemons[c.map.DaemonOf(i)]);
    }
  }

  // Reads a whole client stream; the first chunk names the job, later chunks
  // must name the same one (or none). A stream the client abandons (cancelled
  // or broken) yields Cancelled and nothing is applied.
  template <typename Chunk>
  absl::Status ReadStream(grpc::ServerContext* ctx, grpc::ServerReader<Chunk>* reader,
                          std::vector<Chunk>* chunks, std::shared_ptr<Job>* job) {
    Chunk chunk;
    uint64_t bytes = 0;
    uint64_t limit = 0;
    while (reader->Read(&chunk)) {
      if (chunks->empty()) {
        ASSIGN_OR_RETURN(*job, jobs_->Find(chunk.job_id()));
        limit = MaxStreamBytes((*job)->config());
      } else if (!chunk.job_id().empty() && chunk.job_id() != (*job)->config().id) {
        return absl::InvalidArgumentError(absl::StrCat(
            "chunk ", chunks->size(), ".job_id: the stream started with job ",
            (*job)->config().id, ", got ", chunk.job_id().substr(0, 140)));
      }
      bytes += chunk.data().size();
      if (bytes > limit) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "the stream carries more than ", limit, " bytes; split pushes into buckets of at ",
            "most bucket_bytes per stream"));
      }
      chunks->push_back(std::move(chunk));
      chunk.Clear();
    }
    if (ctx->IsCancelled()) {
      return absl::CancelledError("the client abandoned the stream; nothing was applied");
    }
    if (chunks->empty()) {
      return absl::InvalidArgumentError("the stream carried no chunk");
    }
    return absl::OkStatus();
  }

  // Counts the request under its RPC name and result code.
  grpc::Status Done(const char* rpc, const absl::Status& status) {
    metrics_->RecordRequest(rpc, status);
    return ToGrpc(status);
  }

  const DaemonOptions options_;
  MemoryLedger* const ledger_;
  JobRegistry* const jobs_;
  ShardOptimizer* const optimizer_;
  DaemonMetrics* const metrics_;
  transport::Transport* const transport_;
  const std::string transport_error_;  // why transport_ is null
  const absl::Time start_;
  absl::Mutex staging_mu_;
  std::map<std::pair<std::string, uint32_t>, std::shared_ptr<Staging>> staging_
      ABSL_GUARDED_BY(staging_mu_);
};

Daemon::Daemon(const DaemonOptions& options)
    : options_(options),
      ledger_(options.memory_limit_bytes),
      metrics_(&registry_, &ledger_, options.version) {}

Daemon::~Daemon() { Shutdown(absl::Seconds(1)); }

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options) {
  if (options.listen.find(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--listen: must be HOST:PORT, got \"", options.listen, "\""));
  }
  if (options.optimizer_threads < 1 || options.optimizer_threads > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--optimizer_threads: must be in 1..256, got ", options.optimizer_threads));
  }
  if (options.max_chunk_bytes < 1024 || options.max_chunk_bytes > (64ull << 20)) {
    return absl::InvalidArgumentError("max_chunk_bytes: must be in 1 KiB..64 MiB");
  }
  std::unique_ptr<Daemon> d(new Daemon(options));
  ShardOptimizer::Options oo;
  oo.num_threads = options.optimizer_threads;
  ASSIGN_OR_RETURN(d->optimizer_, ShardOptimizer::Create(oo));
  std::string transport_error = "started without --ucx";
  if (options.ucx) {
    transport::TransportOptions to;
    to.name = absl::StrCat("zeroshardd ", options.listen);
    to.ucx_tls = options.ucx_tls;
    absl::StatusOr<std::unique_ptr<transport::Transport>> t = transport::CreateTransport("ucx", to);
    if (t.ok()) {
      d->transport_ = *std::move(t);
    } else {
      transport_error = absl::StrCat("UCX did not initialise: ", t.status().message());
      Log(absl::StrCat("serving the gRPC data path only: ", transport_error));
    }
  }
  d->services_ = std::make_unique<DaemonServices>(d->options_, &d->ledger_, &d->jobs_,
                                                  d->optimizer_.get(), &d->metrics_,
                                                  d->transport_.get(), transport_error);
  if (!options.metrics_listen.empty()) {
    d->http_ = std::make_unique<metrics::MetricsHttpServer>(d->registry_, options.metrics_listen);
    RETURN_IF_ERROR(d->http_->Start(), "--metrics_port");
  }
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &d->port_);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.RegisterService(static_cast<v1::Control::Service*>(d->services_.get()));
  builder.RegisterService(static_cast<v1::Shard::Service*>(d->services_.get()));
  builder.RegisterService(static_cast<v1::Admin::Service*>(d->services_.get()));
  d->server_ = builder.BuildAndStart();
  if (d->server_ == nullptr || d->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("--listen: cannot bind ", options.listen, " (in use or not local?)"));
  }
  d->address_ = options.listen.substr(0, options.listen.rfind(':') + 1) + std::to_string(d->port_);
  return d;
}

void Daemon::Shutdown(absl::Duration grace) {
  if (shut_down_.exchange(true)) return;
  if (server_ != nullptr) {
    services_->draining = true;
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(absl::ToInt64Milliseconds(grace)));
  }
  if (http_ != nullptr) http_->Stop();
}

int Daemon::metrics_port() const { return http_ == nullptr ? 0 : http_->port(); }

void Daemon::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace zeroshard
