// The attacks a stranger on the daemon's network can try, one test each:
// every one is refused with a code a person can act on, and the job's state
// and the daemon's ledger stay as they were. Also the mutual-TLS handshakes
// (good certificate, none, another CA, expired, plaintext) with a PKI that
// openssl makes inside the test.

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/daemon_control.h"
#include "common/channel.h"
#include "common/checkpoint_files.h"
#include "common/protocol.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/zeroshard/v1/replica.grpc.pb.h"
#include "server/daemon.h"
#include "common/testing/test_pki.h"
#include "server/testing/activation_testing.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

using testing::DaemonClient;
using testing::ExpectRejected;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::kTestIncarnation;
using testing::kTestToken;
using testing::MakeSpec;
using testing::SampleLayout;

constexpr char kStrangerToken[] = "a-stranger-guessing-tokens";
constexpr char kAdminToken[] = "the-admin-token-of-this-daemon";

void SetDeadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
}

std::unique_ptr<Daemon> Start(DaemonOptions o) {
  o.listen = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

// A daemon with a live job (registered with kTestToken, every rank joined,
// parameters initialised) and clients with no token, a wrong one, and the
// admin token.
class SecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DaemonOptions o;
    o.admin_token = kAdminToken;
    o.memory_limit_bytes = 64 << 20;
    daemon_ = Start(o);
    ASSERT_NE(daemon_, nullptr);
    owner_ = std::make_unique<DaemonClient>(daemon_->address());
    anonymous_ = std::make_unique<DaemonClient>(daemon_->address(), "");
    stranger_ = std::make_unique<DaemonClient>(daemon_->address(), kStrangerToken);
    admin_ = std::make_unique<DaemonClient>(daemon_->address(), kAdminToken);
    spec_ = MakeSpec(kJob, SampleLayout(), 2, 1, {daemon_->address()});
    ASSERT_TRUE(owner_->Register(spec_, 0).ok());
    ASSERT_TRUE(owner_->JoinAll(spec_).ok());
    const uint64_t n = SampleLayout().total_elements();
    std::vector<float> params(n, 0.5f);
    ASSERT_TRUE(owner_->Init(testing::ParamChunks(kJob, {0, n}, params.data())).ok());
  }

  // `call(client)` from a client without a token and from one with a wrong
  // token: UNAUTHENTICATED, then PERMISSION_DENIED, nothing changed.
  void ExpectStrangersRefused(const std::function<grpc::Status(DaemonClient&)>& call) {
    ExpectRejected(*daemon_, kJob, grpc::StatusCode::UNAUTHENTICATED, "needs a token",
                   [&] { return call(*anonymous_); });
    ExpectRejected(*daemon_, kJob, grpc::StatusCode::PERMISSION_DENIED, "does not open job",
                   [&] { return call(*stranger_); });
  }
  // The same for a client stream, refused before its first message: the
  // stranger's token opens no job here (NOT_FOUND).
  void ExpectStrangerStreamsRefused(const std::function<grpc::Status(DaemonClient&)>& call) {
    ExpectRejected(*daemon_, kJob, grpc::StatusCode::UNAUTHENTICATED, "needs a token",
                   [&] { return call(*anonymous_); });
    ExpectRejected(*daemon_, kJob, grpc::StatusCode::NOT_FOUND,
                   "opens with the token presented; nothing was read",
                   [&] { return call(*stranger_); });
  }

  static constexpr char kJob[] = "victim";
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<DaemonClient> owner_, anonymous_, stranger_, admin_;
  v1::JobSpec spec_;
};

TEST_F(SecurityTest, StrangerCannotReadMasterWeights) {
  ExpectStrangersRefused([](DaemonClient& c) {
    std::vector<float> out;
    return c.Gather(kJob, 0, {0, 10}, &out, 100);
  });
  std::vector<float> out;
  EXPECT_TRUE(owner_->Gather(kJob, 0, {0, 10}, &out, 100).ok());
  EXPECT_TRUE(admin_->Gather(kJob, 0, {0, 10}, &out, 100).ok());
}

TEST_F(SecurityTest, StrangerCannotPushGradients) {
  const PartitionMap map = *PartitionMap::Create(SampleLayout().total_elements(), 1, 1);
  std::vector<float> grad(100, 1.0f);
  ExpectStrangerStreamsRefused([&](DaemonClient& c) {
    return c.Push(testing::GradientChunks(kJob, 1, 0, map, {0, 100}, grad.data(), 64));
  });
}

TEST_F(SecurityTest, StrangerCannotLeaveCommitOrReadState) {
  ExpectStrangersRefused([](DaemonClient& c) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::LeaveRequest req;
    req.set_job_id(kJob);
    req.set_rank(0);
    req.set_incarnation(kTestIncarnation);
    v1::LeaveResponse resp;
    return c.control->Leave(&ctx, req, &resp);
  });
  ExpectStrangersRefused([](DaemonClient& c) { return c.Commit(kJob, 1, 1.0f, 1.0f, true); });
  ExpectStrangersRefused([](DaemonClient& c) { return c.Commit(kJob, 1, 1e9f); });
  ExpectStrangersRefused([](DaemonClient& c) {
    v1::StepState state;
    return c.StepState(kJob, &state);
  });
  ExpectStrangersRefused([](DaemonClient& c) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::SaveCheckpointRequest req;
    req.set_job_id(kJob);
    req.set_name("stolen");
    v1::SaveCheckpointResponse resp;
    return c.checkpoint->SaveCheckpoint(&ctx, req, &resp);
  });
  // The job is still there.
  ASSERT_TRUE(daemon_->jobs().Find(kJob).ok());
}

