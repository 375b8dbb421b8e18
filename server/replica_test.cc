// Replicated partitions (JobSpec.replicas = 2; proto/zeroshard/v1/replica.proto)
// between two in-process daemons on loopback: daemon d holds replica group d
// as its primary and group (d + 1) % 2 as the backup. The primary brings its
// backup along in PrepareStep (a state transfer when the backup is not in
// sync, then the reduced gradient) and CommitStep (the commit); a backup is
// promoted at a higher epoch, and the epoch fences the replaced copy. Every
// Replica RPC refuses bad input with a specific code and changes nothing.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/channel.h"
#include "common/crc32c.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "metrics/registry.h"
#include "proto/zeroshard/v1/replica.grpc.pb.h"
#include "server/daemon.h"
#include "server/rpc/grpc_replica_link.h"
#include "server/rpc/job_wire.h"
#include "server/job/job.h"
#include "server/step/owned_tensors.h"
#include "server/testing/daemon_fixture.h"
#include "transport/transport.h"

namespace zeroshard {
namespace {

using testing::DaemonClient;
using testing::GradientChunks;
using testing::kTestIncarnation;
using testing::kTestToken;
using testing::MakeSpec;
using testing::ParamChunks;
using testing::RandomVector;
using testing::SampleLayout;

constexpr uint32_t kWorld = 4;  // two partitions per daemon
constexpr char kWrongToken[] = "zeroshard-some-other-jobs-token";
// The daemons' admin token: the operator's authority, which may replace a
// primary that still serves (a trainer's job token may not).
constexpr char kAdminToken[] = "zeroshard-replica-test-admin-token";
constexpr float kLr = 0.01f;

void SetDeadline(grpc::ClientContext* ctx, int seconds = 30) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
}

// The Replica service over one plaintext channel carrying `token`.
struct ReplicaClient {
  explicit ReplicaClient(const std::string& address, const std::string& token = kTestToken)
      : client(address, token), stub(v1::Replica::NewStub(client.channel)) {}

  grpc::Status State(const std::string& job, v1::ReplicaState* out) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::GetReplicaStateRequest req;
    req.set_job_id(job);
    return stub->GetReplicaState(&ctx, req, out);
  }
  // `deadline_ms` > 0: the call's deadline that far away instead.
  grpc::Status Promote(const std::string& job, uint32_t group, uint64_t epoch,
                       uint64_t committed_step, v1::ReplicaState* out = nullptr,
                       int deadline_ms = 0) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    if (deadline_ms > 0) {
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
    }
    v1::PromoteRequest req;
    req.set_job_id(job);
    req.set_group(group);
    req.set_epoch(epoch);
    req.set_committed_step(committed_step);
    v1::ReplicaState local;
    return stub->Promote(&ctx, req, out ? out : &local);
  }
  grpc::Status Transfer(const std::vector<v1::ReplicaStateChunk>& chunks,
                        v1::TransferStateResponse* out = nullptr) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::TransferStateResponse local;
    auto writer = stub->TransferState(&ctx, out ? out : &local);
    for (const auto& c : chunks) {
      if (!writer->Write(c)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }
  grpc::Status Forward(const std::vector<v1::ForwardedGradientChunk>& chunks,
                       v1::ForwardGradientResponse* out = nullptr) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::ForwardGradientResponse local;
    auto writer = stub->ForwardGradient(&ctx, out ? out : &local);
    for (const auto& c : chunks) {
      if (!writer->Write(c)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }
  grpc::Status Commit(const v1::CommitReplicaRequest& req, v1::CommitStepResponse* out = nullptr) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::CommitStepResponse local;
    return stub->CommitReplica(&ctx, req, out ? out : &local);
  }
  grpc::Status Release(const std::string& job, uint32_t group, uint64_t epoch) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::ReleaseReplicaRequest req;
    req.set_job_id(job);
    req.set_group(group);
    req.set_epoch(epoch);
    v1::ReleaseReplicaResponse resp;
    return stub->ReleaseReplica(&ctx, req, &resp);
  }

  DaemonClient client;
  std::unique_ptr<v1::Replica::Stub> stub;
};

// A replicated test job: its spec and the parameters it was initialised with.
struct TestJob {
  std::string id;
  v1::JobSpec spec;
  JobConfig config;
  std::vector<float> init;

  uint64_t total() const { return config.map.total_elements(); }
  // Replica group g's elements below total().
  FlatRange Range(uint32_t g) const { return config.map.DaemonRange(g).Intersect({0, total()}); }
};

// Where a call goes: a daemon, and the replica group and epoch its metadata
// names (epoch 0: no metadata, the daemon's home copy).
struct Where {
  int daemon;
  uint32_t group;
  uint64_t epoch;
};

// Every rank's full gradient of `step` (the same for every job).
std::vector<std::vector<float>> Grads(uint64_t total, uint64_t step) {
  std::vector<std::vector<float>> out;
  for (uint32_t r = 0; r < kWorld; ++r) {
    std::mt19937 rng(static_cast<uint32_t>(step * 7919 + r));
    out.push_back(RandomVector(rng, total, 0.05f));
  }
  return out;
}

// A copy's replica group state in its wire form (ShortDebugString names
// every field).
v1::ReplicaGroupState ReplicaStateOf(const Job& job) {
  v1::ReplicaGroupState out;
  if (std::optional<ReplicaGroupStatus> r = job.ReplicaState(); r.has_value()) ToWire(*r, &out);
  return out;
}

