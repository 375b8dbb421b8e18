// The daemon's side of the bulk data path, over every bulk transport
// (inproc, and UCX where it initialises): ExchangeEndpoint hands out a
// staging region per rank and the parameter regions, booked once in the
// ledger; staged pushes are validated like inline ones and give the same
// result; staging-slot generations and fences; bad input gets a specific
// status and changes nothing; the address a "grpc" bulk transport listens on
// and the one it hands trainers.

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/job_spec.h"
#include "common/protocol.h"
#include "gtest/gtest.h"
#include "metrics/metric_names.h"
#include "metrics/registry.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"
#include "transport/host_address.h"
#include "transport/shm/push_memory.h"
#include "transport/transport.h"

namespace zeroshard {
namespace {

using testing::DaemonClient;
using testing::GradientChunks;
using testing::MakeSpec;
using testing::ParamChunks;
using testing::SampleLayout;

constexpr uint32_t kWorld = 3;
constexpr uint64_t kChunk = 500;

grpc::Status Exchange(DaemonClient& c, const std::string& job, uint32_t rank,
                      v1::ExchangeEndpointResponse* resp,
                      v1::TransportKind kind) {
  grpc::ClientContext ctx;
  v1::ExchangeEndpointRequest req;
  req.set_job_id(job);
  req.set_rank(rank);
  req.set_transport(kind);
  req.set_incarnation(testing::kTestIncarnation);
  return c.shard->ExchangeEndpoint(&ctx, req, resp);
}

grpc::Status Fence(DaemonClient& c, uint32_t rank, uint32_t slot, uint64_t generation,
                   v1::FenceStagingSlotResponse* resp) {
  grpc::ClientContext ctx;
  v1::FenceStagingSlotRequest req;
  req.set_job_id("job");
  req.set_rank(rank);
  req.set_incarnation(testing::kTestIncarnation);
  req.set_slot(slot);
  req.set_generation(generation);
  return c.shard->FenceStagingSlot(&ctx, req, resp);
}

struct BulkParam {
  const char* transport;
  const char* tls;
  const char* name;
};

class DaemonBulkTest : public ::testing::TestWithParam<BulkParam> {
 protected:
  void SetUp() override {
    DaemonOptions o;
    o.bulk_transport = GetParam().transport;
    o.ucx_tls = GetParam().tls;
    // Loopback, and every peer is this process: UCX keys may go out over tcp.
    o.ucx_trust_peers = true;
    o.read_lease = absl::ZeroDuration();
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    if (daemon_->bulk_transport() == nullptr) {
      GTEST_SKIP() << GetParam().transport << " cannot initialise with " << GetParam().tls;
    }
    kind_ = *TransportKindFromName(GetParam().transport, "t");
    transport::BackendOptions to;
    to.ucx.tls = GetParam().tls;
    absl::StatusOr<std::unique_ptr<transport::Transport>> t =
        transport::CreateTransport(GetParam().transport, to);
    if (!t.ok()) GTEST_SKIP() << "cannot initialise: " << t.status();
    transport_ = *std::move(t);
    client_ = std::make_unique<DaemonClient>(daemon_->address());
    spec_ = MakeSpec("job", SampleLayout(), 2, kWorld, {daemon_->address()});
    config_ = *ParseJobSpec(spec_);
    ASSERT_TRUE(client_->Register(spec_, 0).ok());
    for (uint32_t r = 0; r < kWorld; ++r) ASSERT_TRUE(client_->Join(spec_, r).ok());
    grad_.assign(config_.map.total_elements(), 0.25f);
    const uint64_t buffer_before = Buffer();
    grpc::Status s = Exchange(*client_, "job", 0, &endpoint_, kind_);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(endpoint_.regions_size(), 2);  // fp32 job: staging and masters
    EXPECT_EQ(endpoint_.regions(0).purpose(), v1::REGION_PURPOSE_GRAD_STAGING);
    EXPECT_EQ(endpoint_.regions(1).purpose(), v1::REGION_PURPOSE_PARAM_MASTER);
    EXPECT_EQ(endpoint_.transport(), kind_);
    EXPECT_EQ(endpoint_.staging_slots(), DaemonOptions{}.staging_slots);
    // A slot holds a bucket of C_B, or everything the daemon owns in fp32
    // when that is less (this job).
    const uint64_t owned_bytes = config_.map.DaemonRange(0).size() * sizeof(float);
    ASSERT_LT(owned_bytes, config_.bucket_bytes);
    EXPECT_EQ(endpoint_.staging_slot_bytes(), owned_bytes);
    staging_.address = endpoint_.regions(0).address();
    staging_.length = endpoint_.regions(0).length();
    staging_.rkey = endpoint_.regions(0).rkey();
    // The slots, booked as buffer; the masters are booked once.
    EXPECT_EQ(staging_.length, endpoint_.staging_slots() * owned_bytes);
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

  // Puts the chunks' data back to back into slot `slot` and turns them into
  // the staged chunks of one push, the slot's next generation. No CRC:
  // staged pushes carry none.
  void Stage(std::vector<v1::GradientChunk>* chunks, uint32_t slot = 0) {
    uint64_t at = slot * endpoint_.staging_slot_bytes();
    ++generation_[slot];
    for (v1::GradientChunk& c : *chunks) {
      ASSERT_LE(at + c.data().size(), (slot + 1) * endpoint_.staging_slot_bytes());
      transport::Completion put = conn_->Put(c.data().data(), c.data().size(), staging_, at);
      ASSERT_TRUE(put.Wait(absl::Now() + absl::Seconds(10)).ok());
      at += c.data().size();
      c.set_staged(true);
      c.set_staging_slot(slot);
      c.set_staging_generation(generation_[slot]);
      c.set_crc32c(0);
      c.clear_data();
    }
  }

  // One chunk, the same way.
  void Stage(v1::GradientChunk* c, uint32_t slot = 0) {
    std::vector<v1::GradientChunk> one = {*c};
    Stage(&one, slot);
    *c = one[0];
  }

  template <typename Call>
  void ExpectRejected(grpc::StatusCode code, const std::string& text, Call call) {
    testing::ExpectRejected(*daemon_, "job", code, text, call);
  }

  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<transport::Connection> conn_;
  std::unique_ptr<DaemonClient> client_;
  v1::JobSpec spec_;
  JobConfig config_;
  // Ranks 1.. push the whole gradient inline; the prepared norm is that of
  // every rank's 0.25s (rank 0 pushed its own before).
  void PushOtherRanksAndPrepare() {
    for (uint32_t r = 1; r < kWorld; ++r) {
      ASSERT_TRUE(client_->Push(GradientChunks("job", 1, r, config_.map,
                                               {0, config_.map.total_elements()}, grad_.data(),
                                               kChunk)).ok());
    }
    v1::PrepareStepResponse p;
    ASSERT_TRUE(client_->Prepare("job", 1, &p).ok());
    const double expected = 0.25 * 0.25 * config_.map.total_elements();
    EXPECT_NEAR(p.grad_sq_sum(), expected, expected * 1e-6);
  }

  std::vector<float> grad_;
  v1::ExchangeEndpointResponse endpoint_;
  transport::RegionDescriptor staging_;
  v1::TransportKind kind_ = v1::TRANSPORT_KIND_UNSPECIFIED;
  uint64_t generation_[2] = {0, 0};
};

TEST_P(DaemonBulkTest, ExchangeRejectsBadInput) {
  v1::ExchangeEndpointResponse r;
  ExpectRejected(grpc::NOT_FOUND, "nope", [&] { return Exchange(*client_, "nope", 0, &r, kind_); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "rank",
                 [&] { return Exchange(*client_, "job", kWorld, &r, kind_); });
  const v1::TransportKind other =
      kind_ == v1::TRANSPORT_KIND_INPROC ? v1::TRANSPORT_KIND_UCX : v1::TRANSPORT_KIND_INPROC;
  ExpectRejected(grpc::FAILED_PRECONDITION, "bulk transport",
                 [&] { return Exchange(*client_, "job", 1, &r, other); });
  // Idempotent: the same region again, nothing booked twice.
  ExpectRejected(grpc::OK, "", [&] { return Exchange(*client_, "job", 0, &r, kind_); });
  EXPECT_EQ(r.regions(0).address(), staging_.address);
}

TEST_P(DaemonBulkTest, StagedPushesAreValidatedAndMatchInlineOnes) {
  std::vector<v1::GradientChunk> chunks = GradientChunks(
      "job", 1, 0, config_.map, {0, config_.map.total_elements()}, grad_.data(), kChunk);
  auto one = [&](size_t i, auto edit) {
    v1::GradientChunk c = chunks[i];
    Stage(&c);
    edit(c);
    return std::vector<v1::GradientChunk>{c};
  };
  auto push = [&](std::vector<v1::GradientChunk> c) {
    return [this, c] { return client_->Push(c); };
  };
  ExpectRejected(
      grpc::INVALID_ARGUMENT, "staging_slot",
      push(one(0, [&](v1::GradientChunk& c) { c.set_staging_slot(endpoint_.staging_slots()); })));
  ExpectRejected(grpc::INVALID_ARGUMENT, "staging_generation",
                 push(one(0, [&](v1::GradientChunk& c) { c.set_staging_generation(0); })));
  ExpectRejected(grpc::INVALID_ARGUMENT, "carries no data",
                 push(one(0, [](v1::GradientChunk& c) { c.set_data("x"); })));
  ExpectRejected(grpc::INVALID_ARGUMENT, "rank",
                 push(one(0, [](v1::GradientChunk& c) { c.set_rank(kWorld); })));
  ExpectRejected(grpc::FAILED_PRECONDITION, "ExchangeEndpoint",
                 push(one(0, [](v1::GradientChunk& c) { c.set_rank(1); })));
  ExpectRejected(grpc::INVALID_ARGUMENT, "range",
                 push(one(0, [](v1::GradientChunk& c) { c.mutable_range()->set_end(0); })));
  // Over 64 MiB of fp32, though fewer than 64 Mi elements.
  ExpectRejected(grpc::INVALID_ARGUMENT, "too long for a staged chunk",
                 push(one(0, [](v1::GradientChunk& c) {
                   c.mutable_range()->set_end(c.range().begin() + kMaxChunkBytes / 4 + 1);
                 })));
  ExpectRejected(grpc::INVALID_ARGUMENT, "all staged or all inline", [&] {
    std::vector<v1::GradientChunk> c = {chunks[0], chunks[1]};
    Stage(&c[0]);
    return client_->Push(c);
  });
  ASSERT_GE(chunks.size(), 3u);
  ExpectRejected(grpc::INVALID_ARGUMENT, "slot, generation", [&] {
    std::vector<v1::GradientChunk> c = {chunks[0], chunks[1]};
    Stage(&c);
    c[1].set_staging_slot(1);
    return client_->Push(c);
  });
  ExpectRejected(grpc::INVALID_ARGUMENT, "slot, generation", [&] {
    std::vector<v1::GradientChunk> c = {chunks[0], chunks[1]};
    Stage(&c);
    c[1].set_staging_generation(c[0].staging_generation() + 1);
    return client_->Push(c);
  });
  ExpectRejected(grpc::INVALID_ARGUMENT, "dtype, slot, generation", [&] {
    // An fp32 payload after a bf16 one could start misaligned.
    std::vector<v1::GradientChunk> c = {chunks[0], chunks[1]};
    Stage(&c);
    c[0].set_dtype(v1::DTYPE_BF16);
    return client_->Push(c);
  });
  ExpectRejected(grpc::INVALID_ARGUMENT, "do not fit a staging slot", [&] {
    // More payload than a slot holds, announced as one push.
    std::vector<v1::GradientChunk> c = {chunks[0]};
    Stage(&c);
    const uint64_t each = (c[0].range().end() - c[0].range().begin()) * sizeof(float);
    while (c.size() * each <= endpoint_.staging_slot_bytes()) c.push_back(c[0]);
    return client_->Push(c);
  });
  // Rank 0 staged (its first bucket alone, the rest back to back in one
  // slot and one push), ranks 1 and 2 inline: same sum as all inline.
  {
    std::vector<v1::GradientChunk> first = {chunks[0]};
    Stage(&first);
    grpc::Status st = client_->Push(first);
    ASSERT_TRUE(st.ok()) << st.error_message();
    std::vector<v1::GradientChunk> rest(chunks.begin() + 1, chunks.end());
    Stage(&rest, 1);
    st = client_->Push(rest);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  PushOtherRanksAndPrepare();
  ASSERT_TRUE(client_->Commit("job", 1, 0.01f).ok());
  // The masters read through the region equal a streaming gather.
  std::vector<float> via_stream;
  const uint64_t total = config_.map.total_elements();
  ASSERT_TRUE(client_->Gather("job", 1, {0, total}, &via_stream).ok());
  transport::RegionDescriptor master;
  master.address = endpoint_.regions(1).address();
  master.length = endpoint_.regions(1).length();
  master.rkey = endpoint_.regions(1).rkey();
  std::vector<float> via_bulk(total);
  transport::Completion get = conn_->Get(via_bulk.data(), total * 4, master, 0);
  ASSERT_TRUE(get.Wait(absl::Now() + absl::Seconds(10)).ok());
  EXPECT_EQ(0, std::memcmp(via_bulk.data(), via_stream.data(), total * 4));
}

// Bug 1: a staged push whose RPC the client gave up on must never be applied
// after the client reused the slot. The fence answers whether it was applied,
// and refuses the late push; a generation is applied at most once.
TEST_P(DaemonBulkTest, FencedGenerationIsNeverApplied) {
  std::vector<v1::GradientChunk> chunks = GradientChunks(
      "job", 1, 0, config_.map, {0, config_.map.total_elements()}, grad_.data(), kChunk);
  v1::GradientChunk late = chunks[0];
  Stage(&late);  // generation 1 of slot 0, its RPC "timed out" before sending
  v1::FenceStagingSlotResponse fenced;
  ASSERT_TRUE(Fence(*client_, 0, 0, late.staging_generation(), &fenced).ok());
  EXPECT_EQ(fenced.applied_generation(), 0u);  // not applied: the client resends
  // The client reuses the slot for another bucket; the late RPC now arrives.
  v1::GradientChunk next = chunks[1];
  Stage(&next);  // generation 2
  ExpectRejected(grpc::FAILED_PRECONDITION, "fenced", [&] { return client_->Push({late}); });
  ASSERT_TRUE(client_->Push({next}).ok());
  // Applied once; a replay of the same generation is refused.
  ExpectRejected(grpc::FAILED_PRECONDITION, "already applied", [&] { return client_->Push({next}); });
  ASSERT_TRUE(Fence(*client_, 0, 0, next.staging_generation(), &fenced).ok());
  EXPECT_EQ(fenced.applied_generation(), next.staging_generation());
  v1::FenceStagingSlotResponse r;
  EXPECT_EQ(Fence(*client_, 0, 7, 1, &r).error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_EQ(Fence(*client_, 1, 0, 1, &r).error_code(), grpc::FAILED_PRECONDITION);
}

// Bug 4: the last rank's Leave removes the job atomically with its staging;
// an ExchangeEndpoint that found the job before cannot re-create staging,
// and the ledger empties once the read lease ends.
TEST_P(DaemonBulkTest, LeaveRemovesJobWithItsStaging) {
  std::shared_ptr<Job> held = *daemon_->jobs().Find("job");
  for (uint32_t r = 0; r < kWorld; ++r) {
    grpc::ClientContext ctx;
    v1::LeaveRequest req;
    req.set_job_id("job");
    req.set_rank(r);
    req.set_incarnation(testing::kTestIncarnation);
    v1::LeaveResponse resp;
    ASSERT_TRUE(client_->control->Leave(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.job_removed(), r == kWorld - 1);
  }
  EXPECT_EQ(held->Staging(0, testing::kTestIncarnation, true).status().code(),
            absl::StatusCode::kNotFound);
  held.reset();
  daemon_->jobs().Tick();  // read lease 0: reaped now
  EXPECT_EQ(daemon_->jobs().retired(), 0u);
  EXPECT_EQ(daemon_->ledger().total(), 0u);
}

// Reads a rank made under an earlier wait_only Gather's lease without asking
// are reported with its next wait_only Gather or its Leave, and counted as
// gather traffic on the bulk transport with the reads that were asked for.
TEST_P(DaemonBulkTest, ReportedReadsAreCountedAsGatherTraffic) {
  auto gathered = [&] {
    return metrics::SumOf(daemon_->registry().Collect(), metrics::kCommBytesTotal.name,
                          {{"op", "gather"}, {"transport", GetParam().transport}});
  };
  const double before = gathered();
  v1::GatherRequest req;
  req.set_job_id("job");
  req.mutable_range()->set_begin(0);
  req.mutable_range()->set_end(10);
  req.set_dtype(v1::DTYPE_FP32);
  req.set_wait_only(true);
  req.set_unreported_read_bytes(1000);
  std::vector<v1::ParameterChunk> chunks;
  ASSERT_TRUE(client_->Gather(req, &chunks).ok());
  EXPECT_TRUE(chunks.empty());
  EXPECT_EQ(gathered() - before, 40 + 1000);
  // Rank 0 leaves with 500 more; rank 1 keeps the job (and its series).
  v1::LeaveResponse resp;
  ASSERT_TRUE(client_->Leave("job", 0, 500, &resp).ok());
  EXPECT_FALSE(resp.job_removed());
  EXPECT_EQ(gathered() - before, 40 + 1000 + 500);
}

// Push memory (same host): the daemon maps a trainer's sealed memfd and sums
// staged chunks straight from it. This process is the trainer; the daemon
// in it takes the memory's descriptor like any daemon on the host.
grpc::Status MapMemory(DaemonClient& c, uint32_t rank, uint64_t incarnation,
                       const transport::PushMemory& m, v1::MapPushMemoryResponse* resp,
                       const std::string& name = "") {
  grpc::ClientContext ctx;
  v1::MapPushMemoryRequest req;
  req.set_job_id("job");
  req.set_rank(rank);
  req.set_incarnation(incarnation);
  req.set_pid(m.pid());
  req.set_fd(m.fd());
  req.set_name(name.empty() ? m.name() : name);
  req.set_bytes(m.size());
  return c.shard->MapPushMemory(&ctx, req, resp);
}

class DaemonPushMemoryTest : public DaemonBulkTest {
 protected:
  void SetUp() override {
    DaemonBulkTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    chunks_ = GradientChunks("job", 1, 0, config_.map, {0, config_.map.total_elements()},
                             grad_.data(), kChunk);
    uint64_t bytes = 0;
    for (const v1::GradientChunk& c : chunks_) bytes += c.data().size();
    absl::StatusOr<std::unique_ptr<transport::PushMemory>> m =
        transport::PushMemory::Create(bytes + 4096);
    ASSERT_TRUE(m.ok()) << m.status();
    memory_ = *std::move(m);
    v1::MapPushMemoryResponse r;
    grpc::Status st = MapMemory(*client_, 0, testing::kTestIncarnation, *memory_, &r);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_GE(r.id(), 1u);
    id_ = r.id();
    staging_state_ = *(*daemon_->jobs().Find("job"))->Staging(0, testing::kTestIncarnation, false);
    ASSERT_EQ(staging_state_->push_memories(), 1u);
  }

  // Writes the chunks' payloads into the push memory, 4096 bytes in and then
  // back to back, and makes them the staged chunks of one pulled push: slot
  // `slot`'s next generation; the slot itself is not written.
  void StageInMemory(std::vector<v1::GradientChunk>* chunks, uint32_t slot = 0) {
    uint64_t at = 4096;
    ++generation_[slot];
    for (v1::GradientChunk& c : *chunks) {
      std::memcpy(static_cast<char*>(memory_->data()) + at, c.data().data(), c.data().size());
      c.set_staged(true);
      c.set_staging_slot(slot);
      c.set_staging_generation(generation_[slot]);
      c.set_push_memory(id_);
      c.set_push_memory_offset(at);
      c.set_crc32c(0);
      at += c.data().size();
      c.clear_data();
    }
  }

  std::vector<v1::GradientChunk> chunks_;
  std::unique_ptr<transport::PushMemory> memory_;
  uint32_t id_ = 0;
  std::shared_ptr<RankStaging> staging_state_;
};

TEST_P(DaemonPushMemoryTest, PulledPushesAreSummedInPlaceLikeInlineOnes) {
  // Rank 0's whole gradient, 4096 bytes into its push memory.
  std::vector<v1::GradientChunk> pulled = chunks_;
  StageInMemory(&pulled);
  uint64_t bytes = 0;
  for (const v1::GradientChunk& c : chunks_) bytes += c.data().size();
  grpc::Status st = client_->Push(pulled);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(staging_state_->pulled_bytes(), bytes);
  PushOtherRanksAndPrepare();
  // A replay of the applied generation reads nothing.
  ExpectRejected(grpc::FAILED_PRECONDITION, "already applied",
                 [&] { return client_->Push(pulled); });
  EXPECT_EQ(staging_state_->pulled_bytes(), bytes);
}

TEST_P(DaemonPushMemoryTest, BadPushMemoryInputChangesNothing) {
  v1::MapPushMemoryResponse r;
  // Not that memory's secret, another job, a rank without an endpoint.
  std::string other = memory_->name();
  other.back() = other.back() == 'a' ? 'b' : 'a';
  ExpectRejected(grpc::FAILED_PRECONDITION, "is not the memfd", [&] {
    return MapMemory(*client_, 0, testing::kTestIncarnation, *memory_, &r, other);
  });
  ExpectRejected(grpc::INVALID_ARGUMENT, "push memory", [&] {
    return MapMemory(*client_, 0, testing::kTestIncarnation, *memory_, &r, "not-ours");
  });
  ExpectRejected(grpc::FAILED_PRECONDITION, "ExchangeEndpoint", [&] {
    return MapMemory(*client_, 1, testing::kTestIncarnation, *memory_, &r);
  });
  ExpectRejected(grpc::INVALID_ARGUMENT, "rank", [&] {
    return MapMemory(*client_, kWorld, testing::kTestIncarnation, *memory_, &r);
  });
  EXPECT_EQ(staging_state_->push_memories(), 1u);
  // Pushes naming a memory that is not there, bytes past its end, an offset
  // without a memory, chunks naming different memories.
  auto pulled = [&](auto edit) {
    std::vector<v1::GradientChunk> c = {chunks_[0], chunks_[1]};
    StageInMemory(&c);
    edit(c);
    return [this, c] { return client_->Push(c); };
  };
  ExpectRejected(grpc::INVALID_ARGUMENT, "push_memory",
                 pulled([&](auto& c) { for (auto& x : c) x.set_push_memory(id_ + 1); }));
  ExpectRejected(grpc::INVALID_ARGUMENT, "overrun push memory", pulled([&](auto& c) {
                   c[1].set_push_memory_offset(memory_->size() - 4);
                 }));
  ExpectRejected(grpc::INVALID_ARGUMENT, "overrun push memory", pulled([&](auto& c) {
                   c[1].set_push_memory_offset(~uint64_t{0} - 3);
                 }));
  ExpectRejected(grpc::INVALID_ARGUMENT, "without a push_memory", pulled([&](auto& c) {
                   for (auto& x : c) x.set_push_memory(0);
                 }));
  ExpectRejected(grpc::INVALID_ARGUMENT, "push memory",
                 pulled([&](auto& c) { c[1].set_push_memory(0); }));
  EXPECT_EQ(staging_state_->pulled_bytes(), 0u);
  ExpectRejected(grpc::INVALID_ARGUMENT, "not a multiple of 4", pulled([&](auto& c) {
                   c[1].set_push_memory_offset(c[1].push_memory_offset() + 2);
                 }));
  // The same memory again: the same id, nothing mapped twice.
  ASSERT_TRUE(MapMemory(*client_, 0, testing::kTestIncarnation, *memory_, &r).ok());
  EXPECT_EQ(r.id(), id_);
  EXPECT_EQ(staging_state_->push_memories(), 1u);
  // Larger than a rank process may map (twice the job's fp32 gradient and
  // 1 GiB): sparse, nothing of it is touched.
  absl::StatusOr<std::unique_ptr<transport::PushMemory>> huge =
      transport::PushMemory::Create((size_t{1} << 30) + (size_t{1} << 24));
  ASSERT_TRUE(huge.ok());
  ExpectRejected(grpc::RESOURCE_EXHAUSTED, "bytes of push memory mapped", [&] {
    return MapMemory(*client_, 0, testing::kTestIncarnation, **huge, &r);
  });
  // At most kMaxPushMemories per rank process.
  std::vector<std::unique_ptr<transport::PushMemory>> more;
  for (uint32_t i = 1; i < RankStaging::kMaxPushMemories; ++i) {
    more.push_back(*transport::PushMemory::Create(4096));
    ASSERT_TRUE(MapMemory(*client_, 0, testing::kTestIncarnation, *more.back(), &r).ok());
  }
  more.push_back(*transport::PushMemory::Create(4096));
  ExpectRejected(grpc::RESOURCE_EXHAUSTED, "push memories", [&] {
    return MapMemory(*client_, 0, testing::kTestIncarnation, *more.back(), &r);
  });
}

// A pulled push whose RPC the trainer gave up on is fenced like a put one: a
// fenced generation is never read, and nothing of a replaced rank process
// (a zombie) is read or mapped once its successor joined.
TEST_P(DaemonPushMemoryTest, FencedGenerationsAndFencedIncarnationsAreNeverRead) {
  std::vector<v1::GradientChunk> late = {chunks_[0]};
  StageInMemory(&late);
  v1::FenceStagingSlotResponse fenced;
  ASSERT_TRUE(Fence(*client_, 0, 0, late[0].staging_generation(), &fenced).ok());
  EXPECT_EQ(fenced.applied_generation(), 0u);
  ExpectRejected(grpc::FAILED_PRECONDITION, "fenced", [&] { return client_->Push(late); });
  EXPECT_EQ(staging_state_->pulled_bytes(), 0u);
  // A new process takes over rank 0; the old one's announcements and maps
  // are refused before anything is opened or read.
  ASSERT_TRUE(client_->Join(spec_, 0, testing::kTestIncarnation + 1).ok());
  std::vector<v1::GradientChunk> zombie = {chunks_[1]};
  StageInMemory(&zombie);
  ExpectRejected(grpc::FAILED_PRECONDITION, "incarnation",
                 [&] { return client_->Push(zombie); });
  v1::MapPushMemoryResponse r;
  ExpectRejected(grpc::FAILED_PRECONDITION, "incarnation", [&] {
    return MapMemory(*client_, 0, testing::kTestIncarnation, *memory_, &r);
  });
  EXPECT_EQ(staging_state_->pulled_bytes(), 0u);
  EXPECT_EQ(staging_state_->push_memories(), 1u);
}

INSTANTIATE_TEST_SUITE_P(Transports, DaemonPushMemoryTest,
                         ::testing::Values(BulkParam{"inproc", "", "Inproc"},
                                           BulkParam{"ucx", "tcp", "UcxTcp"},
                                           BulkParam{"ucx", "posix,cma,self", "UcxShm"}),
                         [](const auto& info) { return std::string(info.param.name); });

INSTANTIATE_TEST_SUITE_P(Transports, DaemonBulkTest,
                         ::testing::Values(BulkParam{"inproc", "", "Inproc"},
                                           BulkParam{"ucx", "tcp", "UcxTcp"},
                                           BulkParam{"ucx", "posix,cma,self", "UcxShm"}),
                         [](const auto& info) { return std::string(info.param.name); });

// --staging_slots sets how many slots each rank's staging region has (each
// booked as buffer); a count outside 1..64 keeps the daemon from starting.
TEST(DaemonBulkOptionsTest, StagingSlotsSetTheRegionAndAreChecked) {
  for (const uint32_t bad : {0u, 65u}) {
    DaemonOptions o;
    o.bulk_transport = "inproc";
    o.staging_slots = bad;
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(d.status().message().find("--staging_slots"), std::string::npos) << d.status();
  }
  DaemonOptions o;
  o.bulk_transport = "inproc";
  o.staging_slots = 7;
  std::unique_ptr<Daemon> daemon = *Daemon::Start(o);
  DaemonClient client(daemon->address());
  const v1::JobSpec spec = MakeSpec("job", SampleLayout(), 2, 1, {daemon->address()});
  ASSERT_TRUE(client.Register(spec, 0).ok());
  ASSERT_TRUE(client.JoinAll(spec).ok());
  v1::ExchangeEndpointResponse endpoint;
  ASSERT_TRUE(Exchange(client, "job", 0, &endpoint, v1::TRANSPORT_KIND_INPROC).ok());
  EXPECT_EQ(endpoint.staging_slots(), 7u);
  EXPECT_EQ(endpoint.regions(0).length(), 7 * endpoint.staging_slot_bytes());
}

// Bug 7: the last Leave removes the job, but its parameter regions stay
// mapped (and booked) for the read lease after the job last handed out
// remote access, so a peer's Get in flight still reads live memory; then
// they are freed.
TEST(DaemonBulkLeaseTest, RemovedJobsRegionsOutliveTheReadLease) {
  DaemonOptions o;
  o.bulk_transport = "inproc";
  o.read_lease = absl::Milliseconds(600);
  std::unique_ptr<Daemon> daemon = *Daemon::Start(o);
  DaemonClient client(daemon->address());
  const v1::JobSpec spec = MakeSpec("job", SampleLayout(), 2, 1, {daemon->address()});
  const JobConfig config = *ParseJobSpec(spec);
  ASSERT_TRUE(client.Register(spec, 0).ok());
  ASSERT_TRUE(client.JoinAll(spec).ok());
  v1::ExchangeEndpointResponse endpoint;
  ASSERT_TRUE(Exchange(client, "job", 0, &endpoint, v1::TRANSPORT_KIND_INPROC).ok());
  std::unique_ptr<transport::Transport> peer = *transport::CreateTransport("inproc");
  std::unique_ptr<transport::Connection> conn =
      *peer->Connect(endpoint.worker_address(), absl::Now() + absl::Seconds(10));
  transport::RegionDescriptor master;
  master.address = endpoint.regions(1).address();
  master.length = endpoint.regions(1).length();
  master.rkey = endpoint.regions(1).rkey();
  grpc::ClientContext ctx;
  v1::LeaveRequest leave;
  leave.set_job_id("job");
  leave.set_incarnation(testing::kTestIncarnation);
  v1::LeaveResponse left;
  ASSERT_TRUE(client.control->Leave(&ctx, leave, &left).ok());
  ASSERT_TRUE(left.job_removed());
  EXPECT_FALSE(daemon->jobs().Find("job").ok());
  // Within the lease: still readable, still booked.
  std::vector<float> out(config.map.total_elements());
  daemon->jobs().Tick();
  transport::Completion get = conn->Get(out.data(), out.size() * 4, master, 0);
  EXPECT_TRUE(get.Wait(absl::Now() + absl::Seconds(10)).ok());
  EXPECT_GT(daemon->ledger().total(), 0u);
  EXPECT_EQ(daemon->jobs().retired(), 1u);
  // After it: freed, and the peer's reads fail instead of reading freed memory.
  absl::SleepFor(absl::Milliseconds(700));
  daemon->jobs().Tick();
  EXPECT_EQ(daemon->jobs().retired(), 0u);
  EXPECT_EQ(daemon->ledger().total(), 0u);
  transport::Completion late = conn->Get(out.data(), out.size() * 4, master, 0);
  EXPECT_FALSE(late.Wait(absl::Now() + absl::Seconds(10)).ok());
}

// This machine's first non-loopback IPv4 address (getifaddrs), or empty.
std::string NonLoopbackIpv4() {
  const std::vector<transport::InterfaceAddress> addresses =
      transport::NonLoopbackIpv4Addresses();
  return addresses.empty() ? "" : addresses.front().address;
}

// A daemon with a "grpc" bulk transport, plaintext on any address.
std::unique_ptr<Daemon> StartGrpcBulkDaemon(const std::string& listen,
                                            const std::string& advertise = "") {
  DaemonOptions o;
  o.listen = listen;
  o.insecure = true;
  o.bulk_transport = "grpc";
  o.advertise_address = advertise;
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  EXPECT_TRUE(d.ok()) << d.status();
  if (!d.ok()) return nullptr;
  EXPECT_NE((*d)->bulk_transport(), nullptr) << "the grpc bulk transport did not start";
  return *std::move(d);
}

// What a trainer does with a daemon's grpc bulk transport: joins a job,
// takes the worker_address ExchangeEndpoint hands out (which must start
// with `host`), connects there and reads the parameters it initialised
// through the parameter region; returns the worker_address.
std::string ExpectTrainerReadsThrough(Daemon& daemon, const std::string& host) {
  DaemonClient client(daemon.address());
  const v1::JobSpec spec = MakeSpec("job", SampleLayout(), 2, 1, {daemon.address()});
  const JobConfig config = *ParseJobSpec(spec);
  EXPECT_TRUE(client.Register(spec, 0).ok());
  EXPECT_TRUE(client.JoinAll(spec).ok());
  std::vector<float> params(config.map.total_elements());
  for (size_t i = 0; i < params.size(); ++i) params[i] = 0.5f * static_cast<float>(i % 97);
  grpc::Status s = client.Init(ParamChunks("job", {0, params.size()}, params.data()));
  EXPECT_TRUE(s.ok()) << s.error_message();
  v1::ExchangeEndpointResponse endpoint;
  s = Exchange(client, "job", 0, &endpoint, v1::TRANSPORT_KIND_GRPC);
  EXPECT_TRUE(s.ok()) << s.error_message();
  if (!s.ok()) return "";
  EXPECT_EQ(endpoint.worker_address(), daemon.bulk_transport()->LocalAddress());
  EXPECT_EQ(endpoint.worker_address().rfind(host + ":", 0), 0u)
      << endpoint.worker_address() << " does not start with " << host << ":";
  std::unique_ptr<transport::Transport> peer = *transport::CreateTransport("grpc");
  absl::StatusOr<std::unique_ptr<transport::Connection>> conn =
      peer->Connect(endpoint.worker_address(), absl::Now() + absl::Seconds(10));
  EXPECT_TRUE(conn.ok()) << conn.status();
  if (!conn.ok()) return endpoint.worker_address();
  EXPECT_EQ(endpoint.regions(1).purpose(), v1::REGION_PURPOSE_PARAM_MASTER);
  transport::RegionDescriptor master;
  master.address = endpoint.regions(1).address();
  master.length = endpoint.regions(1).length();
  master.rkey = endpoint.regions(1).rkey();
  std::vector<float> out(params.size(), -1.0f);
  EXPECT_EQ((*conn)->Get(out.data(), out.size() * 4, master, 0).Wait(
                absl::Now() + absl::Seconds(10)),
            absl::OkStatus());
  EXPECT_EQ(out, params);
  return endpoint.worker_address();
}

// Issue 38: the grpc bulk transport listened on, and advertised, 127.0.0.1
// whatever --listen said, so trainers on other machines could not reach it.
TEST(DaemonBulkGrpcAddressTest, ServesAndAdvertisesTheListenHost) {
  const std::string ip = NonLoopbackIpv4();
  if (ip.empty()) GTEST_SKIP() << "no non-loopback IPv4 address on this machine";
  std::unique_ptr<Daemon> daemon = StartGrpcBulkDaemon(ip + ":0");
  ASSERT_NE(daemon, nullptr);
  ASSERT_NE(daemon->bulk_transport(), nullptr);
  ExpectTrainerReadsThrough(*daemon, ip);
}

TEST(DaemonBulkGrpcAddressTest, AdvertiseAddressIsWhatTrainersAreGiven) {
  const std::string ip = NonLoopbackIpv4();
  if (ip.empty()) GTEST_SKIP() << "no non-loopback IPv4 address on this machine";
  std::unique_ptr<Daemon> daemon = StartGrpcBulkDaemon("0.0.0.0:0", ip);
  ASSERT_NE(daemon, nullptr);
  ASSERT_NE(daemon->bulk_transport(), nullptr);
  ExpectTrainerReadsThrough(*daemon, ip);
}

TEST(DaemonBulkGrpcAddressTest, WildcardListenAdvertisesThePrimaryAddress) {
  if (NonLoopbackIpv4().empty()) {
    GTEST_SKIP() << "no non-loopback IPv4 address on this machine";
  }
  const absl::StatusOr<std::string> primary = transport::PrimaryHostAddress();
  ASSERT_TRUE(primary.ok()) << primary.status();
  std::unique_ptr<Daemon> daemon = StartGrpcBulkDaemon("0.0.0.0:0");
  ASSERT_NE(daemon, nullptr);
  ASSERT_NE(daemon->bulk_transport(), nullptr);
  const std::string advertised = ExpectTrainerReadsThrough(*daemon, *primary);
  EXPECT_NE(advertised.rfind("0.0.0.0:", 0), 0u) << advertised;
  EXPECT_NE(advertised.rfind("127.", 0), 0u) << advertised;
}

TEST(DaemonBulkGrpcAddressTest, LoopbackListenStaysLoopback) {
  std::unique_ptr<Daemon> daemon = StartGrpcBulkDaemon("127.0.0.1:0");
  ASSERT_NE(daemon, nullptr);
  ASSERT_NE(daemon->bulk_transport(), nullptr);
  ExpectTrainerReadsThrough(*daemon, "127.0.0.1");
}

TEST(DaemonBulkGrpcAddressTest, AddressOptionsAreChecked) {
  struct Case {
    const char* bulk_transport;
    const char* bulk_listen;
    const char* advertise;
    bool insecure;
    const char* field;
  };
  for (const Case& c : {
           // UCX's worker address carries the interfaces UCX chose.
           Case{"ucx", "", "10.0.0.5", true, "--advertise_address"},
           Case{"inproc", "127.0.0.1:0", "", true, "--bulk_listen_address"},
           Case{"grpc", "", "10.0.0.5:7070", true, "--advertise_address"},
           Case{"grpc", "", "0.0.0.0", true, "--advertise_address"},
           Case{"grpc", "nonsense", "", true, "--bulk_listen_address"},
           // Plaintext bulk bytes and keys on the network need --insecure.
           Case{"grpc", "0.0.0.0:0", "10.0.0.5", false, "--bulk_listen_address"},
       }) {
    SCOPED_TRACE(absl::StrCat(c.bulk_transport, " ", c.bulk_listen, " ", c.advertise));
    DaemonOptions o;
    o.bulk_transport = c.bulk_transport;
    o.bulk_listen = c.bulk_listen;
    o.advertise_address = c.advertise;
    o.insecure = c.insecure;
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
    ASSERT_FALSE(d.ok());
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << d.status();
    EXPECT_NE(d.status().message().find(c.field), std::string::npos) << d.status();
  }
  // --bulk_listen_address alone picks the interface and port.
  DaemonOptions o;
  o.bulk_transport = "grpc";
  o.bulk_listen = "localhost:0";
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_NE((*d)->bulk_transport(), nullptr);
  ExpectTrainerReadsThrough(**d, "localhost");
}

// A --bulk_listen_address that cannot be served (its port is taken) stops
// the daemon from starting, instead of falling back to the streaming path.
TEST(DaemonBulkGrpcAddressTest, AnExplicitBulkAddressThatCannotBeServedIsFatal) {
  DaemonOptions first;
  first.bulk_transport = "grpc";
  first.bulk_listen = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<Daemon>> taken = Daemon::Start(first);
  ASSERT_TRUE(taken.ok()) << taken.status();
  ASSERT_NE((*taken)->bulk_transport(), nullptr);
  DaemonOptions o;
  o.bulk_transport = "grpc";
  o.bulk_listen = (*taken)->bulk_transport()->LocalAddress();
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_FALSE(d.ok()) << "started on a bulk address another daemon holds";
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition) << d.status();
  EXPECT_NE(d.status().message().find("--bulk_listen_address=" + o.bulk_listen),
            std::string::npos)
      << d.status();
}

TEST(DaemonBulkOffTest, ExchangeWithoutBulkTransportIsUnavailable) {
  std::unique_ptr<Daemon> daemon = testing::StartDaemon();
  DaemonClient client(daemon->address());
  v1::JobSpec spec = MakeSpec("job", SampleLayout(), 2, 1, {daemon->address()});
  ASSERT_TRUE(client.Register(spec, 0).ok());
  v1::ExchangeEndpointResponse r;
  grpc::Status s = Exchange(client, "job", 0, &r, v1::TRANSPORT_KIND_UCX);
  EXPECT_EQ(s.error_code(), grpc::UNAVAILABLE) << s.error_message();
  EXPECT_NE(s.error_message().find("stream"), std::string::npos) << s.error_message();
  ASSERT_TRUE(client.Join(spec, 0).ok());
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