TEST_F(SecurityTest, StrangerCannotReadOrWriteState) {
  const uint64_t n = SampleLayout().total_elements();
  auto read = [n](DaemonClient& c, std::vector<float>* out) {
    return c.ReadState(kJob, 0, v1::STATE_ARRAY_MASTER, {0, n}, out);
  };
  // A valid write (the first tensor's masters and update count), so that
  // only the token can stop it.
  const FlatRange first = SampleLayout().tensors()[0].range();
  const std::vector<float> values(first.size(), 7.0f);
  std::vector<v1::StateChunk> write = {
      testing::StateChunk(kJob, 0, v1::STATE_ARRAY_MASTER, first, values.data())};
  v1::TensorStep* steps = write[0].add_tensor_steps();
  steps->set_tensor(0);
  steps->set_steps(9);
  ExpectStrangersRefused([&](DaemonClient& c) {
    std::vector<float> out;
    const grpc::Status s = read(c, &out);
    EXPECT_THAT(out, ::testing::IsEmpty());
    return s;
  });
  ExpectStrangerStreamsRefused([&](DaemonClient& c) {
    v1::WriteStateResponse resp;
    const grpc::Status s = c.WriteState(write, &resp);
    EXPECT_EQ(resp.elements(), 0u);
    return s;
  });
  // Nor with the token of another job on the same daemon.
  DaemonClient other(daemon_->address(), "another-jobs-token-123");
  ASSERT_TRUE(
      other.Register(MakeSpec("other", SampleLayout(), 2, 1, {daemon_->address()}), 0).ok());
  ExpectRejected(*daemon_, kJob, grpc::StatusCode::PERMISSION_DENIED, "does not open job", [&] {
    std::vector<float> out;
    const grpc::Status s = read(other, &out);
    EXPECT_THAT(out, ::testing::IsEmpty());
    return s;
  });
  ExpectRejected(*daemon_, kJob, grpc::StatusCode::PERMISSION_DENIED, "does not open job",
                 [&] { return other.WriteState(write); });
  // The job's token and the admin's read and write it.
  std::vector<float> out;
  for (DaemonClient* c : {owner_.get(), admin_.get()}) {
    EXPECT_TRUE(read(*c, &out).ok());
    ASSERT_EQ(out.size(), n);
    EXPECT_EQ(out[0], 0.5f);
  }
  const uint64_t hash_before = (*daemon_->jobs().Find(kJob))->StateHash();
  v1::WriteStateResponse resp;
  const grpc::Status s = owner_->WriteState(write, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.elements(), first.size());
  EXPECT_NE((*daemon_->jobs().Find(kJob))->StateHash(), hash_before);
  // The same values again: let in, and nothing left to change.
  const grpc::Status again = admin_->WriteState(write, &resp);
  EXPECT_TRUE(again.ok()) << again.error_message();
  EXPECT_EQ(resp.elements(), 0u);
}

TEST_F(SecurityTest, StrangerCannotTakeOverTheJobByRegisteringIt) {
  ExpectRejected(*daemon_, kJob, grpc::StatusCode::PERMISSION_DENIED, "another token",
                 [&] { return stranger_->Register(spec_, 0); });
  ExpectRejected(*daemon_, kJob, grpc::StatusCode::UNAUTHENTICATED, "needs a token",
                 [&] { return anonymous_->Register(spec_, 0); });
  ExpectRejected(*daemon_, kJob, grpc::StatusCode::PERMISSION_DENIED, "does not open job",
                 [&] { return stranger_->Join(spec_, 0, kTestIncarnation + 1); });
  EXPECT_TRUE(owner_->Register(spec_, 0).ok());  // idempotent for its owner
}

TEST_F(SecurityTest, OnlyTheAdminDrains) {
  auto drain = [](DaemonClient& c) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::DrainResponse resp;
    return c.control->Drain(&ctx, v1::DrainRequest(), &resp);
  };
  ExpectRejected(*daemon_, kJob, grpc::StatusCode::UNAUTHENTICATED, "needs a token",
                 [&] { return drain(*anonymous_); });
  ExpectRejected(*daemon_, kJob, grpc::StatusCode::PERMISSION_DENIED, "admin token",
                 [&] { return drain(*stranger_); });
  ExpectRejected(*daemon_, kJob, grpc::StatusCode::PERMISSION_DENIED, "admin token",
                 [&] { return drain(*owner_); });
  // Still takes new jobs.
  DaemonClient other(daemon_->address(), "another-jobs-token-123");
  EXPECT_TRUE(
      other.Register(MakeSpec("other", SampleLayout(), 2, 1, {daemon_->address()}), 0).ok());
  EXPECT_TRUE(drain(*admin_).ok());
}