// The fp32 masters of one copy, read from the Job object itself (a backup
// serves no Gather).
std::vector<float> Masters(Job& job) {
  std::vector<float> out;
  absl::Status s = job.Gather(job.committed_step(), job.owned_unpadded(), DType::kFp32,
                              absl::Now() + absl::Seconds(5), 1 << 16, [&](ParameterChunkOut& c) {
                                const size_t old = out.size();
                                out.resize(old + c.data.size() / sizeof(float));
                                std::memcpy(out.data() + old, c.data.data(), c.data.size());
                                return true;
                              });
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

const v1::ReplicaGroupState* GroupState(const v1::ReplicaState& state, uint32_t group) {
  for (const v1::ReplicaGroupState& g : state.groups()) {
    if (g.group() == group) return &g;
  }
  return nullptr;
}

uint64_t CategoryOf(const v1::MemoryReportResponse& report, const std::string& category) {
  for (const v1::CategoryBytes& c : report.jobs(0).categories()) {
    if (c.category() == category) return c.bytes();
  }
  ADD_FAILURE() << "no category " << category << " in " << report.ShortDebugString();
  return 0;
}

class ReplicaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int d = 0; d < 2; ++d) {
      DaemonOptions o;
      o.listen = "127.0.0.1:0";
      o.read_lease = absl::ZeroDuration();  // removed jobs are freed at the next reap
      o.bulk_transport = BulkTransport(d);
      o.replica_link = LinkOf(d);
      o.liveness_timeout = LivenessOf(d);
      o.admin_token = kAdminToken;
      absl::StatusOr<std::unique_ptr<Daemon>> started = Daemon::Start(o);
      ASSERT_TRUE(started.ok()) << started.status();
      daemons_.push_back(*std::move(started));
      addresses_.push_back(daemons_.back()->address());
    }
  }

  // The daemons first: their probe threads call the links of derived
  // fixtures, which go before the base's members.
  void TearDown() override { daemons_.clear(); }

  // Daemon d's bulk transport (empty: none, state copies in the stream).
  virtual std::string BulkTransport(int d) const { return ""; }
  // Daemon d's link to its backups (null: the daemon's own, over gRPC).
  virtual ReplicaLink* LinkOf(int d) { return nullptr; }
  // Daemon d's --liveness_timeout_seconds.
  virtual absl::Duration LivenessOf(int d) const { return kDefaultLivenessTimeout; }

  Daemon& daemon(int d) { return *daemons_[d]; }

  // A client of daemon d whose calls carry group g and epoch e (e = 0: none).
  DaemonClient& Target(int d, uint32_t g, uint64_t e) {
    std::unique_ptr<DaemonClient>& c = targets_[std::make_tuple(d, g, e)];
    if (c == nullptr) {
      c = std::make_unique<DaemonClient>(addresses_[d]);
      if (e != 0) {
        c->channel = MakeChannel(addresses_[d], ChannelSecurity::Plaintext(kTestToken),
                                 grpc::ChannelArguments(), ReplicaTarget{g, e});
        c->control = v1::Control::NewStub(c->channel);
        c->shard = v1::Shard::NewStub(c->channel);
        c->admin = v1::Admin::NewStub(c->channel);
        c->checkpoint = v1::Checkpoint::NewStub(c->channel);
      }
    }
    return *c;
  }
  DaemonClient& Target(const Where& w) { return Target(w.daemon, w.group, w.epoch); }
  DaemonClient& Plain(int d) { return Target(d, 0, 0); }
  // Daemon d's own group at the first epoch: how trainers reach a new job.
  DaemonClient& Home(int d) { return Target(d, d, 1); }
  // The Replica service of daemon d with the job's token, as trainers call it.
  ReplicaClient& Replica(int d) {
    std::unique_ptr<ReplicaClient>& c = replica_clients_[d];
    if (c == nullptr) c = std::make_unique<ReplicaClient>(addresses_[d]);
    return *c;
  }
  // The same with the admin token (an operator's failover).
  ReplicaClient& Operator(int d) {
    std::unique_ptr<ReplicaClient>& c = operator_clients_[d];
    if (c == nullptr) c = std::make_unique<ReplicaClient>(addresses_[d], kAdminToken);
    return *c;
  }

  // The copy of `group` of job `id` on daemon d.
  std::shared_ptr<Job> Copy(int d, const std::string& id, uint32_t group) {
    absl::StatusOr<std::shared_ptr<Job>> job = daemon(d).jobs().Find(id, group);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? *job : nullptr;
  }

  // Registers `id` on both daemons (daemon d as index d), joins every rank
  // on each daemon's home copy and initialises the parameters.
  // `customize` may change the spec (its layout and param groups) first.
  TestJob StartJob(const std::string& id, uint32_t stage, uint32_t replicas = 2,
                   const std::function<void(v1::JobSpec&)>& customize = nullptr) {
    TestJob j;
    j.id = id;
    j.spec = MakeSpec(id, SampleLayout(), stage, kWorld, addresses_);
    if (replicas > 1) j.spec.set_replicas(replicas);
    if (customize) customize(j.spec);
    j.config = *ParseJobSpec(j.spec);
    std::mt19937 rng(12345);
    j.init = RandomVector(rng, j.total(), 0.1f);
    for (int d = 0; d < 2; ++d) {
      grpc::Status s = Plain(d).Register(j.spec, d);
      EXPECT_TRUE(s.ok()) << s.error_message();
      DaemonClient& home = replicas > 1 ? Home(d) : Plain(d);
      s = home.JoinAll(j.spec);
      EXPECT_TRUE(s.ok()) << s.error_message();
      const FlatRange r = j.Range(d);
      s = home.Init(ParamChunks(id, r, j.init.data() + r.begin));
      EXPECT_TRUE(s.ok()) << s.error_message();
    }
    return j;
  }

  // Pushes every rank's gradient of `step` for the groups `where` names,
  // prepares them, combines the norms, and commits them (skipped when
  // `skip`). Returns the PrepareStep answers.
  // Every rank marks the tensors `no_grad` as without a gradient.
  std::vector<v1::PrepareStepResponse> RunStep(const TestJob& j, uint64_t step,
                                               const std::vector<Where>& where, bool skip = false,
                                               const std::vector<uint32_t>& no_grad = {}) {
    const std::vector<std::vector<float>> grads = Grads(j.total(), step);
    for (const Where& w : where) {
      const FlatRange r = j.Range(w.group);
      for (uint32_t rank = 0; rank < kWorld; ++rank) {
        std::vector<v1::GradientChunk> chunks =
            GradientChunks(j.id, step, rank, j.config.map, r, grads[rank].data() + r.begin, 333);
        testing::MarkNoGrad(j.config.layout, no_grad, &chunks);
        grpc::Status s = Target(w).Push(chunks);
        EXPECT_TRUE(s.ok()) << "push of step " << step << " rank " << rank << " to daemon "
                            << w.daemon << " group " << w.group << ": " << s.error_message();
      }
    }
    std::vector<v1::PrepareStepResponse> prepared(where.size());
    double sum_sq = 0;
    for (size_t i = 0; i < where.size(); ++i) {
      grpc::Status s = Target(where[i]).Prepare(j.id, step, &prepared[i]);
      EXPECT_TRUE(s.ok()) << "prepare of step " << step << " on daemon " << where[i].daemon
                          << " group " << where[i].group << ": " << s.error_message();
      sum_sq += prepared[i].grad_sq_sum();
    }
    const float norm = static_cast<float>(std::sqrt(sum_sq));
    const float clip = std::min(1.0f, 0.5f / (norm + 1e-6f));
    for (const Where& w : where) {
      grpc::Status s = Target(w).Commit(j.id, step, kLr, clip, skip);
      EXPECT_TRUE(s.ok()) << "commit of step " << step << " on daemon " << w.daemon << " group "
                          << w.group << ": " << s.error_message();
    }
    return prepared;
  }

  // Every copy of job `id` on both daemons: StateHash and replica state.
  std::string Snapshot(const std::string& id) {
    std::string out;
    for (int d = 0; d < static_cast<int>(daemons_.size()); ++d) {
      if (daemons_[d] == nullptr) continue;
      for (const std::shared_ptr<Job>& job : daemon(d).jobs().All()) {
        if (job->config().job_id != id) continue;
        const v1::ReplicaGroupState state = ReplicaStateOf(*job);
        absl::StrAppend(&out, "daemon ", d, " group ", job->daemon_index(), ": hash ",
                        job->StateHash(), " ", state.ShortDebugString(), "\n");
      }
    }
    return out;
  }

  // Runs `call`, expects `code` and a message containing `text`, and that no
  // copy of job `id` changed (state hash, role, epoch, sync) and neither
  // daemon's ledger total. `out_of_sync`: the copy (daemon, group) is
  // allowed one change, and must show it: it is marked out of sync (a
  // refused forward or commit), and nothing else of it changes.
  void ExpectRejected(const std::string& id, grpc::StatusCode code, const std::string& text,
                      const std::function<grpc::Status()>& call,
                      std::optional<std::pair<int, uint32_t>> out_of_sync = std::nullopt) {
    std::shared_ptr<Job> marked;
    uint64_t marked_hash = 0;
    v1::ReplicaGroupState marked_before;
    if (out_of_sync.has_value()) {
      marked = Copy(out_of_sync->first, id, out_of_sync->second);
      marked_hash = marked->StateHash();
      marked_before = ReplicaStateOf(*marked);
    }
    const std::string before = Snapshot(id);
    std::vector<uint64_t> ledgers;
    for (auto& d : daemons_) ledgers.push_back(d->ledger().total());
    const grpc::Status s = call();
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_NE(s.error_message().find(text), std::string::npos)
        << "message \"" << s.error_message() << "\" lacks \"" << text << "\"";
    if (out_of_sync.has_value()) {
      EXPECT_EQ(marked->StateHash(), marked_hash) << "state changed by: " << s.error_message();
      const v1::ReplicaGroupState after = ReplicaStateOf(*marked);
      EXPECT_FALSE(after.in_sync()) << after.ShortDebugString();
      marked_before.set_in_sync(false);
      EXPECT_EQ(after.ShortDebugString(), marked_before.ShortDebugString());
    } else {
      EXPECT_EQ(Snapshot(id), before) << "state changed by: " << s.error_message();
    }
    // A stream refused early can end on the client before the daemon's
    // handler let go of what it booked: give it a moment.
    for (size_t d = 0; d < daemons_.size(); ++d) {
      const absl::Time settle = absl::Now() + absl::Seconds(5);
      while (daemons_[d]->ledger().total() != ledgers[d] && absl::Now() < settle) {
        absl::SleepFor(absl::Milliseconds(5));
      }
      EXPECT_EQ(daemons_[d]->ledger().total(), ledgers[d]) << "daemon " << d;
    }
  }

  // A state transfer of `arrays` arrays of the group's n elements (values
  // from `seed`), `per` elements a chunk, from a primary at `epoch`.
  std::vector<v1::ReplicaStateChunk> TransferChunks(const TestJob& j, uint32_t group,
                                                    uint64_t epoch, uint64_t committed,
                                                    uint32_t seed = 7, uint64_t per = 1000,
                                                    uint32_t arrays = 3) {
    const uint64_t n = j.Range(group).size();
    std::mt19937 rng(seed);
    std::vector<v1::ReplicaStateChunk> out;
    for (uint32_t a = 0; a < arrays; ++a) {
      std::vector<float> values = RandomVector(rng, n, 0.1f);
      if (a == 2) {
        for (float& v : values) v = v * v;  // a second moment is not negative
      }
      for (uint64_t b = 0; b < n; b += per) {
        const uint64_t e = std::min(n, b + per);
        v1::ReplicaStateChunk c;
        c.set_job_id(j.id);
        c.set_group(group);
        c.set_epoch(epoch);
        if (out.empty()) {
          c.mutable_state()->set_committed_step(committed);
          c.mutable_state()->set_loss_scale(1.0f);
          c.mutable_state()->set_optimizer_steps(committed);
        }
        c.set_array(a);
        c.set_offset(b);
        c.set_data(reinterpret_cast<const char*>(values.data() + b), (e - b) * sizeof(float));
        c.set_crc32c(Crc32c(c.data().data(), c.data().size()));
        out.push_back(std::move(c));
      }
    }
    return out;
  }

  // A forward of the group's reduced gradient of `step` (rank sums of
  // Grads), `per` elements a chunk, from a primary at `epoch`.
  std::vector<v1::ForwardedGradientChunk> ForwardChunks(const TestJob& j, uint32_t group,
                                                        uint64_t epoch, uint64_t step,
                                                        uint64_t per = 1000) {
    const FlatRange r = j.Range(group);
    const std::vector<std::vector<float>> grads = Grads(j.total(), step);
    std::vector<float> sum(j.total(), 0.0f);
    for (const auto& g : grads) {
      for (uint64_t i = 0; i < sum.size(); ++i) sum[i] += g[i];
    }
    std::vector<v1::ForwardedGradientChunk> out;
    for (uint64_t b = r.begin; b < r.end; b += per) {
      const uint64_t e = std::min(r.end, b + per);
      v1::ForwardedGradientChunk c;
      c.set_job_id(j.id);
      c.set_group(group);
      c.set_epoch(epoch);
      c.set_step(step);
      c.mutable_range()->set_begin(b);
      c.mutable_range()->set_end(e);
      c.set_data(reinterpret_cast<const char*>(sum.data() + b), (e - b) * sizeof(float));
      c.set_crc32c(Crc32c(c.data().data(), c.data().size()));
      if (out.empty()) c.mutable_prepared()->set_elements(r.size());
      out.push_back(std::move(c));
    }
    return out;
  }

  v1::CommitReplicaRequest CommitRequest(const TestJob& j, uint32_t group, uint64_t epoch,
                                         uint64_t step, float lr = kLr, float clip = 1.0f) {
    v1::CommitReplicaRequest req;
    req.set_job_id(j.id);
    req.set_group(group);
    req.set_epoch(epoch);
    v1::CommitStepRequest* c = req.mutable_commit();
    c->set_job_id(j.id);
    c->set_step(step);
    c->set_lr(lr);
    c->set_clip_coef(clip);
    c->set_rank(0);
    c->set_incarnation(kTestIncarnation);
    return req;
  }

  // A replicated job whose step 1 is committed on both groups with both
  // backups in sync: the backup of group 0 is on daemon 1 at epoch 1.
  TestJob SyncedJob(const std::string& id) {
    TestJob j = StartJob(id, 2);
    for (const v1::PrepareStepResponse& p : RunStep(j, 1, {{0, 0, 1}, {1, 1, 1}})) {
      EXPECT_TRUE(p.backup_in_sync());
    }
    return j;
  }

  // A copy's whole state, compared across copies: joins every rank on
  // `copy` directly (a backup has none joined; the state hash covers the
  // rank table), then its StateHash, and through ReadState its moments and
  // update counts over its group's range.
  struct CopyState {
    uint64_t hash = 0;
    std::vector<float> masters, exp_avg, exp_avg_sq;
    std::map<uint32_t, uint64_t> steps;
  };
  CopyState StateOf(Job& copy, const TestJob& j) {
    for (uint32_t rank = 0; rank < kWorld; ++rank) {
      v1::JoinJobRequest req;
      req.set_job_id(j.id);
      req.set_rank(rank);
      req.set_layout_fingerprint(j.spec.layout_fingerprint());
      req.set_stage(j.spec.stage());
      req.set_world_size(kWorld);
      req.set_precision(j.spec.precision());
      req.set_incarnation(kTestIncarnation);
      absl::StatusOr<JoinResult> s = copy.Join(FromWire(req));
      EXPECT_TRUE(s.ok()) << s.status();
    }
    CopyState out;
    out.hash = copy.StateHash();
    for (v1::StateArray array :
         {v1::STATE_ARRAY_MASTER, v1::STATE_ARRAY_EXP_AVG, v1::STATE_ARRAY_EXP_AVG_SQ}) {
      v1::ReadStateRequest req;
      req.set_job_id(j.id);
      req.set_rank(0);
      req.set_incarnation(kTestIncarnation);
      req.set_array(array);
      req.mutable_range()->set_begin(copy.owned_unpadded().begin);
      req.mutable_range()->set_end(copy.owned_unpadded().end);
      std::vector<float>& values = array == v1::STATE_ARRAY_MASTER    ? out.masters
                                   : array == v1::STATE_ARRAY_EXP_AVG ? out.exp_avg
                                                                      : out.exp_avg_sq;
      absl::Status s = copy.ReadState(
          req.rank(), req.incarnation(), req.array(), {req.range().begin(), req.range().end()},
          1 << 12, [&](StateChunkOut& c) {
            const size_t old = values.size();
            values.resize(old + c.data.size() / sizeof(float));
            std::memcpy(values.data() + old, c.data.data(), c.data.size());
            for (const TensorStepCount& t : c.tensor_steps) out.steps[t.tensor] = t.steps;
            return true;
          });
      EXPECT_TRUE(s.ok()) << s;
    }
    return out;
  }
  void ExpectSameState(const CopyState& a, const CopyState& b, const std::string& what) {
    EXPECT_EQ(a.hash, b.hash) << what;
    EXPECT_TRUE(SameBits(a.masters, b.masters)) << what;
    EXPECT_TRUE(SameBits(a.exp_avg, b.exp_avg)) << what;
    EXPECT_TRUE(SameBits(a.exp_avg_sq, b.exp_avg_sq)) << what;
    EXPECT_EQ(a.steps, b.steps) << what;
  }

  // A replicated AdamW job with two parameter groups whose layout has a
  // frozen tensor in each replica group: embed (group 0), l1.w (group 1),
  // l1.b (frozen), big.w (group 1, across both replica groups), big.b
  // (frozen), head (group 0). Both backups are refilled by a state
  // transfer (the primaries' states written between steps) while some
  // counts lag: the backups must end up equal to their primaries.
  void StateTransferWithFrozenTensorsAndLaggingCounts(const std::string& id) {
    const TestJob j = StartJob(id, 2, 2, [](v1::JobSpec& spec) {
      for (int t : {1, 3}) spec.mutable_layout()->mutable_tensors(t)->set_group(1);
      for (int t : {2, 4}) spec.mutable_layout()->mutable_tensors(t)->set_frozen(true);
      absl::StatusOr<Layout> layout = LayoutFromProto(spec.layout());
      ASSERT_TRUE(layout.ok()) << layout.status();
      spec.set_layout_fingerprint(layout->fingerprint());
      for (int g = 0; g < 2; ++g) {
        v1::ParamGroup* pg = spec.add_param_groups();
        pg->set_lr(0.01f);
        pg->set_beta1(g == 0 ? 0.9f : 0.85f);
        pg->set_beta2(g == 0 ? 0.999f : 0.99f);
        pg->set_eps(1e-8f);
        pg->set_weight_decay(g == 0 ? 0.01f : 0.1f);
      }
    });
    ASSERT_EQ(GroupCount(j.config), 2u);
    const Layout& layout = j.config.layout;
    for (uint32_t g = 0; g < 2; ++g) {
      // Each replica group holds part of a frozen tensor.
      ASSERT_GT(OwnedTensors(layout, j.config.map.DaemonRange(g)).frozen_elements(), 0u) << g;
    }
    const std::vector<Where> placement = {{0, 0, 1}, {1, 1, 1}};
    for (const v1::PrepareStepResponse& p : RunStep(j, 1, placement)) {
      EXPECT_TRUE(p.backup_in_sync());
    }
    // embed and head get no gradient in step 2: their counts lag.
    for (const v1::PrepareStepResponse& p : RunStep(j, 2, placement, false, {0, 5})) {
      EXPECT_TRUE(p.backup_in_sync());
    }
    // State written on each primary between steps: l1.w's count on group 0,
    // head's masters on group 1. Each backup is stale until its next step.
    {
      v1::StateChunk counts = testing::StateChunk(id, 0, v1::STATE_ARRAY_MASTER, {0, 0}, nullptr);
      v1::TensorStep* t = counts.add_tensor_steps();
      t->set_tensor(1);
      t->set_steps(9);
      grpc::Status s = Home(0).WriteState({counts});
      ASSERT_TRUE(s.ok()) << s.error_message();
      const FlatRange head = layout.tensors()[5].range();
      std::vector<float> values;
      s = Home(1).ReadState(id, 0, v1::STATE_ARRAY_MASTER, head, &values);
      ASSERT_TRUE(s.ok()) << s.error_message();
      for (float& v : values) v += 1.0f;
      s = Home(1).WriteState(
          {testing::StateChunk(id, 0, v1::STATE_ARRAY_MASTER, head, values.data())});
      ASSERT_TRUE(s.ok()) << s.error_message();
    }
    for (int d = 0; d < 2; ++d) {
      v1::ReplicaState state;
      ASSERT_TRUE(Replica(d).State(id, &state).ok());
      EXPECT_FALSE(GroupState(state, d)->in_sync()) << state.ShortDebugString();
    }
    // Step 3 (head still without a gradient) copies each primary's state to
    // its backup, then forwards the step.
    for (const v1::PrepareStepResponse& p : RunStep(j, 3, placement, false, {5})) {
      EXPECT_TRUE(p.backup_in_sync());
    }
    for (int d = 0; d < 2; ++d) {
      EXPECT_EQ(testing::RequestCount(daemon(d), "TransferState"), 2) << "daemon " << d;
    }
    const std::map<uint32_t, uint64_t> expected[2] = {
        {{0, 2}, {1, 10}, {3, 3}},  // embed, l1.w, the start of big.w
        {{3, 3}, {5, 1}},           // the rest of big.w, head
    };
    for (uint32_t g = 0; g < 2; ++g) {
      SCOPED_TRACE(absl::StrCat("group ", g));
      std::shared_ptr<Job> primary = Copy(g, id, g);
      std::shared_ptr<Job> backup = Copy(1 - g, id, g);
      ASSERT_TRUE(primary && backup);
      EXPECT_EQ(backup->committed_step(), 3u);
      const CopyState want = StateOf(*primary, j);
      EXPECT_EQ(want.steps, expected[g]);
      ExpectSameState(StateOf(*backup, j), want, "backup");
      // The frozen tensors' moments read as zeros.
      for (int t : {2, 4}) {
        const FlatRange f = layout.tensors()[t].range().Intersect(primary->owned_unpadded());
        for (uint64_t i = f.begin; i < f.end; ++i) {
          ASSERT_EQ(want.exp_avg[i - primary->owned_unpadded().begin], 0.0f) << i;
        }
      }
    }
  }

  std::vector<std::unique_ptr<Daemon>> daemons_;
  std::vector<std::string> addresses_;
  std::map<std::tuple<int, uint32_t, uint64_t>, std::unique_ptr<DaemonClient>> targets_;
  std::map<int, std::unique_ptr<ReplicaClient>> replica_clients_;
  std::map<int, std::unique_ptr<ReplicaClient>> operator_clients_;
};

