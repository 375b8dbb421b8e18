// The daemon's side of the UCX data path: ExchangeEndpoint hands out a
// staging region per rank and the parameter regions, booked once in the
// ledger; staged pushes are validated like inline ones and give the same
// result; bad input gets a specific status and changes nothing.

#include <cstring>
#include <string>
#include <vector>

#include "common/crc32c.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/job_config.h"
#include "server/testing/daemon_fixture.h"
#include "transport/transport.h"

namespace zeroshard {
namespace {

using testing::DaemonClient;
using testing::GradientChunks;
using testing::MakeSpec;
using testing::SampleLayout;

constexpr uint32_t kWorld = 3;
constexpr uint64_t kChunk = 500;

grpc::Status Exchange(DaemonClient& c, const std::string& job, uint32_t rank,
                      v1::ExchangeEndpointResponse* resp,
                      v1::TransportKind kind = v1::TRANSPORT_KIND_UCX) {
  grpc::ClientContext ctx;
  v1::ExchangeEndpointRequest req;
  req.set_job_id(job);
  req.set_rank(rank);
  req.set_transport(kind);
  return c.shard->ExchangeEndpoint(&ctx, req, resp);
}

class DaemonUcxTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    DaemonOptions o;
    o.ucx = true;
    o.ucx_tls = GetParam();
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    if (!daemon_->ucx_enabled()) GTEST_SKIP() << "UCX cannot initialise with " << GetParam();
    transport::TransportOptions to;
    to.ucx_tls = GetParam();
    absl::StatusOr<std::unique_ptr<transport::Transport>> t = transport::CreateTransport("ucx", to);
    if (!t.ok()) GTEST_SKIP() << "UCX cannot initialise: " << t.status();
    transport_ = *std::move(t);
    client_ = std::make_unique<DaemonClient>(daemon_->address());
    spec_ = MakeSpec("job", SampleLayout(), 2, kWorld, {daemon_->address()});
    config_ = *ParseJobSpec(spec_);
    ASSERT_TRUE(client_->Register(spec_, 0).ok());
    for (uint32_t r = 0; r < kWorld; ++r) ASSERT_TRUE(client_->Join(spec_, r).ok());
    grad_.assign(config_.map.total_elements(), 0.25f);
    const uint64_t buffer_before = Buffer();
    grpc::Status s = Exchange(*client_, "job", 0, &endpoint_);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(endpoint_.regions_size(), 2);  // fp32 job: staging and masters
    EXPECT_EQ(endpoint_.regions(0).purpose(), "grad_staging");
    EXPECT_EQ(endpoint_.regions(1).purpose(), "param_master");
    staging_.address = endpoint_.regions(0).address();
    staging_.length = endpoint_.regions(0).length();
    staging_.rkey = endpoint_.regions(0).rkey();
    // Two slots of one bucket, booked as buffer; the masters are booked once.
    EXPECT_EQ(staging_.length, 2 * config_.bucket_bytes);
    EXPECT_EQ(Buffer() - buffer_before, staging_.length);
    EXPECT_EQ(Category(MemoryCategory::kParamMaster),
              config_.map.DaemonRange(0).size() * sizeof(float));
    absl::StatusOr<std::unique_ptr<transport::Connection>> conn =
        transport_->Connect(endpoint_.worker_address(), absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(conn.ok()) << conn.status();
    conn_ = *std::move(conn);
  }

  uint64_t Category(MemoryCategory c) {
    return daemon_->ledger().JobBytes("job")[static_cast<int>(c)];
  }
  uint64_t Buffer() { return Category(MemoryCategory::kBuffer); }
  uint64_t Hash() { return (*daemon_->jobs().Find("job"))->StateHash(); }

  // Puts each chunk's data into the staging region (one after another from
  // `offset`) and turns the chunks into staged ones.
  void Stage(std::vector<v1::GradientChunk>* chunks, uint64_t offset = 0) {
    for (v1::GradientChunk& c : *chunks) {
      transport::Completion put =
          conn_->Put(c.data().data(), c.data().size(), staging_, offset);
      ASSERT_TRUE(put.Wait(absl::Now() + absl::Seconds(10)).ok());
      c.set_staged(true);
      c.set_staging_offset(offset);
      offset += c.data().size();
      c.clear_data();
    }
  }