TEST_F(SecurityTest, StatusAndMemoryShowOnlyTheJobsATokenOpens) {
  DaemonClient other(daemon_->address(), "another-jobs-token-123");
  ASSERT_TRUE(
      other.Register(MakeSpec("other", SampleLayout(), 2, 1, {daemon_->address()}), 0).ok());
  auto jobs_seen = [](DaemonClient& c) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::StatusResponse status;
    EXPECT_TRUE(c.admin->Status(&ctx, v1::StatusRequest(), &status).ok());
    grpc::ClientContext ctx2;
    SetDeadline(&ctx2);
    v1::MemoryReportResponse memory;
    EXPECT_TRUE(c.admin->MemoryReport(&ctx2, v1::MemoryReportRequest(), &memory).ok());
    EXPECT_EQ(status.jobs_size(), memory.jobs_size());
    std::vector<std::string> ids;
    for (const auto& j : status.jobs()) ids.push_back(j.job_id());
    std::sort(ids.begin(), ids.end());
    return ids;
  };
  EXPECT_THAT(jobs_seen(*anonymous_), ::testing::IsEmpty());
  EXPECT_THAT(jobs_seen(*stranger_), ::testing::IsEmpty());
  EXPECT_THAT(jobs_seen(*owner_), ::testing::ElementsAre("victim"));
  EXPECT_THAT(jobs_seen(other), ::testing::ElementsAre("other"));
  EXPECT_THAT(jobs_seen(*admin_), ::testing::ElementsAre("other", "victim"));
  // A named job the token does not open is refused, not shown.
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::MemoryReportRequest req;
  req.set_job_id(kJob);
  v1::MemoryReportResponse resp;
  EXPECT_EQ(stranger_->admin->MemoryReport(&ctx, req, &resp).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
}

TEST_F(SecurityTest, CheckpointFilesNeedTheJobsTokenOrTheAdmin) {
  auto list = [](DaemonClient& c, const std::string& job) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::ListCheckpointsRequest req;
    req.set_job_id(job);
    v1::ListCheckpointsResponse resp;
    return c.checkpoint->ListCheckpoints(&ctx, req, &resp).error_code();
  };
  EXPECT_EQ(list(*stranger_, kJob), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(list(*anonymous_, kJob), grpc::StatusCode::UNAUTHENTICATED);
  // A job not registered here, with no checkpoints saved: only the admin
  // may look.
  EXPECT_EQ(list(*owner_, "gone"), grpc::StatusCode::PERMISSION_DENIED);
  // Authorised, then refused for another reason: this daemon keeps no
  // checkpoints.
  EXPECT_EQ(list(*owner_, kJob), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(list(*admin_, "gone"), grpc::StatusCode::FAILED_PRECONDITION);
}

TEST_F(SecurityTest, EmptyChunkFloodIsBoundedAndBooked) {
  const uint64_t ledger_before = daemon_->ledger().total();
  const uint64_t hash_before = (*daemon_->jobs().Find(kJob))->StateHash();
  grpc::ClientContext ctx;
  // Hundreds of thousands of messages before the bound: seconds under ASan
  // on a busy machine.
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  v1::InitParametersResponse resp;
  auto writer = owner_->shard->InitParameters(&ctx, &resp);
  v1::ParameterChunk chunk;
  chunk.set_job_id(kJob);
  int written = 0;
  for (; written < 2'000'000 && writer->Write(chunk); ++written) {
  }
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  // Refused by the stream's bound or the daemon's limit, whichever is lower.
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_LT(written, 2'000'000) << "the daemon kept reading an endless stream";
  EXPECT_EQ(daemon_->ledger().total(), ledger_before);
  EXPECT_EQ((*daemon_->jobs().Find(kJob))->StateHash(), hash_before);
}

TEST(SecurityLimitsTest, JobsPerDaemonAreBounded) {
  DaemonOptions o;
  o.max_jobs = 2;
  std::unique_ptr<Daemon> daemon = Start(o);
  ASSERT_NE(daemon, nullptr);
  DaemonClient c(daemon->address());
  for (const char* job : {"a", "b"}) {
    ASSERT_TRUE(c.Register(MakeSpec(job, SampleLayout(), 2, 1, {daemon->address()}), 0).ok());
  }
  const uint64_t ledger_before = daemon->ledger().total();
  const grpc::Status s = c.Register(MakeSpec("c", SampleLayout(), 2, 1, {daemon->address()}), 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("--max_jobs"));
  EXPECT_EQ(daemon->ledger().total(), ledger_before);
  EXPECT_EQ(daemon->jobs().size(), 2u);
}

// With --registration_token_file a new job needs the registration token
// (sent by the client's DaemonControl as ClientConfig.registration_token
// is) or the admin token; a rank of a registered job needs its job token
// alone. A refused registration creates and books nothing.
TEST(SecurityLimitsTest, NewJobsNeedTheRegistrationToken) {
  constexpr char kRegistration[] = "the-deployments-registration-secret";
  DaemonOptions o;
  o.registration_token = kRegistration;
  o.admin_token = kAdminToken;
  std::unique_ptr<Daemon> daemon = Start(o);
  ASSERT_NE(daemon, nullptr);
  DaemonClient c(daemon->address());
  const v1::JobSpec spec = MakeSpec("a", SampleLayout(), 2, 1, {daemon->address()});
  const uint64_t ledger_before = daemon->ledger().total();
  grpc::Status s = c.Register(spec, 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("ZS_REGISTRATION_TOKEN"));
  DaemonControl control(daemon->address(), c.channel);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<v1::RegisterJobResponse> r =
      control.RegisterJob(spec, 0, false, deadline, "not-the-registration-secret");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << r.status();
  EXPECT_EQ(daemon->jobs().size(), 0u);
  EXPECT_EQ(daemon->ledger().total(), ledger_before);

  r = control.RegisterJob(spec, 0, false, deadline, kRegistration);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->created());
  EXPECT_TRUE(c.Register(spec, 0).ok()) << "a rank of the registered job needs its token alone";
  DaemonClient admin(daemon->address(), kAdminToken);
  EXPECT_TRUE(admin.Register(MakeSpec("b", SampleLayout(), 2, 1, {daemon->address()}), 0).ok());
  EXPECT_EQ(daemon->jobs().size(), 2u);
}