// ---- 1. The backup follows its primary bit for bit ----

TEST_F(ReplicaTest, ReplicatedStepKeepsBackupBitIdentical) {
  const TestJob j = StartJob("bits", 2);
  // The same training without replication, for the arithmetic.
  const TestJob ref = StartJob("bits-ref", 2, /*replicas=*/1);

  // Before the first step no backup holds a copy.
  for (int d = 0; d < 2; ++d) {
    v1::ReplicaState state;
    ASSERT_TRUE(Replica(d).State(j.id, &state).ok());
    ASSERT_EQ(state.groups_size(), 2) << state.ShortDebugString();
    const v1::ReplicaGroupState* home = GroupState(state, d);
    const v1::ReplicaGroupState* backup = GroupState(state, 1 - d);
    ASSERT_NE(home, nullptr);
    ASSERT_NE(backup, nullptr);
    EXPECT_EQ(home->role(), v1::REPLICA_ROLE_PRIMARY);
    EXPECT_EQ(backup->role(), v1::REPLICA_ROLE_BACKUP);
    EXPECT_EQ(home->epoch(), 1u);
    EXPECT_EQ(backup->epoch(), 1u);
    EXPECT_FALSE(backup->in_sync());
    EXPECT_EQ(home->peer_address(), addresses_[1 - d]);
    EXPECT_EQ(backup->peer_address(), addresses_[1 - d]);
  }

  // The ledger: each daemon books the copy it backs up as "replica" (fp32
  // AdamW, stage 2: masters, both moments and the gradient, over the padded
  // range of the group), and nothing of it under the primary's categories.
  auto check_ledger = [&](const std::string& when) {
    for (int d = 0; d < 2; ++d) {
      const uint64_t home_n = j.config.map.DaemonRange(d).size();
      const uint64_t backup_n = j.config.map.DaemonRange(1 - d).size();
      const CategoryBytes bytes = daemon(d).ledger().JobBytes(j.id);
      EXPECT_EQ(bytes[static_cast<int>(MemoryCategory::kReplica)], 4 * sizeof(float) * backup_n)
          << when << ", daemon " << d;
      EXPECT_EQ(bytes[static_cast<int>(MemoryCategory::kParamMaster)], sizeof(float) * home_n)
          << when << ", daemon " << d;
      EXPECT_EQ(bytes[static_cast<int>(MemoryCategory::kGrad)], sizeof(float) * home_n)
          << when << ", daemon " << d;
      grpc::ClientContext ctx;
      SetDeadline(&ctx);
      v1::MemoryReportRequest req;
      req.set_job_id(j.id);
      v1::MemoryReportResponse report;
      grpc::Status s = Plain(d).admin->MemoryReport(&ctx, req, &report);
      ASSERT_TRUE(s.ok()) << s.error_message();
      ASSERT_EQ(report.jobs_size(), 1);
      EXPECT_EQ(CategoryOf(report, "replica"), 4 * sizeof(float) * backup_n)
          << when << ", daemon " << d;
      EXPECT_EQ(CategoryOf(report, "param_master"), sizeof(float) * home_n)
          << when << ", daemon " << d;
    }
  };
  check_ledger("after registration");
  const CategoryBytes buffer_before = daemon(0).ledger().JobBytes(j.id);

  constexpr uint64_t kSteps = 5;
  for (uint64_t step = 1; step <= kSteps; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    const uint64_t e = 1;
    const bool skip = step == 4;  // a skipped step is replicated too
    const std::vector<v1::PrepareStepResponse> prepared =
        RunStep(j, step, {{0, 0, e}, {1, 1, e}}, skip);
    RunStep(ref, step, {{0, 0, 0}, {1, 1, 0}}, skip);
    for (const v1::PrepareStepResponse& p : prepared) EXPECT_TRUE(p.backup_in_sync());
    for (uint32_t g = 0; g < 2; ++g) {
      std::shared_ptr<Job> primary = Copy(g, j.id, g);
      std::shared_ptr<Job> backup = Copy(1 - g, j.id, g);
      std::shared_ptr<Job> reference = Copy(g, ref.id, g);
      ASSERT_TRUE(primary && backup && reference);
      EXPECT_EQ(primary->role(), ReplicaRole::kPrimary);
      EXPECT_EQ(backup->role(), ReplicaRole::kBackup);
      EXPECT_EQ(primary->committed_step(), step);
      EXPECT_EQ(backup->committed_step(), step);
      EXPECT_EQ(backup->loss_scale(), primary->loss_scale());
      const std::vector<float> masters = Masters(*primary);
      ASSERT_EQ(masters.size(), j.Range(g).size());
      EXPECT_TRUE(SameBits(Masters(*backup), masters)) << "group " << g;
      // Replication changes nothing in the arithmetic.
      EXPECT_TRUE(SameBits(Masters(*reference), masters)) << "group " << g;
      // And the step did something.
      EXPECT_FALSE(SameBits(masters, std::vector<float>(j.init.begin() + j.Range(g).begin,
                                                        j.init.begin() + j.Range(g).end)));
      // What a client gathers from the primary is what the backup holds.
      std::vector<float> gathered;
      grpc::Status s = Target(g, g, 1).Gather(j.id, step, j.Range(g), &gathered);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_TRUE(SameBits(gathered, masters));
    }
  }

  // One state transfer per backup (the first step), a forward and a commit
  // for every step after it: each daemon received them for the group it
  // backs up.
  for (int d = 0; d < 2; ++d) {
    EXPECT_EQ(testing::RequestCount(daemon(d), "TransferState"), 1) << "daemon " << d;
    EXPECT_EQ(testing::RequestCount(daemon(d), "ForwardGradient"), kSteps) << "daemon " << d;
    EXPECT_EQ(testing::RequestCount(daemon(d), "CommitReplica"), kSteps) << "daemon " << d;
    v1::ReplicaState state;
    ASSERT_TRUE(Replica(d).State(j.id, &state).ok());
    for (const v1::ReplicaGroupState& g : state.groups()) {
      EXPECT_TRUE(g.in_sync()) << state.ShortDebugString();
      EXPECT_EQ(g.committed_step(), kSteps);
      EXPECT_FALSE(g.prepared());
      EXPECT_EQ(g.epoch(), 1u);
    }
  }
  check_ledger("after the steps");
  // The transfer's held chunks were released; what stays is the backup's
  // forward buffer (its group's unpadded elements, fp32), booked once.
  std::shared_ptr<Job> backup = *daemon(0).jobs().Find(j.id, 1);
  EXPECT_EQ(daemon(0).ledger().JobBytes(j.id)[static_cast<int>(MemoryCategory::kBuffer)],
            buffer_before[static_cast<int>(MemoryCategory::kBuffer)] +
                backup->owned_unpadded().size() * sizeof(float));
}

// A step in which some tensors got no gradient: the primary forwards its
// list with the reduced gradient, so the backup skips the same tensors (no
// update, no weight decay, its count unchanged) and stays equal, counts and
// moments included.
TEST_F(ReplicaTest, BackupSkipsTheTensorsWithoutAGradient) {
  const TestJob j = StartJob("nograd", 2);
  const std::vector<Where> placement = {{0, 0, 1}, {1, 1, 1}};
  // l1.b (group 0) misses steps 2 and 3, big.b (group 1) step 3.
  const std::vector<std::vector<uint32_t>> no_grad = {{}, {2}, {2, 4}};
  for (uint64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    for (const v1::PrepareStepResponse& p : RunStep(j, step, placement, false, no_grad[step - 1])) {
      EXPECT_TRUE(p.backup_in_sync());
    }
    for (uint32_t g = 0; g < 2; ++g) {
      EXPECT_TRUE(SameBits(Masters(*Copy(1 - g, j.id, g)), Masters(*Copy(g, j.id, g))))
          << "group " << g;
    }
  }
  // One transfer (step 1): steps 2 and 3 were forwarded.
  for (int d = 0; d < 2; ++d) {
    EXPECT_EQ(testing::RequestCount(daemon(d), "TransferState"), 1) << "daemon " << d;
  }
  const std::map<uint32_t, uint64_t> expected[2] = {
      {{0, 3}, {1, 3}, {2, 1}, {3, 3}},  // embed, l1.w, l1.b, the start of big.w
      {{3, 3}, {4, 2}, {5, 3}},          // the rest of big.w, big.b, head
  };
  for (uint32_t g = 0; g < 2; ++g) {
    SCOPED_TRACE(absl::StrCat("group ", g));
    const CopyState primary = StateOf(*Copy(g, j.id, g), j);
    EXPECT_EQ(primary.steps, expected[g]);
    ExpectSameState(StateOf(*Copy(1 - g, j.id, g), j), primary, "backup");
  }
}

TEST_F(ReplicaTest, StateTransferCarriesFrozenTensorsAndLaggingCounts) {
  StateTransferWithFrozenTensorsAndLaggingCounts("frozen");
}

// ---- 2. Promotion and the epoch fence ----