  template <typename Call>
  void ExpectRejected(grpc::StatusCode code, const std::string& text, Call call) {
    const uint64_t before = Hash();
    const uint64_t ledger_before = daemon_->ledger().total();
    grpc::Status s = call();
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_NE(s.error_message().find(text), std::string::npos)
        << "message \"" << s.error_message() << "\" lacks \"" << text << "\"";
    EXPECT_EQ(Hash(), before) << "state changed by a rejected request: " << s.error_message();
    EXPECT_EQ(daemon_->ledger().total(), ledger_before);
  }

  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<transport::Connection> conn_;
  std::unique_ptr<DaemonClient> client_;
  v1::JobSpec spec_;
  JobConfig config_;
  std::vector<float> grad_;
  v1::ExchangeEndpointResponse endpoint_;
  transport::RegionDescriptor staging_;
};

TEST_P(DaemonUcxTest, ExchangeRejectsBadInput) {
  v1::ExchangeEndpointResponse r;
  ExpectRejected(grpc::NOT_FOUND, "nope", [&] { return Exchange(*client_, "nope", 0, &r); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "rank",
                 [&] { return Exchange(*client_, "job", kWorld, &r); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "transport", [&] {
    return Exchange(*client_, "job", 1, &r, v1::TRANSPORT_KIND_GRPC);
  });
  // Idempotent: the same region again, nothing booked twice.
  ExpectRejected(grpc::OK, "", [&] { return Exchange(*client_, "job", 0, &r); });
  EXPECT_EQ(r.regions(0).address(), staging_.address);
}

TEST_P(DaemonUcxTest, StagedPushesAreValidatedAndMatchInlineOnes) {
  // Rank 0 stages one chunk at a time (the staging region holds two slots).
  std::vector<v1::GradientChunk> chunks = GradientChunks(
      "job", 1, 0, config_.map, {0, config_.map.total_elements()}, grad_.data(), kChunk);
  auto one = [&](size_t i, auto edit) {
    std::vector<v1::GradientChunk> c = {chunks[i]};
    Stage(&c);
    edit(c[0]);
    return c;
  };
  auto push = [&](std::vector<v1::GradientChunk> c) {
    return [this, c] { return client_->Push(c); };
  };
  ExpectRejected(grpc::DATA_LOSS, "CRC-32C",
                 push(one(0, [](v1::GradientChunk& c) { c.set_crc32c(c.crc32c() ^ 1); })));
  ExpectRejected(grpc::INVALID_ARGUMENT, "outside the staging region",
                 push(one(0, [&](v1::GradientChunk& c) { c.set_staging_offset(staging_.length); })));
  ExpectRejected(grpc::INVALID_ARGUMENT, "outside the staging region",
                 push(one(0, [&](v1::GradientChunk& c) {
                   c.set_staging_offset(~uint64_t{0} - 3);
                 })));
  ExpectRejected(grpc::INVALID_ARGUMENT, "carries no data",
                 push(one(0, [](v1::GradientChunk& c) { c.set_data("x"); })));
  ExpectRejected(grpc::INVALID_ARGUMENT, "rank",
                 push(one(0, [](v1::GradientChunk& c) { c.set_rank(kWorld); })));
  ExpectRejected(grpc::FAILED_PRECONDITION, "ExchangeEndpoint",
                 push(one(0, [](v1::GradientChunk& c) { c.set_rank(1); })));
  ExpectRejected(grpc::INVALID_ARGUMENT, "range",
                 push(one(0, [](v1::GradientChunk& c) { c.mutable_range()->set_end(0); })));
  // A stream whose second chunk is bad applies nothing of the first.
  ExpectRejected(grpc::DATA_LOSS, "CRC-32C", [&] {
    std::vector<v1::GradientChunk> c = {chunks[0], chunks[1]};
    Stage(&c);
    c[1].set_crc32c(c[1].crc32c() ^ 1);
    return client_->Push(c);
  });
  // Rank 0 staged, ranks 1 and 2 inline: same sum as all inline.
  for (const v1::GradientChunk& c : chunks) {
    std::vector<v1::GradientChunk> s = {c};
    Stage(&s);
    ASSERT_TRUE(client_->Push(s).ok());
  }
  ASSERT_TRUE(client_->Push(GradientChunks("job", 1, 1, config_.map,
                                           {0, config_.map.total_elements()}, grad_.data(),
                                           kChunk)).ok());
  ASSERT_TRUE(client_->Push(GradientChunks("job", 1, 2, config_.map,
                                           {0, config_.map.total_elements()}, grad_.data(),
                                           kChunk)).ok());
  v1::PrepareStepResponse p;
  ASSERT_TRUE(client_->Prepare("job", 1, &p).ok());
  const double expected = 0.25 * 0.25 * config_.map.total_elements();
  EXPECT_NEAR(p.grad_sq_sum(), expected, expected * 1e-6);
  ASSERT_TRUE(client_->Commit("job", 1, 0.01f).ok());
  // The masters read through the region equal a gRPC gather.
  std::vector<float> via_grpc;
  const uint64_t total = config_.map.total_elements();
  ASSERT_TRUE(client_->Gather("job", 1, {0, total}, &via_grpc).ok());
  transport::RegionDescriptor master;
  master.address = endpoint_.regions(1).address();
  master.length = endpoint_.regions(1).length();
  master.rkey = endpoint_.regions(1).rkey();
  std::vector<float> via_ucx(total);
  transport::Completion get = conn_->Get(via_ucx.data(), total * 4, master, 0);
  ASSERT_TRUE(get.Wait(absl::Now() + absl::Seconds(10)).ok());
  EXPECT_EQ(0, std::memcmp(via_ucx.data(), via_grpc.data(), total * 4));
}

INSTANTIATE_TEST_SUITE_P(Tls, DaemonUcxTest, ::testing::Values("tcp", "posix,cma,self"),
                         [](const auto& info) {
                           return std::string(info.index == 0 ? "Tcp" : "Shm");
                         });

TEST(DaemonUcxOffTest, ExchangeWithoutUcxIsUnavailable) {
  std::unique_ptr<Daemon> daemon = testing::StartDaemon();
  DaemonClient client(daemon->address());
  v1::JobSpec spec = MakeSpec("job", SampleLayout(), 2, 1, {daemon->address()});
  ASSERT_TRUE(client.Register(spec, 0).ok());
  v1::ExchangeEndpointResponse r;
  grpc::Status s = Exchange(client, "job", 0, &r);
  EXPECT_EQ(s.error_code(), grpc::UNAVAILABLE) << s.error_message();
  EXPECT_NE(s.error_message().find("grpc"), std::string::npos) << s.error_message();
  // A staged chunk without a staging region.
  const JobConfig config = *ParseJobSpec(spec);
  std::vector<float> g(config.map.total_elements(), 1.0f);
  std::vector<v1::GradientChunk> c =
      GradientChunks("job", 1, 0, config.map, {0, config.map.total_elements()}, g.data(), kChunk);
  c.resize(1);
  c[0].clear_data();
  c[0].set_staged(true);
  s = client.Push(c);
  EXPECT_EQ(s.error_code(), grpc::FAILED_PRECONDITION) << s.error_message();
}

}  // namespace
}  // namespace zeroshard