TEST(SecurityLimitsTest, PlaintextOnTheNetworkNeedsInsecure) {
  DaemonOptions o;
  o.listen = "0.0.0.0:0";
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(d.status().message(), HasSubstr("--insecure"));
  o.insecure = true;
  d = Daemon::Start(o);
  EXPECT_TRUE(d.ok()) << d.status();
}

// A plaintext daemon has no certificates to ask: tokens alone guard the
// Replica calls, as every other call.
TEST(SecurityLimitsTest, PlaintextDaemonDemandsNoRole) {
  std::unique_ptr<Daemon> daemon = Start(DaemonOptions());
  ASSERT_NE(daemon, nullptr);
  DaemonClient c(daemon->address());
  auto replica = v1::Replica::NewStub(c.channel);
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::CommitReplicaRequest req;
  req.set_job_id("unknown-job");
  v1::CommitStepResponse resp;
  const grpc::Status s = replica->CommitReplica(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
}

// Over tcp UCX serves any address a key names from its progress thread: an
// untrusting daemon does not start UCX there at all (no listener, no keys)
// and says why; trainers use the streaming RPCs.
TEST(SecurityLimitsTest, NoUcxOverSoftwareRemoteAccess) {
  for (const bool trusted : {false, true}) {
    DaemonOptions o;
    o.bulk_transport = "ucx";
    o.ucx_tls = "tcp";
    o.ucx_trust_peers = trusted;
    std::unique_ptr<Daemon> daemon = Start(o);
    ASSERT_NE(daemon, nullptr);
    if (trusted && daemon->bulk_transport() == nullptr) {
      GTEST_SKIP() << "UCX over tcp does not initialise here";
    }
    EXPECT_EQ(daemon->bulk_transport() == nullptr, !trusted);
    DaemonClient c(daemon->address());
    const v1::JobSpec spec = MakeSpec("ucx", SampleLayout(), 2, 1, {daemon->address()});
    ASSERT_TRUE(c.Register(spec, 0).ok());
    ASSERT_TRUE(c.JoinAll(spec).ok());
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::ExchangeEndpointRequest req;
    req.set_job_id("ucx");
    req.set_rank(0);
    req.set_incarnation(kTestIncarnation);
    req.set_transport(v1::TRANSPORT_KIND_UCX);
    v1::ExchangeEndpointResponse resp;
    const grpc::Status s = c.shard->ExchangeEndpoint(&ctx, req, &resp);
    if (trusted) {
      EXPECT_TRUE(s.ok()) << s.error_message();
      EXPECT_GT(resp.regions_size(), 0);
    } else {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
      EXPECT_THAT(s.error_message(), HasSubstr("--ucx_trust_peers"));
      EXPECT_EQ(resp.regions_size(), 0);
    }
  }
}

// Which UCX_TLS values count as enforcing keys: only lists of shared-memory
// transports; anything that may select tcp does not, nor RDMA (UCX also
// serves keyless put and get messages there). Refused before UCX starts,
// so no RDMA device is needed.
TEST(SecurityLimitsTest, UcxStartsOnlyWhereKeysAreEnforced) {
  for (const char* tls : {"", "tcp", "^tcp", "posix,tcp", "all", "rc_x,sm,self", "ib"}) {
    DaemonOptions o;
    o.bulk_transport = "ucx";
    o.ucx_tls = tls;
    std::unique_ptr<Daemon> daemon = Start(o);
    ASSERT_NE(daemon, nullptr);
    EXPECT_EQ(daemon->bulk_transport(), nullptr) << "--ucx_tls=" << tls;
  }
  DaemonOptions o;
  o.bulk_transport = "ucx";
  o.ucx_tls = "posix,cma,self";
  std::unique_ptr<Daemon> daemon = Start(o);
  ASSERT_NE(daemon, nullptr);
  if (daemon->bulk_transport() == nullptr) GTEST_SKIP() << "UCX over shared memory unavailable";
}

// Keys go only to joined ranks of the job, with the job's token.
TEST(SecurityLimitsTest, EndpointsOnlyForJoinedRanks) {
  DaemonOptions o;
  o.bulk_transport = "inproc";
  std::unique_ptr<Daemon> daemon = Start(o);
  ASSERT_NE(daemon, nullptr);
  DaemonClient c(daemon->address());
  const v1::JobSpec spec = MakeSpec("keys", SampleLayout(), 2, 2, {daemon->address()});
  ASSERT_TRUE(c.Register(spec, 0).ok());
  ASSERT_TRUE(c.Join(spec, 0).ok());
  auto exchange = [&](DaemonClient& client, uint32_t rank) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::ExchangeEndpointRequest req;
    req.set_job_id("keys");
    req.set_rank(rank);
    req.set_incarnation(kTestIncarnation);
    req.set_transport(v1::TRANSPORT_KIND_INPROC);
    v1::ExchangeEndpointResponse resp;
    grpc::Status s = client.shard->ExchangeEndpoint(&ctx, req, &resp);
    // Keys with an answer that lets in, none with a refusal.
    if (s.ok()) {
      EXPECT_GT(resp.regions_size(), 0);
    } else {
      EXPECT_EQ(resp.regions_size(), 0) << s.error_message();
    }
    return s;
  };
  DaemonClient stranger(daemon->address(), kStrangerToken);
  DaemonClient anonymous(daemon->address(), "");
  grpc::Status s = exchange(stranger, 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("does not open job"));
  s = exchange(anonymous, 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  // The job's token, for a rank that has not joined: the caller's mistake.
  s = exchange(c, 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("rank 1 of job keys has not joined"));
  s = exchange(c, 0);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// One arena key reaches every job's slices: it is lent to one job at a
// time, and other jobs keep no activations there meanwhile.
TEST(SecurityLimitsTest, ActivationArenaKeyIsLentToOneJobAtATime) {
  DaemonOptions o;
  o.bulk_transport = "inproc";
  o.activation_arena_bytes = 1 << 20;
  o.read_lease = absl::ZeroDuration();
  std::unique_ptr<Daemon> daemon = Start(o);
  ASSERT_NE(daemon, nullptr);
  auto exchange = [&](DaemonClient& c, const std::string& job) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::ExchangeEndpointRequest req;
    req.set_job_id(job);
    req.set_rank(0);
    req.set_incarnation(kTestIncarnation);
    req.set_transport(v1::TRANSPORT_KIND_INPROC);
    v1::ExchangeEndpointResponse resp;
    EXPECT_TRUE(c.shard->ExchangeEndpoint(&ctx, req, &resp).ok());
    for (const v1::RemoteRegion& r : resp.regions()) {
      if (r.purpose() == v1::REGION_PURPOSE_ACTIVATION_ARENA) return true;
    }
    return false;
  };
  DaemonClient a(daemon->address(), "token-of-job-a-0123");
  DaemonClient b(daemon->address(), "token-of-job-b-0123");
  const v1::JobSpec spec_a = MakeSpec("a", SampleLayout(), 3, 1, {daemon->address()});
  const v1::JobSpec spec_b = MakeSpec("b", SampleLayout(), 3, 1, {daemon->address()});
  ASSERT_TRUE(a.Register(spec_a, 0).ok() && a.JoinAll(spec_a).ok());
  ASSERT_TRUE(b.Register(spec_b, 0).ok() && b.JoinAll(spec_b).ok());
  EXPECT_TRUE(exchange(a, "a"));
  EXPECT_TRUE(exchange(a, "a"));  // still a's
  EXPECT_FALSE(exchange(b, "b"));
  // b cannot put slices where a's key reaches, by any path.
  testing::ActivationClient activations_b(daemon->address(), "token-of-job-b-0123");
  const grpc::Status s = activations_b.Offload(testing::MakeOwner("b", 0),
                                               testing::MakeKey(1, 0), std::string(4096, 'x'));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("lent to job a"));
  EXPECT_EQ(daemon->ledger().JobBytes("b")[static_cast<int>(MemoryCategory::kActivation)], 0u);
  // a's job ends: the key is free, and b may take it.
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::LeaveRequest leave;
  leave.set_job_id("a");
  leave.set_rank(0);
  leave.set_incarnation(kTestIncarnation);
  v1::LeaveResponse left;
  ASSERT_TRUE(a.control->Leave(&ctx, leave, &left).ok());
  EXPECT_TRUE(exchange(b, "b"));
}