TEST_F(ReplicaTest, PromoteAndFence) {
  const TestJob j = StartJob("promote", 3);
  // A backup that never copied its primary cannot take over.
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "holds no current copy",
                 [&] { return Operator(1).Promote(j.id, 0, 2, 0); });

  for (uint64_t step = 1; step <= 2; ++step) {
    for (const v1::PrepareStepResponse& p : RunStep(j, step, {{0, 0, 1}, {1, 1, 1}})) {
      EXPECT_TRUE(p.backup_in_sync());
    }
  }
  std::vector<float> masters0;
  ASSERT_TRUE(Target(0, 0, 1).Gather(j.id, 2, j.Range(0), &masters0).ok());

  // Group 1's backup on daemon 0: only one epoch up from its own (not at
  // it, below it, or a jump that would leave no epoch above), and not when
  // the job committed a step it has not.
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION,
                 "epoch: a promotion steps the backup's epoch (1) by one: must be 2, got 1",
                 [&] { return Operator(0).Promote(j.id, 1, 1, 2); });
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "must be 2, got 0",
                 [&] { return Operator(0).Promote(j.id, 1, 0, 2); });
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "must be 2, got 18446744073709551615",
                 [&] { return Operator(0).Promote(j.id, 1, UINT64_MAX, 2); });
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "must be 2, got 5",
                 [&] { return Operator(0).Promote(j.id, 1, 5, 2); });
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "behind",
                 [&] { return Operator(0).Promote(j.id, 1, 2, 3); });
  // A group a daemon does not hold.
  ExpectRejected(j.id, grpc::NOT_FOUND, "not group 7",
                 [&] { return Operator(0).Promote(j.id, 7, 5, 2); });

  // Group 0's backup on daemon 1 takes over at epoch 2; its bytes move from
  // replica to the primary's categories.
  const CategoryBytes before = daemon(1).ledger().JobBytes(j.id);
  const uint64_t total_before = daemon(1).ledger().total();
  v1::ReplicaState promoted;
  grpc::Status s = Operator(1).Promote(j.id, 0, 2, 2, &promoted);
  ASSERT_TRUE(s.ok()) << s.error_message();
  {
    const CategoryBytes after = daemon(1).ledger().JobBytes(j.id);
    const uint64_t n = j.config.map.DaemonRange(0).size() * sizeof(float);
    auto at = [](const CategoryBytes& b, MemoryCategory c) { return b[static_cast<int>(c)]; };
    EXPECT_EQ(at(after, MemoryCategory::kReplica), at(before, MemoryCategory::kReplica) - 4 * n);
    for (MemoryCategory c : {MemoryCategory::kParamMaster, MemoryCategory::kOptimM,
                             MemoryCategory::kOptimV, MemoryCategory::kGrad}) {
      EXPECT_EQ(at(after, c), at(before, c) + n) << MemoryCategoryName(c);
    }
    EXPECT_EQ(daemon(1).ledger().total(), total_before);  // rebooked, not allocated
  }
  const v1::ReplicaGroupState* g0 = GroupState(promoted, 0);
  ASSERT_NE(g0, nullptr) << promoted.ShortDebugString();
  EXPECT_EQ(g0->role(), v1::REPLICA_ROLE_PRIMARY);
  EXPECT_EQ(g0->epoch(), 2u);
  EXPECT_EQ(g0->committed_step(), 2u);
  // The same promotion again is idempotent; another epoch is refused.
  EXPECT_TRUE(Operator(1).Promote(j.id, 0, 2, 2).ok());
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "is primary here at epoch 2",
                 [&] { return Operator(1).Promote(j.id, 0, 3, 2); });

  // The promoted copy serves epoch 2, not epoch 1.
  std::vector<float> out;
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "the group was promoted since",
                 [&] { return Target(1, 0, 1).Gather(j.id, 2, j.Range(0), &out); });
  v1::PrepareStepResponse prepared;
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "epoch",
                 [&] { return Target(1, 0, 1).Prepare(j.id, 3, &prepared); });
  v1::StepState state;
  s = Target(1, 0, 2).StepState(j.id, &state);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(state.replica().group(), 0u);
  EXPECT_EQ(state.replica().role(), v1::REPLICA_ROLE_PRIMARY);
  EXPECT_EQ(state.replica().epoch(), 2u);
  EXPECT_EQ(state.replica().committed_step(), 2u);
  s = Target(1, 0, 2).Gather(j.id, 2, j.Range(0), &out);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(SameBits(out, masters0));
  // The old primary refuses the callers that moved on.
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "this copy was replaced",
                 [&] { return Target(0, 0, 2).Gather(j.id, 2, j.Range(0), &out); });

  // The old primary, not knowing, prepares step 3 alone: its forward is
  // refused by the promoted copy (ABORTED: the sender was replaced), which
  // does not change; the old primary steps down to a backup that is not
  // current (booked as replica again), refuses the prepare and the commit,
  // and serves its old callers no more.
  const std::string promoted_before = Snapshot(j.id);
  const uint64_t promoted_hash = Copy(1, j.id, 0)->StateHash();
  for (uint32_t rank = 0; rank < kWorld; ++rank) {
    const std::vector<float> g = Grads(j.total(), 3)[rank];
    ASSERT_TRUE(Target(0, 0, 1)
                    .Push(GradientChunks(j.id, 3, rank, j.config.map, j.Range(0),
                                         g.data() + j.Range(0).begin, 333))
                    .ok());
  }
  const uint64_t old_total = daemon(0).ledger().total();
  v1::PrepareStepResponse alone;
  s = Target(0, 0, 1).Prepare(j.id, 3, &alone);
  EXPECT_EQ(s.error_code(), grpc::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("was replaced (its backup was promoted) and stepped down"),
            std::string::npos)
      << s.error_message();
  EXPECT_EQ(Copy(0, j.id, 0)->role(), ReplicaRole::kBackup);
  EXPECT_EQ(Copy(0, j.id, 0)->epoch(), 1u);
  EXPECT_EQ(Copy(0, j.id, 0)->committed_step(), 2u);
  EXPECT_EQ(daemon(0).ledger().total(), old_total);  // rebooked, not allocated
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "as its backup",
                 [&] { return Target(0, 0, 1).Gather(j.id, 2, j.Range(0), &out); });
  EXPECT_EQ(Copy(1, j.id, 0)->StateHash(), promoted_hash);
  EXPECT_EQ(Copy(1, j.id, 0)->committed_step(), 2u);
  EXPECT_EQ(Copy(1, j.id, 0)->epoch(), 2u);
  // Not current: it cannot be promoted back.
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "holds no current copy",
                 [&] { return Operator(0).Promote(j.id, 0, 2, 3); });

  // The new primary runs step 3 (its ranks join it first): it copies its
  // state to the old primary, a backup at epoch 2 from then on, and forwards
  // the step.
  ASSERT_TRUE(Target(1, 0, 2).JoinAll(j.spec).ok());
  for (const v1::PrepareStepResponse& p : RunStep(j, 3, {{1, 0, 2}, {1, 1, 1}})) {
    EXPECT_TRUE(p.backup_in_sync());
  }
  std::shared_ptr<Job> new_primary = Copy(1, j.id, 0);
  std::shared_ptr<Job> old_primary = Copy(0, j.id, 0);
  EXPECT_EQ(old_primary->role(), ReplicaRole::kBackup);
  EXPECT_EQ(old_primary->epoch(), 2u);
  EXPECT_EQ(old_primary->committed_step(), 3u);
  // Both copies now have every rank joined: the whole state hashes equal
  // (masters, both moments, step counters, reduction).
  EXPECT_EQ(old_primary->StateHash(), new_primary->StateHash());
  EXPECT_TRUE(SameBits(Masters(*old_primary), Masters(*new_primary)));
  // The old primary serves nobody now.
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "backup",
                 [&] { return Target(0, 0, 1).Gather(j.id, 3, j.Range(0), &out); });
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "backup",
                 [&] { return Target(0, 0, 2).Gather(j.id, 3, j.Range(0), &out); });
  // Step 4 under the new placement.
  for (const v1::PrepareStepResponse& p : RunStep(j, 4, {{1, 0, 2}, {1, 1, 1}})) {
    EXPECT_TRUE(p.backup_in_sync());
  }
  EXPECT_EQ(old_primary->StateHash(), new_primary->StateHash());
  EXPECT_EQ(old_primary->committed_step(), 4u);
  // Group 1 went on, in sync, throughout.
  EXPECT_TRUE(SameBits(Masters(*Copy(0, j.id, 1)), Masters(*Copy(1, j.id, 1))));
}

// A backup holding the prepared step (forwarded, not yet committed) counts
// it: the leader may promote it with that step as committed and finish it.
// A primary that goes silent mid-forward (it sent part of the step's
// gradient and stalled) keeps its backup's Promote waiting for nothing: the
// backup reads a forward from the network with no lock of the step engine
// held, and takes the commit lock only to apply the whole forward. (When
// the forward held the commit lock while it read, the promotion waited for
// the stream to end.) The stalled stream, from the replaced primary, is then
// refused.
TEST_F(ReplicaTest, StalledForwardStallsNoPromote) {
  const TestJob j = StartJob("stalled-forward", 2);
  RunStep(j, 1, {{0, 0, 1}, {1, 1, 1}});  // both backups in sync
  // Group 0's backup is on daemon 1: half of step 2's forward, then silence.
  const FlatRange r = j.Range(0);
  const uint64_t half = r.begin + r.size() / 2;
  std::vector<float> g(r.size(), 0.5f);
  auto chunk = [&](FlatRange piece) {
    v1::ForwardedGradientChunk c;
    c.set_job_id(j.id);
    c.set_group(0);
    c.set_epoch(1);
    c.set_step(2);
    c.mutable_range()->set_begin(piece.begin);
    c.mutable_range()->set_end(piece.end);
    c.set_data(g.data() + (piece.begin - r.begin), piece.size() * sizeof(float));
    return c;
  };
  grpc::ClientContext ctx;
  SetDeadline(&ctx, 120);
  v1::ForwardGradientResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::ForwardedGradientChunk>> writer =
      Replica(1).stub->ForwardGradient(&ctx, &resp);
  v1::ForwardedGradientChunk first = chunk({r.begin, half});
  first.mutable_prepared()->set_elements(r.size());
  ASSERT_TRUE(writer->Write(first));
  absl::SleepFor(absl::Milliseconds(300));  // the backup is waiting for the rest

  const absl::Time t0 = absl::Now();
  grpc::Status promoted = Operator(1).Promote(j.id, 0, 2, 1);  // its own 30 s deadline
  const absl::Duration took = absl::Now() - t0;
  EXPECT_TRUE(promoted.ok()) << promoted.error_message();
  EXPECT_LT(took, absl::Seconds(5)) << "the promotion waited for the stalled forward";

  // The rest arrives from a primary that was replaced meanwhile.
  ASSERT_TRUE(writer->Write(chunk({half, r.end})));
  writer->WritesDone();
  const grpc::Status refused = writer->Finish();
  EXPECT_EQ(refused.error_code(), grpc::ABORTED) << refused.error_message();
  EXPECT_NE(refused.error_message().find("cannot drive it"), std::string::npos)
      << refused.error_message();
  std::shared_ptr<Job> copy = Copy(1, j.id, 0);
  ASSERT_NE(copy, nullptr);
  EXPECT_EQ(copy->role(), ReplicaRole::kPrimary);
  EXPECT_EQ(copy->epoch(), 2u);
  EXPECT_EQ(copy->committed_step(), 1u);
  EXPECT_FALSE(copy->StepState(absl::Seconds(30), /*brief=*/true).step.prepared)
      << "the replaced primary's forward was taken";
}

// A trainer holds the job's token, not the authority to replace a primary
// that serves: its Promote takes effect only once the backup cannot reach
// the primary either (the backup asks the primary's daemon first). The
// admin token may replace a live primary; a trainer's Promote of one is
// refused (ABORTED: the leader waits and reads the placement again) and
// changes nothing. Once the primary's daemon is gone, the same Promote
// works, without waiting out a deadline.
TEST_F(ReplicaTest, ATrainersPromoteReplacesOnlyAPrimaryThatIsGone) {
  const TestJob j = SyncedJob("trainer-promote");
  const std::string before = Snapshot(j.id);
  ExpectRejected(j.id, grpc::ABORTED, "still serves it (epoch 1, committed step 1)",
                 [&] { return Replica(1).Promote(j.id, 0, 2, 1); });
  ExpectRejected(j.id, grpc::ABORTED, "cannot reach either",
                 [&] { return Replica(0).Promote(j.id, 1, 2, 1); });
  // A deadline too short for the backup to hear from its primary does not
  // make the primary look gone (nor does one already past when the handler
  // runs).
  for (int ms : {300, 2}) {
    EXPECT_EQ(Replica(1).Promote(j.id, 0, 2, 1, nullptr, ms).error_code(),
              grpc::DEADLINE_EXCEEDED);
  }
  absl::SleepFor(absl::Milliseconds(300));  // a handler still running has ended
  EXPECT_EQ(Snapshot(j.id), before);
  EXPECT_EQ(Copy(1, j.id, 0)->role(), ReplicaRole::kBackup);
  EXPECT_EQ(Copy(0, j.id, 0)->role(), ReplicaRole::kPrimary);
  // The job goes on as placed, both backups in sync.
  for (const v1::PrepareStepResponse& p : RunStep(j, 2, {{0, 0, 1}, {1, 1, 1}})) {
    EXPECT_TRUE(p.backup_in_sync());
  }

  // Daemon 0 goes away: group 0's backup on daemon 1 finds it gone.
  daemons_[0]->Shutdown(absl::Seconds(1));
  daemons_[0].reset();
  const absl::Time t0 = absl::Now();
  grpc::Status s = Replica(1).Promote(j.id, 0, 2, 2);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  EXPECT_EQ(Copy(1, j.id, 0)->role(), ReplicaRole::kPrimary);
  EXPECT_EQ(Copy(1, j.id, 0)->epoch(), 2u);
  EXPECT_EQ(Copy(1, j.id, 0)->committed_step(), 2u);
  // The same promotion again is idempotent (no question to the dead peer).
  EXPECT_TRUE(Replica(1).Promote(j.id, 0, 2, 2).ok());
}