// Checkpoint files belong to the token of the job that saved them: a job
// of the same id registered later with another token neither reads nor
// replaces them; the owner's token (or the admin's) still opens them.
TEST(SecurityLimitsTest, CheckpointFilesBelongToTheirJobsToken) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/security_checkpoints");
  std::filesystem::remove_all(dir);
  DaemonOptions o;
  o.checkpoint_dir = dir;
  o.admin_token = kAdminToken;
  o.read_lease = absl::ZeroDuration();
  std::unique_ptr<Daemon> daemon = Start(o);
  ASSERT_NE(daemon, nullptr);
  DaemonClient owner(daemon->address());
  DaemonClient stranger(daemon->address(), kStrangerToken);
  DaemonClient admin(daemon->address(), kAdminToken);
  const v1::JobSpec spec = MakeSpec("saved", SampleLayout(), 2, 1, {daemon->address()});
  ASSERT_TRUE(owner.Register(spec, 0).ok() && owner.JoinAll(spec).ok());
  const uint64_t n = SampleLayout().total_elements();
  std::vector<float> params(n, 0.25f);
  ASSERT_TRUE(owner.Init(testing::ParamChunks("saved", {0, n}, params.data())).ok());
  {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::SaveCheckpointRequest req;
    req.set_job_id("saved");
    req.set_name("first");
    req.set_step(0);
    v1::SaveCheckpointResponse resp;
    const grpc::Status s = owner.checkpoint->SaveCheckpoint(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::LeaveRequest leave;
    leave.set_job_id("saved");
    leave.set_rank(0);
    leave.set_incarnation(kTestIncarnation);
    v1::LeaveResponse left;
    ASSERT_TRUE(owner.control->Leave(&ctx, leave, &left).ok());
    ASSERT_TRUE(left.job_removed());
  }
  auto list = [](DaemonClient& c) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::ListCheckpointsRequest req;
    req.set_job_id("saved");
    v1::ListCheckpointsResponse resp;
    return c.checkpoint->ListCheckpoints(&ctx, req, &resp).error_code();
  };
  const grpc::Status taken = stranger.Register(spec, 0);
  EXPECT_EQ(taken.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(taken.error_message(), HasSubstr("another job token"));
  EXPECT_EQ(daemon->jobs().size(), 0u);
  EXPECT_EQ(list(stranger), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(list(owner), grpc::StatusCode::OK);  // the job is gone; its token still opens them
  EXPECT_EQ(list(admin), grpc::StatusCode::OK);
  EXPECT_TRUE(owner.Register(spec, 0).ok());  // the owner resumes
}

// The checkpoints of one identity's jobs take at most
// --max_checkpoint_bytes_per_identity of the daemon's disk: a save past it
// is refused with nothing written, whichever of the identity's jobs saves;
// the admin's jobs are exempt.
TEST(SecurityLimitsTest, CheckpointBytesPerIdentityAreBounded) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/quota_checkpoints");
  std::filesystem::remove_all(dir);
  const uint64_t n = SampleLayout().total_elements();
  const uint64_t one = n * sizeof(float) * 3;  // master, exp_avg, exp_avg_sq
  DaemonOptions o;
  o.checkpoint_dir = dir;
  o.admin_token = kAdminToken;
  o.max_checkpoint_bytes_per_identity = one * 5 / 2;
  std::unique_ptr<Daemon> daemon = Start(o);
  ASSERT_NE(daemon, nullptr);
  DaemonClient user(daemon->address());
  DaemonClient admin(daemon->address(), kAdminToken);
  std::vector<float> params(n, 0.25f);
  auto start = [&](DaemonClient& c, const std::string& job) {
    const v1::JobSpec spec = MakeSpec(job, SampleLayout(), 2, 1, {daemon->address()});
    ASSERT_TRUE(c.Register(spec, 0).ok() && c.JoinAll(spec).ok());
    ASSERT_TRUE(c.Init(testing::ParamChunks(job, {0, n}, params.data())).ok());
  };
  // Saves and waits until the part is written.
  auto save = [&](DaemonClient& c, const std::string& job, const std::string& name) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::SaveCheckpointRequest req;
    req.set_job_id(job);
    req.set_name(name);
    v1::SaveCheckpointResponse resp;
    grpc::Status s = c.checkpoint->SaveCheckpoint(&ctx, req, &resp);
    if (!s.ok()) return s;
    grpc::ClientContext wait_ctx;
    SetDeadline(&wait_ctx);
    v1::GetCheckpointStatusRequest wait;
    wait.set_job_id(job);
    wait.set_name(name);
    wait.set_wait_ms(4000);
    v1::CheckpointStatus status;
    s = c.checkpoint->GetCheckpointStatus(&wait_ctx, wait, &status);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(status.state(), v1::CheckpointStatus::STATE_WRITTEN) << status.error();
    return s;
  };
  start(user, "q1");
  ASSERT_TRUE(save(user, "q1", "c1").ok());
  ASSERT_TRUE(save(user, "q1", "c2").ok());
  grpc::Status s = save(user, "q1", "c3");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("--max_checkpoint_bytes_per_identity"));
  EXPECT_THAT(s.error_message(), HasSubstr("anonymous"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/q1/c3")) << "a refused save wrote nothing";
  // Another job of the same identity shares the bound.
  start(user, "q2");
  EXPECT_EQ(save(user, "q2", "c1").error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  // The admin's jobs count toward no quota.
  start(admin, "q3");
  for (const char* name : {"c1", "c2", "c3"}) EXPECT_TRUE(save(admin, "q3", name).ok()) << name;
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat(dir, "/q3/", kCheckpointIdentityFile)));
  // Once old checkpoints are removed, the identity saves again.
  std::filesystem::remove_all(dir + "/q1/c1");
  EXPECT_TRUE(save(user, "q2", "c1").ok());
}