TEST_F(ReplicaTest, PromoteCountsThePreparedStep) {
  const TestJob j = SyncedJob("prepared");
  const std::vector<std::vector<float>> grads = Grads(j.total(), 2);
  const FlatRange r = j.Range(0);
  for (uint32_t rank = 0; rank < kWorld; ++rank) {
    ASSERT_TRUE(
        Target(0, 0, 1)
            .Push(GradientChunks(j.id, 2, rank, j.config.map, r, grads[rank].data() + r.begin, 333))
            .ok());
  }
  v1::PrepareStepResponse p;
  ASSERT_TRUE(Target(0, 0, 1).Prepare(j.id, 2, &p).ok());
  EXPECT_TRUE(p.backup_in_sync());
  const v1::ReplicaGroupState held = ReplicaStateOf(*Copy(1, j.id, 0));
  EXPECT_TRUE(held.prepared()) << held.ShortDebugString();
  EXPECT_TRUE(held.in_sync()) << held.ShortDebugString();
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "behind",
                 [&] { return Operator(1).Promote(j.id, 0, 2, 3); });
  ASSERT_TRUE(Operator(1).Promote(j.id, 0, 2, 2).ok());
  // The leader finishes step 2 on the promoted copy.
  ASSERT_TRUE(Target(1, 0, 2).JoinAll(j.spec).ok());
  v1::PrepareStepResponse again;
  ASSERT_TRUE(Target(1, 0, 2).Prepare(j.id, 2, &again).ok());
  EXPECT_EQ(again.grad_sq_sum(), p.grad_sq_sum());
  const float clip = 1.0f;
  ASSERT_TRUE(Target(0, 0, 1).Commit(j.id, 2, kLr, clip).ok());  // the old primary, alone
  ASSERT_TRUE(Target(1, 0, 2).Commit(j.id, 2, kLr, clip).ok());
  EXPECT_EQ(Copy(1, j.id, 0)->committed_step(), 2u);
  EXPECT_TRUE(SameBits(Masters(*Copy(0, j.id, 0)), Masters(*Copy(1, j.id, 0))));
}

// The primary died after forwarding step 2 and before any copy committed
// it: the ranks compute step 2 again and push it to the promoted copy, which
// drops the forwarded gradient and reduces theirs (the same sum of squares
// as the forwarded one).
TEST_F(ReplicaTest, PromotedCopyTakesTheStepPushedAgain) {
  const TestJob j = SyncedJob("repushed");
  const std::vector<std::vector<float>> grads = Grads(j.total(), 2);
  const FlatRange r = j.Range(0);
  auto push_all = [&](DaemonClient& t) {
    for (uint32_t rank = 0; rank < kWorld; ++rank) {
      grpc::Status s =
          t.Push(GradientChunks(j.id, 2, rank, j.config.map, r, grads[rank].data() + r.begin, 333));
      if (!s.ok()) return s;
    }
    return grpc::Status::OK;
  };
  ASSERT_TRUE(push_all(Target(0, 0, 1)).ok());
  v1::PrepareStepResponse p;
  ASSERT_TRUE(Target(0, 0, 1).Prepare(j.id, 2, &p).ok());
  ASSERT_TRUE(p.backup_in_sync());
  ASSERT_TRUE(Operator(1).Promote(j.id, 0, 2, 1).ok());
  ASSERT_TRUE(Target(1, 0, 2).JoinAll(j.spec).ok());
  // The ranks join the promoted copy and push the same gradients again.
  grpc::Status pushed = push_all(Target(1, 0, 2));
  ASSERT_TRUE(pushed.ok()) << pushed.error_message();
  const v1::ReplicaGroupState state = ReplicaStateOf(*Copy(1, j.id, 0));
  EXPECT_FALSE(state.prepared()) << state.ShortDebugString();
  v1::PrepareStepResponse again;
  ASSERT_TRUE(Target(1, 0, 2).Prepare(j.id, 2, &again).ok());
  EXPECT_EQ(again.grad_sq_sum(), p.grad_sq_sum());
  // The promoted copy's PrepareStep copied its state to the old primary
  // (now its backup at epoch 2) and forwarded its own reduction; the commit
  // goes to both.
  EXPECT_TRUE(again.backup_in_sync());
  ASSERT_TRUE(Target(1, 0, 2).Commit(j.id, 2, kLr, 1.0f).ok());
  EXPECT_EQ(Copy(1, j.id, 0)->committed_step(), 2u);
  EXPECT_EQ(Copy(0, j.id, 0)->committed_step(), 2u);
  EXPECT_EQ(Copy(0, j.id, 0)->role(), ReplicaRole::kBackup);
  EXPECT_TRUE(SameBits(Masters(*Copy(0, j.id, 0)), Masters(*Copy(1, j.id, 0))));
}

// ---- 3. Bad input to every Replica RPC ----

TEST_F(ReplicaTest, AuthAndUnknownNamesChangeNothing) {
  const TestJob j = SyncedJob("auth");
  ReplicaClient none(addresses_[1], "");
  ReplicaClient wrong(addresses_[1], kWrongToken);
  ReplicaClient& good = Replica(1);
  v1::ReplicaState state;
  const auto transfer = TransferChunks(j, 0, 1, 1);
  const auto forward = ForwardChunks(j, 0, 1, 2);
  const auto commit = CommitRequest(j, 0, 1, 2);
  struct Case {
    const char* rpc;
    std::function<grpc::Status(ReplicaClient&, const std::string& job, uint32_t group)> call;
  };
  const std::vector<Case> cases = {
      {"GetReplicaState",
       [&](ReplicaClient& c, const std::string& id, uint32_t) { return c.State(id, &state); }},
      {"Promote",
       [&](ReplicaClient& c, const std::string& id, uint32_t g) { return c.Promote(id, g, 2, 1); }},
      {"TransferState",
       [&](ReplicaClient& c, const std::string& id, uint32_t g) {
         auto chunks = transfer;
         for (auto& ch : chunks) {
           ch.set_job_id(id);
           ch.set_group(g);
         }
         return c.Transfer(chunks);
       }},
      {"ForwardGradient",
       [&](ReplicaClient& c, const std::string& id, uint32_t g) {
         auto chunks = forward;
         for (auto& ch : chunks) {
           ch.set_job_id(id);
           ch.set_group(g);
         }
         return c.Forward(chunks);
       }},
      {"CommitReplica",
       [&](ReplicaClient& c, const std::string& id, uint32_t g) {
         auto req = commit;
         req.set_job_id(id);
         req.set_group(g);
         return c.Commit(req);
       }},
      {"ReleaseReplica",
       [&](ReplicaClient& c, const std::string& id, uint32_t g) { return c.Release(id, g, 1); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.rpc);
    ExpectRejected(j.id, grpc::UNAUTHENTICATED, "needs a token",
                   [&] { return c.call(none, j.id, 0); });
    // Streams are refused before their first message: the wrong token opens
    // no job here.
    const bool stream =
        std::string(c.rpc) == "TransferState" || std::string(c.rpc) == "ForwardGradient";
    ExpectRejected(j.id, stream ? grpc::NOT_FOUND : grpc::PERMISSION_DENIED,
                   stream ? "opens with the token presented" : "does not open job",
                   [&] { return c.call(wrong, j.id, 0); });
    ExpectRejected(j.id, grpc::NOT_FOUND, "is not registered on this daemon",
                   [&] { return c.call(good, "no-such-job", 0); });
    if (std::string(c.rpc) != "GetReplicaState") {
      ExpectRejected(j.id, grpc::NOT_FOUND, "not group 9", [&] { return c.call(good, j.id, 9); });
    }
  }
  // Every copy still in sync after all that.
  for (int d = 0; d < 2; ++d) {
    ASSERT_TRUE(Replica(d).State(j.id, &state).ok());
    for (const auto& g : state.groups()) EXPECT_TRUE(g.in_sync()) << state.ShortDebugString();
  }
}

TEST_F(ReplicaTest, BadTransferStateChangesNothing) {
  const TestJob j = SyncedJob("transfer");
  ReplicaClient& c = Replica(1);  // holds the backup of group 0
  const std::vector<v1::ReplicaStateChunk> good = TransferChunks(j, 0, 1, 1);
  ASSERT_GT(good.size(), 6u);
  auto reject = [&](grpc::StatusCode code, const std::string& text,
                    const std::vector<v1::ReplicaStateChunk>& chunks) {
    ExpectRejected(j.id, code, text, [&] { return c.Transfer(chunks); });
  };
  auto with = [&](size_t i, const std::function<void(v1::ReplicaStateChunk&)>& f) {
    std::vector<v1::ReplicaStateChunk> chunks = good;
    f(chunks[i]);
    return chunks;
  };
  reject(grpc::INVALID_ARGUMENT, "carried no chunk", {});
  reject(grpc::INVALID_ARGUMENT, "chunk 0.array: this job's state has 3 arrays, got 3",
         with(0, [](auto& ch) { ch.set_array(3); }));
  reject(grpc::INVALID_ARGUMENT, "chunk 4.array",
         with(4, [](auto& ch) { ch.set_array(1u << 31); }));
  // An offset gap, an overlap, and a chunk that does not start at 0.
  reject(grpc::INVALID_ARGUMENT, "do not continue",
         with(1, [](auto& ch) { ch.set_offset(ch.offset() + 1); }));
  reject(grpc::INVALID_ARGUMENT, "do not continue",
         with(2, [](auto& ch) { ch.set_offset(ch.offset() - 1); }));
  reject(grpc::INVALID_ARGUMENT, "do not continue", with(0, [](auto& ch) { ch.set_offset(1); }));
  // Data past the array's end, and a length that is not whole floats.
  {
    std::vector<v1::ReplicaStateChunk> chunks = good;
    size_t last0 = 0;
    while (last0 + 1 < chunks.size() && chunks[last0 + 1].array() == 0) ++last0;
    chunks[last0].mutable_data()->append(std::string(8, '\0'));
    chunks[last0].set_crc32c(0);
    reject(grpc::INVALID_ARGUMENT, "do not continue", chunks);
  }
  reject(grpc::INVALID_ARGUMENT, "do not continue", with(3, [](auto& ch) {
           ch.mutable_data()->pop_back();
           ch.set_crc32c(0);
         }));
  reject(grpc::DATA_LOSS, "CRC-32C", with(5, [](auto& ch) { ch.set_crc32c(ch.crc32c() ^ 1); }));
  reject(grpc::DATA_LOSS, "CRC-32C", with(5, [](auto& ch) { (*ch.mutable_data())[3] ^= 0x40; }));
  // Incomplete: the last chunk, or a whole array, missing.
  {
    std::vector<v1::ReplicaStateChunk> chunks = good;
    chunks.pop_back();
    reject(grpc::INVALID_ARGUMENT, "the transfer ended with", chunks);
    reject(grpc::INVALID_ARGUMENT, "the transfer ended with",
           std::vector<v1::ReplicaStateChunk>(good.begin(), good.begin() + 1));
  }
  reject(grpc::INVALID_ARGUMENT, "state: the first chunk",
         with(0, [](auto& ch) { ch.clear_state(); }));
  // Later chunks: another group, another epoch, another job.
  reject(grpc::INVALID_ARGUMENT, "group and epoch must be the first chunk's",
         with(2, [](auto& ch) { ch.set_group(1); }));
  reject(grpc::INVALID_ARGUMENT, "group and epoch must be the first chunk's",
         with(2, [](auto& ch) { ch.set_epoch(2); }));
  reject(grpc::INVALID_ARGUMENT, "every chunk of the stream must name job",
         with(2, [](auto& ch) { ch.set_job_id("transfer-other"); }));
  {
    // A complete, valid transfer followed by a chunk of another job: the
    // stream is refused, so nothing of it may be applied.
    std::vector<v1::ReplicaStateChunk> chunks = good;
    v1::ReplicaStateChunk extra = chunks.back();
    extra.set_job_id("transfer-other");
    chunks.push_back(extra);
    reject(grpc::INVALID_ARGUMENT, "every chunk of the stream must name job", chunks);
  }
  // A sender at a lower epoch than the backup's (it was replaced): ABORTED,
  // which makes a primary step down.
  {
    std::vector<v1::ReplicaStateChunk> chunks = good;
    for (auto& ch : chunks) ch.set_epoch(0);
    reject(grpc::ABORTED, "the sender was replaced", chunks);
  }
  // The primary's own copy at its own epoch is not overwritten.
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "is primary here at epoch 1",
                 [&] { return Replica(0).Transfer(TransferChunks(j, 0, 1, 1)); });
  // Epochs a copy that holds state cannot be driven to: past the next one
  // (the backup, and the primary, which would step down), and the largest.
  {
    std::vector<v1::ReplicaStateChunk> chunks = good;
    for (auto& ch : chunks) ch.set_epoch(3);
    reject(grpc::FAILED_PRECONDITION, "a transfer may carry 1 or 2", chunks);
    for (auto& ch : chunks) ch.set_epoch(std::numeric_limits<uint64_t>::max());
    reject(grpc::FAILED_PRECONDITION, "the largest epoch", chunks);
  }
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "a transfer may carry 1 or 2",
                 [&] { return Replica(0).Transfer(TransferChunks(j, 0, 7, 1)); });
  EXPECT_EQ(Copy(0, j.id, 0)->role(), ReplicaRole::kPrimary);

  // The chunks above, unchanged, are a valid transfer: the backup takes them.
  v1::TransferStateResponse resp;
  grpc::Status s = c.Transfer(good, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.committed_step(), 1u);
  EXPECT_EQ(resp.bytes(), 3 * sizeof(float) * j.Range(0).size());
  std::shared_ptr<Job> backup = Copy(1, j.id, 0);
  EXPECT_EQ(backup->role(), ReplicaRole::kBackup);
  std::vector<float> sent(j.Range(0).size());
  for (const auto& ch : good) {
    if (ch.array() == 0) std::memcpy(sent.data() + ch.offset(), ch.data().data(), ch.data().size());
  }
  EXPECT_TRUE(SameBits(Masters(*backup), sent));
}