// ---- Mutual TLS ----

class TlsDaemonTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { pki_ = testing::TestPki::Create().release(); }
  static void TearDownTestSuite() { delete pki_; }
  static std::string File(const std::string& name) { return pki_->File(name); }
  static TlsFiles Pair(const std::string& leaf, const std::string& ca) {
    return {File(leaf + ".crt"), File(leaf + ".key"), File(ca + ".crt")};
  }

  void SetUp() override {
    ASSERT_NE(pki_, nullptr);
    DaemonOptions o;
    o.tls = Pair("server", "ca");
    daemon_ = Start(o);
    ASSERT_NE(daemon_, nullptr);
  }

  // Admin.Status over a channel with `security`.
  grpc::Status Status(const ChannelSecurity& security) {
    grpc::ChannelArguments args;
    auto stub = v1::Admin::NewStub(MakeChannel(daemon_->address(), security, args));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
    v1::StatusResponse resp;
    return stub->Status(&ctx, v1::StatusRequest(), &resp);
  }
  grpc::Status StatusWith(const TlsFiles& files) {
    absl::StatusOr<ChannelSecurity> s = MakeChannelSecurity(files, kTestToken, "");
    EXPECT_TRUE(s.ok()) << s.status();
    return Status(*s);
  }

  // A handshake that failed: gRPC says UNAVAILABLE, as it does for a daemon
  // that is down, so also check that this one is up. Its port took the
  // connection (a closed port says "Connection refused"), and the same call
  // with a good certificate, to the same address, is answered right after.
  void ExpectHandshakeRefused(const grpc::Status& refused) {
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
    EXPECT_THAT(refused.error_message(), Not(HasSubstr("Connection refused")))
        << "nothing listens at " << daemon_->address();
    const grpc::Status good = StatusWith(Pair("client", "ca"));
    EXPECT_TRUE(good.ok()) << "the daemon at " << daemon_->address()
                           << " did not answer a good certificate: " << good.error_message();
  }

  // Stubs over mutual TLS with `leaf`'s certificate, carrying kTestToken.
  std::shared_ptr<grpc::Channel> ChannelAs(const std::string& leaf) {
    absl::StatusOr<ChannelSecurity> s = MakeChannelSecurity(Pair(leaf, "ca"), kTestToken, "");
    EXPECT_TRUE(s.ok()) << s.status();
    return MakeChannel(daemon_->address(), s.ok() ? *s : ChannelSecurity(),
                       grpc::ChannelArguments());
  }
  grpc::Status CommitReplica(const std::string& leaf, const std::string& job) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::CommitReplicaRequest req;
    req.set_job_id(job);
    v1::CommitStepResponse resp;
    return v1::Replica::NewStub(ChannelAs(leaf))->CommitReplica(&ctx, req, &resp);
  }
  grpc::Status ReleaseReplica(const std::string& leaf, const std::string& job) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::ReleaseReplicaRequest req;
    req.set_job_id(job);
    v1::ReleaseReplicaResponse resp;
    return v1::Replica::NewStub(ChannelAs(leaf))->ReleaseReplica(&ctx, req, &resp);
  }
  // A TransferState stream of one header chunk naming `job`.
  grpc::Status TransferState(const std::string& leaf, const std::string& job) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::TransferStateResponse resp;
    auto stub = v1::Replica::NewStub(ChannelAs(leaf));
    std::unique_ptr<grpc::ClientWriter<v1::ReplicaStateChunk>> w = stub->TransferState(&ctx, &resp);
    v1::ReplicaStateChunk chunk;
    chunk.set_job_id(job);
    w->Write(chunk);
    w->WritesDone();
    return w->Finish();
  }
  grpc::Status ForwardGradient(const std::string& leaf, const std::string& job) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::ForwardGradientResponse resp;
    auto stub = v1::Replica::NewStub(ChannelAs(leaf));
    std::unique_ptr<grpc::ClientWriter<v1::ForwardedGradientChunk>> w =
        stub->ForwardGradient(&ctx, &resp);
    v1::ForwardedGradientChunk chunk;
    chunk.set_job_id(job);
    w->Write(chunk);
    w->WritesDone();
    return w->Finish();
  }
  // Registers job `id` (one rank, this daemon) with `leaf`'s certificate.
  grpc::Status Register(const std::string& id, const std::string& leaf) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::RegisterJobRequest req;
    *req.mutable_spec() = MakeSpec(id, SampleLayout(), 2, 1, {daemon_->address()});
    req.set_daemon_index(0);
    v1::RegisterJobResponse resp;
    return v1::Control::NewStub(ChannelAs(leaf))->RegisterJob(&ctx, req, &resp);
  }
  // Registers job `id` as a trainer, over TLS.
  void RegisterAsTrainer(const std::string& id) {
    const grpc::Status s = Register(id, "client");
    ASSERT_TRUE(s.ok()) << s.error_message();
  }

  static testing::TestPki* pki_;
  std::unique_ptr<Daemon> daemon_;
};