TEST_F(ReplicaTest, BadForwardGradientChangesNothing) {
  // A refused forward marks the backup out of sync (replica.proto): each
  // case runs on a job of its own.
  int jobs = 0;
  auto reject = [&](grpc::StatusCode code, const std::string& text, bool marks,
                    const std::function<void(std::vector<v1::ForwardedGradientChunk>&)>& edit) {
    const TestJob j = SyncedJob(absl::StrCat("fwd", jobs++));
    std::vector<v1::ForwardedGradientChunk> chunks = ForwardChunks(j, 0, 1, 2);
    ASSERT_GT(chunks.size(), 3u);
    edit(chunks);
    SCOPED_TRACE(text);
    ExpectRejected(
        j.id, code, text, [&] { return Replica(1).Forward(chunks); },
        marks ? std::optional<std::pair<int, uint32_t>>({1, 0}) : std::nullopt);
  };
  reject(grpc::INVALID_ARGUMENT, "carried no chunk", false, [](auto& c) { c.clear(); });
  // Another epoch than the backup's: a replaced primary, or a future one.
  reject(grpc::ABORTED, "the sender was replaced", false, [](auto& c) {
    for (auto& ch : c) ch.set_epoch(0);
  });
  reject(grpc::FAILED_PRECONDITION, "cannot drive it", false, [](auto& c) {
    for (auto& ch : c) ch.set_epoch(2);
  });
  // Another step than the backup's next.
  reject(grpc::FAILED_PRECONDITION, "step: the backup", true, [](auto& c) {
    for (auto& ch : c) ch.set_step(3);
  });
  reject(grpc::FAILED_PRECONDITION, "step: the backup", true, [](auto& c) {
    for (auto& ch : c) ch.set_step(1);
  });
  // Range gaps, overlaps, a start past the group's, empty and oversize
  // ranges, data that does not match the range.
  reject(grpc::INVALID_ARGUMENT, "does not continue the group's range", true, [](auto& c) {
    c[1].mutable_range()->set_begin(c[1].range().begin() + 1);
    c[1].mutable_data()->erase(0, 4);
    c[1].set_crc32c(0);
  });
  reject(grpc::INVALID_ARGUMENT, "does not continue the group's range", true,
         [](auto& c) { c.erase(c.begin() + 1); });
  reject(grpc::INVALID_ARGUMENT, "does not continue the group's range", true, [](auto& c) {
    c[0].mutable_range()->set_begin(c[0].range().begin() + 1);
    c[0].mutable_data()->erase(0, 4);
    c[0].set_crc32c(0);
  });
  reject(grpc::INVALID_ARGUMENT, "does not continue the group's range", true, [](auto& c) {
    c[2].mutable_range()->set_end(c[2].range().begin());
    c[2].clear_data();
    c[2].set_crc32c(0);
  });
  reject(grpc::INVALID_ARGUMENT, "does not continue the group's range", true, [](auto& c) {
    // The last chunk runs past the group's end (into group 1).
    auto& last = c.back();
    last.mutable_range()->set_end(last.range().end() + 16);
    last.mutable_data()->append(std::string(16 * sizeof(float), '\0'));
    last.set_crc32c(0);
  });
  reject(grpc::INVALID_ARGUMENT, "does not continue the group's range", true, [](auto& c) {
    // More than 4 MiB in one chunk.
    auto& last = c.back();
    const uint64_t big = (uint64_t{1} << 20) + 1;
    last.mutable_range()->set_end(last.range().begin() + big);
    last.set_data(std::string(big * sizeof(float), '\0'));
    last.set_crc32c(0);
  });
  reject(grpc::INVALID_ARGUMENT, "does not continue the group's range", true, [](auto& c) {
    c[1].mutable_data()->append(std::string(4, '\0'));
    c[1].set_crc32c(0);
  });
  reject(grpc::DATA_LOSS, "CRC-32C", true, [](auto& c) { c[2].set_crc32c(c[2].crc32c() ^ 1); });
  reject(grpc::DATA_LOSS, "CRC-32C", true, [](auto& c) { (*c[0].mutable_data())[0] ^= 1; });
  reject(grpc::INVALID_ARGUMENT, "the forward ended at element", true,
         [](auto& c) { c.pop_back(); });
  reject(grpc::INVALID_ARGUMENT, "group, epoch and step must be the first chunk's", true,
         [](auto& c) { c[1].set_step(c[1].step() + 1); });
  reject(grpc::INVALID_ARGUMENT, "group, epoch and step must be the first chunk's", true,
         [](auto& c) { c[1].set_group(1); });
  reject(grpc::INVALID_ARGUMENT, "every chunk of the stream must name job", true,
         [](auto& c) { c[1].set_job_id("fwd-other"); });
  // A complete forward followed by a chunk of another job: refused, so the
  // backup must not hold the step as prepared.
  reject(grpc::INVALID_ARGUMENT, "every chunk of the stream must name job", true, [](auto& c) {
    v1::ForwardedGradientChunk extra = c.back();
    extra.set_job_id("fwd-other");
    c.push_back(extra);
  });

  // A backup out of sync takes no forward until the state was copied.
  {
    const TestJob j = SyncedJob("fwd-stale");
    std::vector<v1::ForwardedGradientChunk> chunks = ForwardChunks(j, 0, 1, 2);
    std::vector<v1::ForwardedGradientChunk> wrong = chunks;
    for (auto& ch : wrong) ch.set_step(5);
    EXPECT_EQ(Replica(1).Forward(wrong).error_code(), grpc::FAILED_PRECONDITION);
    ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "holds no current copy",
                   [&] { return Replica(1).Forward(chunks); });
    // A primary's own copy takes none.
    ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "is primary here",
                   [&] { return Replica(0).Forward(chunks); });
  }
  // The builder's chunks, unchanged, are a valid forward, and a valid
  // commit then applies it.
  {
    const TestJob j = SyncedJob("fwd-good");
    std::shared_ptr<Job> backup = Copy(1, j.id, 0);
    const std::vector<float> before = Masters(*backup);
    v1::ForwardGradientResponse resp;
    grpc::Status s = Replica(1).Forward(ForwardChunks(j, 0, 1, 2), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.elements(), j.Range(0).size());
    const v1::ReplicaGroupState state = ReplicaStateOf(*backup);
    EXPECT_TRUE(state.prepared());
    EXPECT_TRUE(state.in_sync());
    s = Replica(1).Commit(CommitRequest(j, 0, 1, 2));
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(backup->committed_step(), 2u);
    EXPECT_FALSE(SameBits(Masters(*backup), before));
  }
}

TEST_F(ReplicaTest, BadCommitReplicaChangesNothing) {
  const TestJob j = SyncedJob("commit");
  ReplicaClient& c = Replica(1);
  auto reject = [&](grpc::StatusCode code, const std::string& text,
                    const v1::CommitReplicaRequest& req, bool marks = false) {
    ExpectRejected(
        j.id, code, text, [&] { return c.Commit(req); },
        marks ? std::optional<std::pair<int, uint32_t>>({1, 0}) : std::nullopt);
  };
  // Forward step 2 first: the backup holds it prepared, so a commit would
  // change its state.
  ASSERT_TRUE(c.Forward(ForwardChunks(j, 0, 1, 2)).ok());
  reject(grpc::INVALID_ARGUMENT, "commit.lr: must be finite and >= 0",
         CommitRequest(j, 0, 1, 2, -1.0f));
  reject(grpc::INVALID_ARGUMENT, "commit.lr", CommitRequest(j, 0, 1, 2, std::nanf("")));
  reject(grpc::INVALID_ARGUMENT, "commit.lr",
         CommitRequest(j, 0, 1, 2, std::numeric_limits<float>::infinity()));
  reject(grpc::INVALID_ARGUMENT, "commit.clip_coef: must be in (0, 1]",
         CommitRequest(j, 0, 1, 2, kLr, 1.5f));
  reject(grpc::INVALID_ARGUMENT, "commit.clip_coef", CommitRequest(j, 0, 1, 2, kLr, -0.5f));
  reject(grpc::INVALID_ARGUMENT, "commit.clip_coef", CommitRequest(j, 0, 1, 2, kLr, std::nanf("")));
  reject(grpc::ABORTED, "the sender was replaced", CommitRequest(j, 0, 0, 2));
  reject(grpc::FAILED_PRECONDITION, "cannot drive it", CommitRequest(j, 0, 2, 2));
  // Group 1 on daemon 1 is its primary: a commit forward does not reach it.
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "is primary here",
                 [&] { return c.Commit(CommitRequest(j, 1, 1, 2)); });
  // A step the backup is not at: refused, and the backup waits for a copy.
  reject(grpc::FAILED_PRECONDITION, "is computing step 2, got 3", CommitRequest(j, 0, 1, 3),
         /*marks=*/true);
}

TEST_F(ReplicaTest, BadReleaseReplicaChangesNothing) {
  const TestJob j = SyncedJob("release");
  ReplicaClient& c = Replica(1);
  ExpectRejected(j.id, grpc::ABORTED, "the sender was replaced",
                 [&] { return c.Release(j.id, 0, 0); });
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "cannot drive it",
                 [&] { return c.Release(j.id, 0, 2); });
  // A primary's copy is not released by its peer.
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "is primary here",
                 [&] { return c.Release(j.id, 1, 1); });
  ExpectRejected(j.id, grpc::NOT_FOUND, "not group 4", [&] { return c.Release(j.id, 4, 1); });
  EXPECT_TRUE(daemon(1).jobs().Find(j.id, 0).ok());
  // Promoted at epoch 2, the copy is released by nobody at epoch 1.
  ASSERT_TRUE(Operator(1).Promote(j.id, 0, 2, 1).ok());
  ExpectRejected(j.id, grpc::ABORTED, "the sender was replaced",
                 [&] { return c.Release(j.id, 0, 1); });
  ASSERT_TRUE(daemon(1).jobs().Find(j.id, 0).ok());

  // The right release of group 1's backup on daemon 0 frees its memory.
  const TestJob k = SyncedJob("release2");
  ASSERT_GT(daemon(0).ledger().JobBytes(k.id)[static_cast<int>(MemoryCategory::kReplica)], 0u);
  grpc::Status s = Replica(0).Release(k.id, 1, 1);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_FALSE(daemon(0).jobs().Find(k.id, 1).ok());
  EXPECT_TRUE(daemon(0).jobs().Find(k.id, 0).ok());
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (daemon(0).ledger().JobBytes(k.id)[static_cast<int>(MemoryCategory::kReplica)] != 0 &&
         absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(daemon(0).ledger().JobBytes(k.id)[static_cast<int>(MemoryCategory::kReplica)], 0u);
}