testing::TestPki* TlsDaemonTest::pki_ = nullptr;

// The daemon-to-daemon Replica calls demand the daemon role of the caller's
// certificate: a trainer's, an operator's or a role-less certificate from
// the same CA is refused before anything is read, with the fix in the
// message.
TEST_F(TlsDaemonTest, ReplicaCallsNeedTheDaemonRole) {
  RegisterAsTrainer("job");
  for (const std::string leaf : {"client", "admin", "norole"}) {
    const std::string has = leaf == "client"  ? "the role(s) trainer"
                            : leaf == "admin" ? "the role(s) admin"
                                              : "no role";
    for (const grpc::Status& s :
         {TransferState(leaf, "job"), ForwardGradient(leaf, "job"), CommitReplica(leaf, "job"),
          ReleaseReplica(leaf, "job"), CommitReplica(leaf, "unknown-job")}) {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
          << leaf << ": " << s.error_message();
      EXPECT_THAT(s.error_message(), HasSubstr("the daemon role")) << leaf;
      EXPECT_THAT(s.error_message(), HasSubstr("URI:urn:zeroshard:role:daemon")) << leaf;
      EXPECT_THAT(s.error_message(), HasSubstr(has)) << leaf;
    }
  }
  EXPECT_EQ(daemon_->jobs().size(), 1u) << "a refused ReleaseReplica removed the job";
}

// A daemon's certificate gets past the role check to the job lookup; the
// calls trainers make on failover stay open to theirs.
TEST_F(TlsDaemonTest, DaemonCertificatePassesTheRoleCheck) {
  EXPECT_EQ(CommitReplica("server", "unknown-job").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(ReleaseReplica("server", "unknown-job").error_code(), grpc::StatusCode::NOT_FOUND);
  RegisterAsTrainer("job");
  for (const grpc::Status& s : {TransferState("server", "job"), ForwardGradient("server", "job"),
                                CommitReplica("server", "job"), ReleaseReplica("server", "job")}) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("not replicated"));
  }
  for (const std::string leaf : {"client", "server"}) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::GetReplicaStateRequest req;
    req.set_job_id("job");
    v1::ReplicaState resp;
    const grpc::Status s =
        v1::Replica::NewStub(ChannelAs(leaf))->GetReplicaState(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << leaf << ": " << s.error_message();
  }
}