TEST_F(ReplicaTest, MalformedReplicaMetadata) {
  const TestJob j = SyncedJob("meta");
  // Raw metadata on a client that carries the token only.
  auto step_state = [&](std::vector<std::pair<std::string, std::string>> md) {
    return [this, &j, md] {
      grpc::ClientContext ctx;
      SetDeadline(&ctx);
      for (const auto& [k, v] : md) ctx.AddMetadata(k, v);
      v1::GetStepStateRequest req;
      req.set_job_id(j.id);
      v1::StepState state;
      return Plain(0).shard->GetStepState(&ctx, req, &state);
    };
  };
  auto gather = [&](std::vector<std::pair<std::string, std::string>> md) {
    return [this, &j, md] {
      grpc::ClientContext ctx;
      SetDeadline(&ctx);
      for (const auto& [k, v] : md) ctx.AddMetadata(k, v);
      v1::GatherRequest req;
      req.set_job_id(j.id);
      req.set_after_step(1);
      req.mutable_range()->set_begin(j.Range(0).begin);
      req.mutable_range()->set_end(j.Range(0).end);
      req.set_dtype(v1::DTYPE_FP32);
      auto reader = Plain(0).shard->Gather(&ctx, req);
      v1::ParameterChunk chunk;
      while (reader->Read(&chunk)) {
      }
      return reader->Finish();
    };
  };
  const std::string kG = kReplicaGroupMetadataKey;
  const std::string kE = kReplicaEpochMetadataKey;
  const std::vector<std::vector<std::pair<std::string, std::string>>> bad = {
      {{kG, "0"}},
      {{kE, "1"}},
      {{kG, "zero"}, {kE, "1"}},
      {{kG, "0"}, {kE, "one"}},
      {{kG, ""}, {kE, "1"}},
      {{kG, "0"}, {kE, ""}},
      {{kG, "-1"}, {kE, "1"}},
      {{kG, "0"}, {kE, "-1"}},
      {{kG, "4294967296"}, {kE, "1"}},
      {{kG, "0"}, {kE, "18446744073709551616"}},
      {{kG, "0x0"}, {kE, "1"}},
      {{kG, "0"}, {kE, "1.0"}},
  };
  for (const auto& md : bad) {
    SCOPED_TRACE(md.size() > 1 ? md[0].second + "/" + md[1].second : md[0].first);
    ExpectRejected(j.id, grpc::INVALID_ARGUMENT, "go together, as decimal numbers", step_state(md));
    ExpectRejected(j.id, grpc::INVALID_ARGUMENT, "go together, as decimal numbers", gather(md));
  }
  // Well-formed: a group the daemon does not hold, the group it backs up
  // (readable, not served), its own group at the right epoch.
  ExpectRejected(j.id, grpc::NOT_FOUND, "not group 3", step_state({{kG, "3"}, {kE, "1"}}));
  // None: a replicated job's requests say which copy and epoch they expect
  // (reads of the step state need not).
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "is replicated", gather({}));
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "as its backup", gather({{kG, "1"}, {kE, "1"}}));
  EXPECT_TRUE(step_state({{kG, "1"}, {kE, "1"}})().ok());
  EXPECT_TRUE(gather({{kG, "0"}, {kE, "1"}})().ok());
  // The same through the pushes and the step calls of a targeted client.
  const std::vector<std::vector<float>> grads = Grads(j.total(), 2);
  const FlatRange r1 = j.Range(1);
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "as its backup", [&] {
    return Target(0, 1, 1).Push(
        GradientChunks(j.id, 2, 0, j.config.map, r1, grads[0].data() + r1.begin, 333));
  });
  v1::PrepareStepResponse p;
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "as its backup",
                 [&] { return Target(0, 1, 1).Prepare(j.id, 2, &p); });
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "as its backup",
                 [&] { return Target(0, 1, 1).Commit(j.id, 2, kLr); });
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "as its backup",
                 [&] { return Target(0, 1, 1).Join(j.spec, 0, 7); });
  ExpectRejected(j.id, grpc::FAILED_PRECONDITION, "epoch 3",
                 [&] { return Target(0, 0, 3).Prepare(j.id, 2, &p); });
}

// ---- 4. A backup's daemon restarts ----

TEST_F(ReplicaTest, RestartedBackupIsRefilled) {
  const TestJob j = StartJob("restart", 2);
  for (uint64_t step = 1; step <= 2; ++step) {
    for (const v1::PrepareStepResponse& p : RunStep(j, step, {{0, 0, 1}, {1, 1, 1}})) {
      EXPECT_TRUE(p.backup_in_sync());
    }
  }
  // Daemon 1 goes away: group 0 goes on alone, group 1's backup on daemon 0
  // takes over.
  daemons_[1]->Shutdown(absl::Seconds(1));
  daemons_[1].reset();
  for (auto it = targets_.begin(); it != targets_.end();) {
    it = std::get<0>(it->first) == 1 ? targets_.erase(it) : std::next(it);
  }
  replica_clients_.erase(1);
  operator_clients_.erase(1);
  // Its primary gone, the trainers' Promote (the job token) takes effect.
  ASSERT_TRUE(Replica(0).Promote(j.id, 1, 2, 2).ok());
  ASSERT_TRUE(Target(0, 1, 2).JoinAll(j.spec).ok());
  const std::vector<Where> placement = {{0, 0, 1}, {0, 1, 2}};
  for (const v1::PrepareStepResponse& p : RunStep(j, 3, placement)) {
    EXPECT_FALSE(p.backup_in_sync());
  }
  // A new daemon at the same address, without the job: at a following step
  // each primary registers it (as backups) and copies its state there.
  DaemonOptions o;
  o.listen = addresses_[1];
  o.read_lease = absl::ZeroDuration();
  absl::StatusOr<std::unique_ptr<Daemon>> restarted = Daemon::Start(o);
  for (int i = 0; i < 50 && !restarted.ok(); ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    restarted = Daemon::Start(o);
  }
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  daemons_[1] = *std::move(restarted);
  uint64_t step = 4;
  bool in_sync = false;
  for (; step < 12 && !in_sync; ++step) {
    absl::SleepFor(absl::Milliseconds(2100));  // a stale backup is retried after 2 s
    in_sync = true;
    for (const v1::PrepareStepResponse& p : RunStep(j, step, placement)) {
      in_sync = in_sync && p.backup_in_sync();
    }
  }
  ASSERT_TRUE(in_sync) << "the restarted backup was not refilled by step " << step - 1;
  const uint64_t last = step - 1;
  v1::ReplicaState state;
  ASSERT_TRUE(Replica(1).State(j.id, &state).ok());
  for (uint32_t g = 0; g < 2; ++g) {
    const v1::ReplicaGroupState* gs = GroupState(state, g);
    ASSERT_NE(gs, nullptr) << state.ShortDebugString();
    EXPECT_EQ(gs->role(), v1::REPLICA_ROLE_BACKUP);
    EXPECT_TRUE(gs->in_sync());
    EXPECT_EQ(gs->committed_step(), last);
    EXPECT_EQ(gs->epoch(), g == 0 ? 1u : 2u);
    EXPECT_TRUE(SameBits(Masters(*Copy(0, j.id, g)), Masters(*Copy(1, j.id, g)))) << "group " << g;
  }
  // The restarted daemon books both copies as replica.
  EXPECT_EQ(daemon(1).ledger().JobBytes(j.id)[static_cast<int>(MemoryCategory::kReplica)],
            4 * sizeof(float) *
                (j.config.map.DaemonRange(0).size() + j.config.map.DaemonRange(1).size()));
}

// ---- 6. State copies over the bulk transport ----

class BulkReplicaTest : public ReplicaTest {
 protected:
  std::string BulkTransport(int d) const override { return "inproc"; }
};

// The daemon's own link over gRPC, for tests to override a call or two.
class ForwardingLink : public ReplicaLink {
 public:
  absl::Status RegisterBackup(const std::string& peer, const std::string& token,
                              const v1::JobSpec& spec, uint32_t daemon_index,
                              absl::Time deadline) override {
    return inner_.RegisterBackup(peer, token, spec, daemon_index, deadline);
  }
  absl::StatusOr<v1::TransferStateResponse> TransferState(
      const std::string& peer, const std::string& token,
      absl::FunctionRef<bool(v1::ReplicaStateChunk*)> next, absl::Time deadline) override {
    return inner_.TransferState(peer, token, next, deadline);
  }
  absl::Status ForwardGradient(const std::string& peer, const std::string& token,
                               absl::FunctionRef<bool(v1::ForwardedGradientChunk*)> next,
                               absl::Time deadline) override {
    return inner_.ForwardGradient(peer, token, next, deadline);
  }
  absl::Status CommitReplica(const std::string& peer, const std::string& token,
                             const v1::CommitReplicaRequest& request,
                             absl::Time deadline) override {
    return inner_.CommitReplica(peer, token, request, deadline);
  }
  absl::Status ReleaseReplica(const std::string& peer, const std::string& token,
                              const v1::ReleaseReplicaRequest& request,
                              absl::Time deadline) override {
    return inner_.ReleaseReplica(peer, token, request, deadline);
  }
  absl::Status Probe(const std::string& peer, absl::Time deadline) override {
    return inner_.Probe(peer, deadline);
  }
  absl::StatusOr<v1::ReplicaState> GetReplicaState(const std::string& peer,
                                                   const std::string& token,
                                                   const std::string& job_id,
                                                   absl::Time deadline) override {
    return inner_.GetReplicaState(peer, token, job_id, deadline);
  }

 private:
  GrpcReplicaLink inner_{TlsFiles{}, kDefaultLivenessTimeout};
};

// Daemon 0's primaries reach their backups over gRPC, but with `hold` set
// its commits wait at the link until `release` (a backup that stalls while
// it takes a commit).
class HeldCommitLink final : public ForwardingLink {
 public:
  absl::Status CommitReplica(const std::string& peer, const std::string& token,
                             const v1::CommitReplicaRequest& request,
                             absl::Time deadline) override {
    if (hold) {
      if (!held.HasBeenNotified()) held.Notify();
      release.WaitForNotificationWithDeadline(deadline);
    }
    return ForwardingLink::CommitReplica(peer, token, request, deadline);
  }

  std::atomic<bool> hold{false};
  absl::Notification held;     // a commit is waiting at the link
  absl::Notification release;  // let it go
};

class StalledBackupTest : public ReplicaTest {
 protected:
  ReplicaLink* LinkOf(int d) override { return d == 0 ? &link_ : nullptr; }
  HeldCommitLink link_;
};

// A backup that stalls while it takes a commit keeps nothing of its
// primary's waiting but that commit's answer: the primary sends the commit
// after applying it here, with the commit lock released, so a request that
// needs the lock (a state write, a checkpoint) goes on, and the step reads
// as committed. (When the commit held the lock across the call, the write
// waited for the stalled backup.)
TEST_F(StalledBackupTest, StalledBackupCommitStallsNothingElse) {
  const TestJob j = StartJob("stalled-backup", 2);
  RunStep(j, 1, {{0, 0, 1}, {1, 1, 1}});  // both backups in sync
  link_.hold = true;
  // Step 2 of group 0 (primary on daemon 0), prepared with its forward.
  const std::vector<std::vector<float>> grads = Grads(j.total(), 2);
  const FlatRange r = j.Range(0);
  for (uint32_t rank = 0; rank < kWorld; ++rank) {
    ASSERT_TRUE(Target(0, 0, 1)
                    .Push(GradientChunks(j.id, 2, rank, j.config.map, r,
                                         grads[rank].data() + r.begin, 333))
                    .ok());
  }
  v1::PrepareStepResponse prepared;
  ASSERT_TRUE(Target(0, 0, 1).Prepare(j.id, 2, &prepared).ok());
  EXPECT_TRUE(prepared.backup_in_sync());
  grpc::Status committed;
  std::thread leader([&] { committed = Target(0, 0, 1).Commit(j.id, 2, kLr); });
  ASSERT_TRUE(link_.held.WaitForNotificationWithTimeout(absl::Seconds(30)));

  // Meanwhile on the primary: the step is committed, and a state write
  // (of what is held: it takes the commit lock and changes nothing) goes
  // through.
  std::shared_ptr<Job> primary = Copy(0, j.id, 0);
  ASSERT_NE(primary, nullptr);
  EXPECT_EQ(primary->committed_step(), 2u);
  // The first tensor of the group's range (the test's gaps hold values: a
  // write must leave them alone).
  const auto [first, last] = j.config.layout.TensorsIn(r);
  ASSERT_LT(first, last);
  const FlatRange tensor = j.config.layout.tensors()[first].range().Intersect(r);
  std::vector<float> masters;
  ASSERT_TRUE(Target(0, 0, 1).Gather(j.id, 2, tensor, &masters).ok());
  const absl::Time t0 = absl::Now();
  const grpc::Status written = Target(0, 0, 1).WriteState({testing::StateChunk(
      j.id, 0, v1::STATE_ARRAY_MASTER, tensor, masters.data())});
  const absl::Duration took = absl::Now() - t0;
  EXPECT_TRUE(written.ok()) << written.error_message();
  EXPECT_LT(took, absl::Seconds(5)) << "the state write waited for the stalled backup";

  link_.release.Notify();
  leader.join();
  EXPECT_TRUE(committed.ok()) << committed.error_message();
  std::shared_ptr<Job> backup = Copy(1, j.id, 0);
  ASSERT_NE(backup, nullptr);
  EXPECT_EQ(backup->committed_step(), 2u);
}

// The daemon's own link, with the backup's daemon made silent at will:
// while `silent`, every probe answers UNAVAILABLE. Counts the calls that
// reach (or would reach) the backup.
class SilentBackupLink final : public ForwardingLink {
 public:
  absl::Status RegisterBackup(const std::string& peer, const std::string& token,
                              const v1::JobSpec& spec, uint32_t daemon_index,
                              absl::Time deadline) override {
    ++calls;
    return ForwardingLink::RegisterBackup(peer, token, spec, daemon_index, deadline);
  }
  absl::StatusOr<v1::TransferStateResponse> TransferState(
      const std::string& peer, const std::string& token,
      absl::FunctionRef<bool(v1::ReplicaStateChunk*)> next, absl::Time deadline) override {
    ++calls;
    return ForwardingLink::TransferState(peer, token, next, deadline);
  }
  absl::Status ForwardGradient(const std::string& peer, const std::string& token,
                               absl::FunctionRef<bool(v1::ForwardedGradientChunk*)> next,
                               absl::Time deadline) override {
    ++calls;
    return ForwardingLink::ForwardGradient(peer, token, next, deadline);
  }
  absl::Status CommitReplica(const std::string& peer, const std::string& token,
                             const v1::CommitReplicaRequest& request,
                             absl::Time deadline) override {
    ++calls;
    return ForwardingLink::CommitReplica(peer, token, request, deadline);
  }
  absl::Status Probe(const std::string& peer, absl::Time deadline) override {
    if (silent) return absl::UnavailableError("the backup's daemon is silent (test)");
    return ForwardingLink::Probe(peer, deadline);
  }

  std::atomic<bool> silent{false};
  std::atomic<int> calls{0};
};

class SilentBackupTest : public ReplicaTest {
 protected:
  ReplicaLink* LinkOf(int d) override { return d == 0 ? &link_ : nullptr; }
  SilentBackupLink link_;
};

// A primary whose backup's daemon answers no heartbeat for the liveness
// timeout goes on with one copy and calls the backup from no step (no
// prepare waits out a dead peer's deadline); once the daemon answers again
// the next step copies the state and the copies are bit-identical.
TEST_F(SilentBackupTest, NoStepCallsASilentBackupUntilItAnswersAgain) {
  ::testing::internal::CaptureStderr();
  const TestJob j = StartJob("silent-backup", 2);
  for (const v1::PrepareStepResponse& p : RunStep(j, 1, {{0, 0, 1}, {1, 1, 1}})) {
    EXPECT_TRUE(p.backup_in_sync());
  }
  link_.silent = true;
  std::shared_ptr<Job> primary = Copy(0, j.id, 0);
  ASSERT_NE(primary, nullptr);
  // The heartbeats find it silent: the group no longer counts its backup.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (ReplicaStateOf(*primary).in_sync() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_FALSE(ReplicaStateOf(*primary).in_sync()) << "the heartbeats did not find it silent";
  const int calls = link_.calls;
  for (uint64_t step = 2; step <= 3; ++step) {
    const std::vector<v1::PrepareStepResponse> p = RunStep(j, step, {{0, 0, 1}, {1, 1, 1}});
    EXPECT_FALSE(p[0].backup_in_sync()) << step;
  }
  EXPECT_EQ(link_.calls, calls) << "a step called the silent backup";

  link_.silent = false;
  bool in_sync = false;
  for (uint64_t step = 4; step <= 40 && !in_sync; ++step) {
    absl::SleepFor(absl::Milliseconds(100));
    in_sync = RunStep(j, step, {{0, 0, 1}, {1, 1, 1}})[0].backup_in_sync();
  }
  EXPECT_TRUE(in_sync) << "the backup was not brought up to date once its daemon answered";
  EXPECT_TRUE(SameBits(Masters(*Copy(0, j.id, 0)), Masters(*Copy(1, j.id, 0))));
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("has not answered for"), std::string::npos) << log;
  EXPECT_NE(log.find("answers again"), std::string::npos) << log;
  EXPECT_NE(log.find("is current again at step"), std::string::npos) << log;
}

class MixedTransportReplicaTest : public ReplicaTest {
 protected:
  std::string BulkTransport(int d) const override { return d == 0 ? "inproc" : ""; }
};

// Daemon 1 runs no bulk transport: daemon 0's primary offers its arrays,
// is told the backup cannot read them (bulk_refused) and streams them instead.
TEST_F(MixedTransportReplicaTest, BackupWithoutBulkGetsTheStream) {
  ::testing::internal::CaptureStderr();
  const TestJob j = SyncedJob("mixed");
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("to the backup on " + addresses_[1] + " in the stream"), std::string::npos)
      << log;
  EXPECT_NE(log.find("to the backup on " + addresses_[0] + " in the stream"), std::string::npos)
      << log;
  for (uint32_t g = 0; g < 2; ++g) {
    EXPECT_TRUE(SameBits(Masters(*Copy(0, j.id, g)), Masters(*Copy(1, j.id, g)))) << g;
  }
}

// Daemons with the same bulk transport: the backup reads the primary's
// arrays itself, and the copies stay bit-identical through later steps.
TEST_F(BulkReplicaTest, StateCopiedOverTheBulkTransport) {
  ::testing::internal::CaptureStderr();
  const TestJob j = SyncedJob("bulk");
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("to the backup on " + addresses_[1] + " over the bulk transport"),
            std::string::npos)
      << log;
  EXPECT_EQ(log.find("in the stream"), std::string::npos) << log;
  for (uint64_t step = 2; step <= 3; ++step) {
    for (const v1::PrepareStepResponse& p : RunStep(j, step, {{0, 0, 1}, {1, 1, 1}})) {
      EXPECT_TRUE(p.backup_in_sync());
    }
  }
  // Two AdamW updates after the copy: equal masters need equal moments too.
  for (uint32_t g = 0; g < 2; ++g) {
    EXPECT_TRUE(SameBits(Masters(*Copy(0, j.id, g)), Masters(*Copy(1, j.id, g)))) << g;
  }
}

// The moment arrays are shorter than the masters (no moments for frozen
// tensors): the backup reads each at its own length.
TEST_F(BulkReplicaTest, StateTransferCarriesFrozenTensorsAndLaggingCounts) {
  ::testing::internal::CaptureStderr();
  StateTransferWithFrozenTensorsAndLaggingCounts("bulk-frozen");
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(log.find("in the stream"), std::string::npos) << log;
}

// A bulk transfer from a source this test serves itself (its own inproc
// transport), bad in every field the backup checks: refused, nothing
// changed; then the good one is taken.
TEST_F(BulkReplicaTest, BadBulkTransferChangesNothing) {
  const TestJob j = SyncedJob("bulk-bad");
  ReplicaClient& c = Replica(1);  // holds the backup of group 0
  const uint64_t n = j.Range(0).size();
  absl::StatusOr<std::unique_ptr<transport::Transport>> source =
      transport::CreateTransport("inproc");
  ASSERT_TRUE(source.ok()) << source.status();
  absl::StatusOr<std::unique_ptr<transport::Region>> region =
      (*source)->AllocateRegion(3 * n * sizeof(float), transport::Access::kRemoteRead);
  ASSERT_TRUE(region.ok()) << region.status();
  std::mt19937 rng(11);
  float* arrays = static_cast<float*>((*region)->base());
  for (uint64_t i = 0; i < 3 * n; ++i) arrays[i] = std::abs(RandomVector(rng, 1, 0.1f)[0]);
  v1::ReplicaStateChunk good;
  good.set_job_id(j.id);
  good.set_group(0);
  good.set_epoch(1);
  good.mutable_state()->set_committed_step(1);
  good.mutable_state()->set_loss_scale(1.0f);
  good.mutable_state()->set_optimizer_steps(1);
  v1::BulkStateSource* bulk = good.mutable_bulk();
  bulk->set_transport(v1::TRANSPORT_KIND_INPROC);
  bulk->set_worker_address((*source)->LocalAddress());
  const transport::RegionDescriptor& d = (*region)->Descriptor();
  for (uint64_t a = 0; a < 3; ++a) {
    v1::BulkStateArray* array = bulk->add_arrays();
    array->set_address(d.address + a * n * sizeof(float));
    array->set_length(n * sizeof(float));
    array->set_rkey(d.rkey);
    array->add_crc32c(Crc32c(arrays + a * n, n * sizeof(float)));  // n < 1 Mi: one piece
  }
  ASSERT_LT(n, uint64_t{1} << 20);
  auto reject = [&](grpc::StatusCode code, const std::string& text,
                    const std::vector<v1::ReplicaStateChunk>& chunks) {
    ExpectRejected(j.id, code, text, [&] { return c.Transfer(chunks); });
  };
  // The backup cannot read the source: it answers OK with the reason in
  // bulk_refused and takes nothing (the primary then streams).
  auto refused = [&](const std::string& text, const std::vector<v1::ReplicaStateChunk>& chunks) {
    ExpectRejected(j.id, grpc::OK, "", [&] {
      v1::TransferStateResponse resp;
      const grpc::Status s = c.Transfer(chunks, &resp);
      EXPECT_NE(resp.bulk_refused().find(text), std::string::npos) << resp.bulk_refused();
      EXPECT_EQ(resp.bytes(), 0u);
      return s;
    });
  };
  auto with = [&](const std::function<void(v1::ReplicaStateChunk&)>& f) {
    v1::ReplicaStateChunk chunk = good;
    f(chunk);
    return std::vector<v1::ReplicaStateChunk>{chunk};
  };
  refused("this daemon's bulk transport is inproc, the primary's ucx",
          with([](auto& ch) { ch.mutable_bulk()->set_transport(v1::TRANSPORT_KIND_UCX); }));
  reject(grpc::INVALID_ARGUMENT, "bulk.arrays: this job's state has 3 arrays, got 2",
         with([](auto& ch) { ch.mutable_bulk()->mutable_arrays()->RemoveLast(); }));
  reject(grpc::INVALID_ARGUMENT, "bulk.arrays[1]: ", with([](auto& ch) {
           auto* a = ch.mutable_bulk()->mutable_arrays(1);
           a->set_length(a->length() + 4);
         }));
  reject(grpc::INVALID_ARGUMENT, "bulk.arrays[2]: ", with([](auto& ch) {
           ch.mutable_bulk()->mutable_arrays(2)->add_crc32c(0);
         }));
  reject(grpc::DATA_LOSS, "bulk.arrays[0] piece 0: CRC-32C", with([](auto& ch) {
           auto* a = ch.mutable_bulk()->mutable_arrays(0);
           a->set_crc32c(0, a->crc32c(0) ^ 1);
         }));
  // Bytes past the source's region: the read itself fails.
  {
    std::vector<v1::ReplicaStateChunk> chunks = with([&](auto& ch) {
      ch.mutable_bulk()->mutable_arrays(2)->set_address(d.address + 3 * n * sizeof(float) - 4);
    });
    grpc::Status s = c.Transfer(chunks);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.error_message().find("reading the primary's state"), std::string::npos)
        << s.error_message();
  }
  reject(grpc::INVALID_ARGUMENT, "",
         with([](auto& ch) { ch.mutable_bulk()->set_worker_address("not an address"); }));
  // A source that is gone: the backup cannot reach it, so the primary is
  // told to stream.
  {
    absl::StatusOr<std::unique_ptr<transport::Transport>> gone =
        transport::CreateTransport("inproc");
    ASSERT_TRUE(gone.ok()) << gone.status();
    const std::string address = (*gone)->LocalAddress();
    gone->reset();
    refused("cannot reach the primary's bulk transport",
            with([&](auto& ch) { ch.mutable_bulk()->set_worker_address(address); }));
  }
  reject(grpc::INVALID_ARGUMENT, "a bulk transfer's chunk carries no data",
         with([](auto& ch) { ch.set_data("1234"); }));
  {
    std::vector<v1::ReplicaStateChunk> chunks = {good, good};
    reject(grpc::INVALID_ARGUMENT, "carries one chunk, got more", chunks);
  }
  reject(grpc::INVALID_ARGUMENT, "state: the first chunk",
         with([](auto& ch) { ch.clear_state(); }));

  // Unchanged, the chunk is a valid transfer: the backup takes the arrays.
  v1::TransferStateResponse resp;
  grpc::Status s = c.Transfer({good}, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.bytes(), 3 * n * sizeof(float));
  const std::vector<float> sent(arrays, arrays + n);
  EXPECT_TRUE(SameBits(Masters(*Copy(1, j.id, 0)), sent));
}

}  // namespace
}  // namespace zeroshard