// Promote under mutual TLS: a trainer's certificate (with the job's token)
// cannot replace a primary that still serves (the backup asks its primary's
// daemon first: ABORTED, nothing changed); a daemon or admin certificate
// may (here the backup then refuses for its own reason: it never copied the
// primary). Once the primary's daemon is gone, the trainer's Promote gets
// past that check to the same reason.
TEST_F(TlsDaemonTest, ATrainerCertificateCannotReplaceALivePrimary) {
  DaemonOptions o;
  o.tls = Pair("server", "ca");
  std::unique_ptr<Daemon> other = Start(o);
  ASSERT_NE(other, nullptr);
  v1::JobSpec spec = MakeSpec("replicated", SampleLayout(), 2, 2,
                              {daemon_->address(), other->address()});
  spec.set_replicas(2);
  auto channel_to = [&](const std::string& address, const std::string& leaf) {
    absl::StatusOr<ChannelSecurity> sec = MakeChannelSecurity(Pair(leaf, "ca"), kTestToken, "");
    EXPECT_TRUE(sec.ok()) << sec.status();
    return MakeChannel(address, sec.ok() ? *sec : ChannelSecurity(), grpc::ChannelArguments());
  };
  const std::string addresses[2] = {daemon_->address(), other->address()};
  for (uint32_t d = 0; d < 2; ++d) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::RegisterJobRequest req;
    *req.mutable_spec() = spec;
    req.set_daemon_index(d);
    v1::RegisterJobResponse resp;
    const grpc::Status s =
        v1::Control::NewStub(channel_to(addresses[d], "client"))->RegisterJob(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  // Group 0's backup is on the other daemon.
  auto promote = [&](const std::string& leaf) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::PromoteRequest req;
    req.set_job_id("replicated");
    req.set_group(0);
    req.set_epoch(2);
    v1::ReplicaState resp;
    return v1::Replica::NewStub(channel_to(other->address(), leaf))->Promote(&ctx, req, &resp);
  };
  grpc::Status s = promote("client");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("still serves it"));
  for (const std::string leaf : {"server", "admin"}) {
    s = promote(leaf);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << leaf << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("holds no current copy")) << leaf;
  }
  absl::StatusOr<std::shared_ptr<Job>> backup = other->jobs().Find("replicated", 0);
  ASSERT_TRUE(backup.ok()) << backup.status();
  EXPECT_EQ((*backup)->role(), ReplicaRole::kBackup);
  EXPECT_EQ((*backup)->epoch(), 1u);

  daemon_->Shutdown(absl::Seconds(1));
  daemon_.reset();
  s = promote("client");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("holds no current copy"));
}

// Under mutual TLS each certificate is an identity with its own job quota
// (--max_jobs_per_identity) and memory quota (--max_memory_per_identity).
TEST_F(TlsDaemonTest, RegistrationsCountPerCertificate) {
  daemon_.reset();
  DaemonOptions o;
  o.tls = Pair("server", "ca");
  o.max_jobs_per_identity = 1;
  daemon_ = Start(o);
  ASSERT_NE(daemon_, nullptr);
  ASSERT_TRUE(Register("first", "client").ok());
  const uint64_t booked = daemon_->ledger().total();
  grpc::Status s = Register("second", "client");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("--max_jobs_per_identity"));
  EXPECT_THAT(s.error_message(), HasSubstr("cert:"));
  EXPECT_THAT(s.error_message(), HasSubstr("CN=client"));
  EXPECT_EQ(daemon_->ledger().total(), booked);
  EXPECT_EQ(daemon_->jobs().size(), 1u);
  // Another certificate of the same CA is another identity.
  EXPECT_TRUE(Register("second", "norole").ok());
  EXPECT_EQ(daemon_->jobs().size(), 2u);

  // Memory: the first job of a certificate fits its quota, a second does not.
  daemon_.reset();
  o.max_jobs_per_identity = 0;
  o.max_memory_per_identity = booked + booked / 2;
  daemon_ = Start(o);
  ASSERT_NE(daemon_, nullptr);
  ASSERT_TRUE(Register("first", "client").ok());
  s = Register("second", "client");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("--max_memory_per_identity"));
  EXPECT_EQ(daemon_->jobs().size(), 1u);
  EXPECT_TRUE(Register("second", "norole").ok());
}

TEST_F(TlsDaemonTest, GoodCertificateWorks) { EXPECT_TRUE(StatusWith(Pair("client", "ca")).ok()); }

TEST_F(TlsDaemonTest, ClientWithoutCertificateIsRefused) {
  grpc::SslCredentialsOptions o;  // checks the server, presents nothing
  o.pem_root_certs = [] {
    std::ifstream in(File("ca.crt"));
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  ChannelSecurity s;
  s.credentials = grpc::SslCredentials(o);
  ExpectHandshakeRefused(Status(s));
}

TEST_F(TlsDaemonTest, CertificateOfAnotherCaIsRefused) {
  // The stranger trusts our CA (so it accepts the server) but its own
  // certificate is signed by another.
  ExpectHandshakeRefused(
      StatusWith({File("stranger.crt"), File("stranger.key"), File("ca.crt")}));
}

TEST_F(TlsDaemonTest, ExpiredCertificateIsRefused) {
  ExpectHandshakeRefused(StatusWith(Pair("expired", "ca")));
}

TEST_F(TlsDaemonTest, PlaintextIsRefused) {
  ExpectHandshakeRefused(Status(ChannelSecurity::Plaintext(kTestToken)));
}

// Here the client refuses: it does not trust the daemon's certificate, and
// says so.
TEST_F(TlsDaemonTest, ClientThatDistrustsTheServerRefuses) {
  const grpc::Status s =
      StatusWith({File("client.crt"), File("client.key"), File("other_ca.crt")});
  EXPECT_THAT(s.error_message(), HasSubstr("certificate verify failed"));
  ExpectHandshakeRefused(s);
}

}  // namespace
}  // namespace zeroshard
