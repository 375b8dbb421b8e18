// The Activation service's bulk path over the inproc transport: the arena is
// handed out by ExchangeEndpoint; a trainer reserves, puts and commits, then
// locates and gets, through an arena a tenth of what it stores; a commit
// whose bytes do not match is DATA_LOSS and drops the reservation, one
// without a checksum is stored as put; an
// uncommitted reservation expires with the read lease; bad input changes
// nothing.

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/job_spec.h"
#include "common/protocol.h"
#include "gtest/gtest.h"
#include "server/testing/activation_testing.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"
#include "transport/transport.h"

namespace zeroshard {
namespace {

using testing::ActivationClient;
using testing::DaemonClient;
using testing::MakeKey;
using testing::MakeOwner;
using testing::PatternBytes;

constexpr uint64_t kArena = 1 << 20;
constexpr int kAct = static_cast<int>(MemoryCategory::kActivation);

class ActivationBulkTest : public ::testing::Test {
 protected:
  void SetUp() override { StartWith(absl::Seconds(30)); }

  void StartWith(absl::Duration lease) {
    spill_dir_ = testing::TestDir(
        absl::StrCat("bulk_", ::testing::UnitTest::GetInstance()->current_test_info()->name()));
    DaemonOptions o;
    o.listen = "127.0.0.1:0";
    o.bulk_transport = "inproc";
    o.read_lease = lease;
    o.activation_arena_bytes = kArena;
    o.spill_dir = spill_dir_;
    o.spill_bytes = 32 << 20;
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    ASSERT_NE(daemon_->bulk_transport(), nullptr);
    client_ = std::make_unique<DaemonClient>(daemon_->address());
    act_ = std::make_unique<ActivationClient>(daemon_->address());
    spec_ = testing::MakeSpec("job", testing::SampleLayout(), 3, 2, {daemon_->address()});
    ASSERT_TRUE(client_->Register(spec_, 0).ok());
    ASSERT_TRUE(client_->JoinAll(spec_).ok());
    std::string worker;
    ASSERT_NO_FATAL_FAILURE(ExchangeArena("job", &arena_, &worker));
    EXPECT_EQ(arena_.length, daemon_->activations()->region_bytes());
    EXPECT_EQ(daemon_->activations()->capacity(), kArena);
    transport_ = *transport::CreateTransport("inproc");
    absl::StatusOr<std::unique_ptr<transport::Connection>> conn =
        transport_->Connect(worker, absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(conn.ok()) << conn.status();
    conn_ = *std::move(conn);
  }

  // Rank 0 of `job` exchanges endpoints: the arena comes with it, after the
  // rank's own regions.
  void ExchangeArena(const std::string& job, transport::RegionDescriptor* arena,
                     std::string* worker) {
    grpc::ClientContext ctx;
    v1::ExchangeEndpointRequest req;
    req.set_job_id(job);
    req.set_rank(0);
    req.set_incarnation(testing::kTestIncarnation);
    req.set_transport(v1::TRANSPORT_KIND_INPROC);
    v1::ExchangeEndpointResponse endpoint;
    grpc::Status s = client_->shard->ExchangeEndpoint(&ctx, req, &endpoint);
    ASSERT_TRUE(s.ok()) << s.error_message();
    int arenas = 0;
    for (const v1::RemoteRegion& r : endpoint.regions()) {
      if (r.purpose() != v1::REGION_PURPOSE_ACTIVATION_ARENA) continue;
      ++arenas;
      arena->address = r.address();
      arena->length = r.length();
      arena->rkey = r.rkey();
    }
    ASSERT_EQ(arenas, 1);
    *worker = endpoint.worker_address();
  }

  static absl::Time Deadline() { return absl::Now() + absl::Seconds(30); }

  grpc::Status Offload(const v1::ActivationOwner& owner, const v1::ActivationKey& key,
                       const std::string& bytes, v1::ActivationPlacement* placed = nullptr) {
    v1::ActivationPlacement p;
    grpc::Status s = act_->Reserve(owner, key, bytes.size(), &p);
    if (!s.ok()) return s;
    if (placed != nullptr) *placed = p;
    EXPECT_EQ(p.bytes(), bytes.size());
    EXPECT_TRUE(conn_->Put(bytes.data(), bytes.size(), arena_, p.offset()).Wait(Deadline()).ok());
    v1::ActivationStored stored;
    s = act_->Commit(owner, key, Crc32c(bytes.data(), bytes.size()), &stored);
    if (s.ok()) EXPECT_EQ(stored.bytes(), bytes.size());
    return s;
  }

  grpc::Status Get(const v1::ActivationOwner& owner, const v1::ActivationKey& key,
                   std::string* out, bool* was_spilled = nullptr) {
    v1::ActivationPlacement p;
    grpc::Status s = act_->Locate(owner, key, &p);
    if (!s.ok()) return s;
    out->assign(p.bytes(), '\0');
    EXPECT_TRUE(conn_->Get(out->data(), out->size(), arena_, p.offset()).Wait(Deadline()).ok());
    EXPECT_EQ(Crc32c(out->data(), out->size()), p.crc32c());
    if (was_spilled != nullptr) *was_spilled = p.was_spilled();
    return s;
  }

  template <typename Call>
  void ExpectRejected(grpc::StatusCode code, const std::string& text, Call call) {
    testing::ExpectActivationRejected(*daemon_, "job", code, text, call);
  }

  uint64_t Activation() { return daemon_->ledger().JobBytes("job")[kAct]; }

  std::string spill_dir_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<DaemonClient> client_;
  std::unique_ptr<ActivationClient> act_;
  v1::JobSpec spec_;
  transport::RegionDescriptor arena_;
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<transport::Connection> conn_;
};

// The arena's key is the tenancy's own: when the tenant job ends and another
// becomes the tenant, a key the first one kept reaches nothing, while the
// new tenant's key works over the same connection.
TEST_F(ActivationBulkTest, AFormerTenantsKeyReachesNothing) {
  const std::string bytes = PatternBytes(7, 4096);
  ASSERT_TRUE(conn_->Put(bytes.data(), bytes.size(), arena_, 0).Wait(Deadline()).ok());
  const transport::RegionDescriptor old_key = arena_;
  for (uint32_t rank = 0; rank < spec_.world_size(); ++rank) {
    grpc::ClientContext ctx;
    v1::LeaveRequest req;
    req.set_job_id("job");
    req.set_rank(rank);
    req.set_incarnation(testing::kTestIncarnation);
    v1::LeaveResponse resp;
    ASSERT_TRUE(client_->control->Leave(&ctx, req, &resp).ok());
  }
  ASSERT_FALSE(daemon_->jobs().Find("job").ok());
  EXPECT_FALSE(conn_->Put(bytes.data(), bytes.size(), old_key, 0).Wait(Deadline()).ok())
      << "the key of a job that ended still writes the arena";

  const v1::JobSpec next =
      testing::MakeSpec("next", testing::SampleLayout(), 3, 2, {daemon_->address()});
  ASSERT_TRUE(client_->Register(next, 0).ok());
  ASSERT_TRUE(client_->JoinAll(next).ok());
  transport::RegionDescriptor new_key;
  std::string worker;
  ASSERT_NO_FATAL_FAILURE(ExchangeArena("next", &new_key, &worker));
  EXPECT_NE(new_key.rkey, old_key.rkey);
  EXPECT_FALSE(conn_->Put(bytes.data(), bytes.size(), old_key, 0).Wait(Deadline()).ok())
      << "the former tenant's key reaches the next tenant's arena";
  std::string back(bytes.size(), '\0');
  EXPECT_FALSE(conn_->Get(back.data(), back.size(), old_key, 0).Wait(Deadline()).ok());
  EXPECT_TRUE(conn_->Put(bytes.data(), bytes.size(), new_key, 0).Wait(Deadline()).ok());
  EXPECT_TRUE(conn_->Get(back.data(), back.size(), new_key, 0).Wait(Deadline()).ok());
  EXPECT_EQ(back, bytes);
}

// Ten times the arena over the bulk path, two ranks: every located slice
// reads back byte for byte, the ones spilled say so, and freeing the steps
// removes every spill file.
TEST_F(ActivationBulkTest, PutsAndGetsTenTimesTheArena) {
  auto bytes_of = [](uint32_t rank, uint64_t step, uint32_t layer) {
    return PatternBytes(rank * 1000 + step * 100 + layer, (104 << 10) + 333 * layer + rank);
  };
  uint64_t offloaded = 0;
  for (uint64_t step = 1; step <= 5; ++step) {
    for (uint32_t layer = 0; layer < 10; ++layer) {
      for (uint32_t rank = 0; rank < 2; ++rank) {
        const std::string b = bytes_of(rank, step, layer);
        grpc::Status s = Offload(MakeOwner("job", rank), MakeKey(step, layer), b);
        ASSERT_TRUE(s.ok()) << "step " << step << " layer " << layer << ": " << s.error_message();
        offloaded += b.size();
      }
    }
  }
  EXPECT_GE(offloaded, 10 * kArena);
  EXPECT_GT(testing::SpillFilesIn(spill_dir_), 0u);
  int spilled = 0;
  for (uint64_t step = 5; step >= 1; --step) {
    for (int layer = 9; layer >= 0; --layer) {
      for (uint32_t rank = 0; rank < 2; ++rank) {
        const v1::ActivationOwner owner = MakeOwner("job", rank);
        if (layer > 0) ASSERT_TRUE(act_->Prefetch(owner, {MakeKey(step, layer - 1)}).ok());
        std::string got;
        bool was_spilled = false;
        grpc::Status s = Get(owner, MakeKey(step, layer), &got, &was_spilled);
        ASSERT_TRUE(s.ok()) << "step " << step << " layer " << layer << ": " << s.error_message();
        EXPECT_TRUE(got == bytes_of(rank, step, layer)) << "step " << step << " layer " << layer;
        spilled += was_spilled;
        // Located slices stay pinned until freed: free each after use.
        const v1::ActivationKey key = MakeKey(step, layer);
        ASSERT_TRUE(act_->Free(owner, &key).ok());
      }
    }
  }
  EXPECT_GT(spilled, 0);
  EXPECT_EQ(testing::MetricValue(*daemon_, "zeroshard_activation_misses_total{job=\"job\"}"),
            spilled);
  EXPECT_EQ(testing::SettledSpillFiles(*daemon_->activations(), spill_dir_), 0u);
  EXPECT_EQ(Activation(), 0u);
  EXPECT_GT(testing::MetricValue(
                *daemon_, "zeroshard_comm_bytes_total{job=\"job\",op=\"offload\",transport=\"inproc\"}"),
            0);
}

TEST_F(ActivationBulkTest, CommitChecksTheBytesAndDropsABadReservation) {
  const v1::ActivationOwner owner = MakeOwner("job", 0);
  const std::string b = PatternBytes(5, 7000);
  const auto ledger = daemon_->ledger().Snapshot();
  v1::ActivationPlacement p;
  ASSERT_TRUE(act_->Reserve(owner, MakeKey(1, 0), b.size(), &p).ok());
  EXPECT_GE(Activation(), b.size());
  // Uncommitted: not there for a fetch.
  v1::ActivationPlacement located;
  EXPECT_EQ(act_->Locate(owner, MakeKey(1, 0), &located).error_code(), grpc::FAILED_PRECONDITION);
  // Half the bytes put: the CRC cannot match.
  ASSERT_TRUE(conn_->Put(b.data(), b.size() / 2, arena_, p.offset()).Wait(Deadline()).ok());
  grpc::Status s = act_->Commit(owner, MakeKey(1, 0), Crc32c(b.data(), b.size()));
  EXPECT_EQ(s.error_code(), grpc::DATA_LOSS) << s.error_message();
  EXPECT_NE(s.error_message().find("crc32c"), std::string::npos) << s.error_message();
  EXPECT_EQ(daemon_->ledger().Snapshot(), ledger) << "the reservation is dropped";
  EXPECT_EQ(act_->Commit(owner, MakeKey(1, 0), 0).error_code(), grpc::NOT_FOUND);
  // Done right, and committed twice with the same bytes: the second answers
  // like the first; with other bytes it is ALREADY_EXISTS.
  ASSERT_TRUE(Offload(owner, MakeKey(1, 0), b).ok());
  v1::ActivationStored stored;
  EXPECT_TRUE(act_->Commit(owner, MakeKey(1, 0), Crc32c(b.data(), b.size()), &stored).ok());
  EXPECT_EQ(stored.bytes(), b.size());
  ExpectRejected(grpc::ALREADY_EXISTS, "its commit carried CRC-32C",
                 [&] { return act_->Commit(owner, MakeKey(1, 0), 42); });
  std::string got;
  ASSERT_TRUE(Get(owner, MakeKey(1, 0), &got).ok());
  EXPECT_TRUE(got == b);
  // A commit without a CRC-32C is taken as put, and located without one;
  // again without one it answers like the first, with one it is
  // ALREADY_EXISTS.
  ASSERT_TRUE(act_->Reserve(owner, MakeKey(2, 0), b.size(), &p).ok());
  ASSERT_TRUE(conn_->Put(b.data(), b.size(), arena_, p.offset()).Wait(Deadline()).ok());
  ASSERT_TRUE(act_->Commit(owner, MakeKey(2, 0), std::nullopt, &stored).ok());
  EXPECT_EQ(stored.bytes(), b.size());
  ASSERT_TRUE(act_->Commit(owner, MakeKey(2, 0), std::nullopt, &stored).ok());
  ExpectRejected(grpc::ALREADY_EXISTS, "its commit carried no CRC-32C",
                 [&] { return act_->Commit(owner, MakeKey(2, 0), Crc32c(b.data(), b.size())); });
  ASSERT_TRUE(act_->Locate(owner, MakeKey(2, 0), &located).ok());
  EXPECT_FALSE(located.has_crc32c());
  got.assign(b.size(), '\0');
  ASSERT_TRUE(conn_->Get(got.data(), got.size(), arena_, located.offset()).Wait(Deadline()).ok());
  EXPECT_TRUE(got == b);
}

TEST_F(ActivationBulkTest, UncommittedReservationsExpireWithTheReadLease) {
  daemon_.reset();
  StartWith(absl::Milliseconds(200));
  const v1::ActivationOwner owner = MakeOwner("job", 0);
  const auto ledger = daemon_->ledger().Snapshot();
  v1::ActivationPlacement placement;
  ASSERT_TRUE(act_->Reserve(owner, MakeKey(1, 0), 5000, &placement).ok());
  EXPECT_EQ(placement.lease_ms(), 200u);  // the answer says so
  EXPECT_GT(Activation(), 0u);
  // The janitor drops it once the lease has passed.
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (Activation() != 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(Activation(), 0u);
  EXPECT_EQ(daemon_->ledger().Snapshot(), ledger);
  EXPECT_EQ(act_->Commit(owner, MakeKey(1, 0), 0).error_code(), grpc::NOT_FOUND);
}

TEST_F(ActivationBulkTest, BadInputChangesNothing) {
  const v1::ActivationOwner owner = MakeOwner("job", 0);
  // Pinned slices fill most of the arena: nothing can spill to make room.
  std::vector<std::string> pinned;
  for (uint32_t layer = 0; layer < 3; ++layer) {
    pinned.push_back(PatternBytes(layer, 300 << 10));
    ASSERT_TRUE(Offload(owner, MakeKey(1, layer), pinned.back()).ok());
    std::string got;
    ASSERT_TRUE(Get(owner, MakeKey(1, layer), &got).ok());
  }
  ASSERT_TRUE(act_->Reserve(owner, MakeKey(1, 8), 1000).ok());  // reserved, not committed
  const v1::ActivationKey freed = MakeKey(1, 9);
  ASSERT_TRUE(Offload(owner, freed, PatternBytes(9, 100)).ok());
  ASSERT_TRUE(act_->Free(owner, &freed).ok());

  ExpectRejected(grpc::RESOURCE_EXHAUSTED, "--activation_arena_bytes=1048576",
                 [&] { return act_->Reserve(owner, MakeKey(1, 3), 300 << 10); });
  ExpectRejected(grpc::RESOURCE_EXHAUSTED, "--spill_bytes=33554432",
                 [&] { return act_->Reserve(owner, MakeKey(1, 3), 300 << 10); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "bytes: 1048577 bytes is more than",
                 [&] { return act_->Reserve(owner, MakeKey(1, 3), kArena + 1); });
  ExpectRejected(grpc::ALREADY_EXISTS, "already reserved",
                 [&] { return act_->Reserve(owner, MakeKey(1, 8), 1000); });
  ExpectRejected(grpc::ALREADY_EXISTS, "already stored",
                 [&] { return act_->Reserve(owner, MakeKey(1, 0), 1000); });
  ExpectRejected(grpc::NOT_FOUND, "not registered",
                 [&] { return act_->Reserve(MakeOwner("other", 0), MakeKey(1, 3), 10); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "key.mp_rank",
                 [&] { return act_->Reserve(owner, MakeKey(1, 3, 0, 1, 1), 10); });
  v1::ActivationPlacement p;
  ExpectRejected(grpc::NOT_FOUND, "key: no activation",
                 [&] { return act_->Locate(owner, MakeKey(1, 7), &p); });
  ExpectRejected(grpc::NOT_FOUND, "key: no activation",
                 [&] { return act_->Locate(owner, freed, &p); });
  ExpectRejected(grpc::NOT_FOUND, "key: no activation",
                 [&] { return act_->Locate(MakeOwner("job", 1), MakeKey(1, 0), &p); });
  ExpectRejected(grpc::FAILED_PRECONDITION, "not committed",
                 [&] { return act_->Locate(owner, MakeKey(1, 8), &p); });
  ExpectRejected(grpc::NOT_FOUND, "not registered",
                 [&] { return act_->Locate(MakeOwner("other", 0), MakeKey(1, 0), &p); });
  ExpectRejected(grpc::NOT_FOUND, "key: no activation",
                 [&] { return act_->Commit(owner, freed, 0); });
  ExpectRejected(grpc::FAILED_PRECONDITION, "has not joined",
                 [&] { return act_->Commit(MakeOwner("job", 0, 99), MakeKey(1, 8), 0); });
  // FreeActivations ending a fetch read without locating (if_placement).
  const v1::ActivationKey k0 = MakeKey(1, 0), k7 = MakeKey(1, 7), k8 = MakeKey(1, 8);
  ExpectRejected(grpc::NOT_FOUND, "key: no activation",
                 [&] { return act_->Free(owner, &k7, false, nullptr, 1); });
  ExpectRejected(grpc::NOT_FOUND, "key: no activation",
                 [&] { return act_->Free(owner, &freed, false, nullptr, 1); });
  ExpectRejected(grpc::NOT_FOUND, "not registered",
                 [&] { return act_->Free(MakeOwner("other", 0), &k0, false, nullptr, 1); });
  ExpectRejected(grpc::FAILED_PRECONDITION, "not committed",
                 [&] { return act_->Free(owner, &k8, false, nullptr, 1); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "if_placement: 0 names no reservation",
                 [&] { return act_->Free(owner, &k0, false, nullptr, 0); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "if_placement: ends the fetch of one key",
                 [&] { return act_->Free(owner, &k0, /*whole_step=*/true, nullptr, 1); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "if_placement: ends the fetch of one key",
                 [&] { return act_->Free(owner, nullptr, false, nullptr, 1); });
  // Another reservation's number: `moved`, and nothing changes.
  {
    const uint64_t hash = daemon_->activations()->StateHash();
    const auto ledger = daemon_->ledger().Snapshot();
    v1::FreeActivationsResponse moved;
    ASSERT_TRUE(act_->Free(owner, &k0, false, &moved, uint64_t{1} << 40).ok());
    EXPECT_TRUE(moved.moved());
    EXPECT_EQ(moved.freed(), 0u);
    EXPECT_EQ(daemon_->activations()->StateHash(), hash);
    EXPECT_EQ(daemon_->ledger().Snapshot(), ledger);
  }
  // The pinned slices are intact.
  for (uint32_t layer = 0; layer < 3; ++layer) {
    std::string got;
    ASSERT_TRUE(Get(owner, MakeKey(1, layer), &got).ok());
    EXPECT_TRUE(got == pinned[layer]);
  }
}

// A Get where the slice was reserved, then a FreeActivations if_placement:
// the slice is freed and its bytes were the ones read.
TEST_F(ActivationBulkTest, AGetWhereTheSliceWasReservedEndsWithARelease) {
  const v1::ActivationOwner owner = MakeOwner("job", 0);
  const std::string bytes = PatternBytes(5, 200 << 10);
  const v1::ActivationKey key = MakeKey(2, 0), other = MakeKey(2, 1);
  v1::ActivationPlacement placed, placed_other;
  ASSERT_TRUE(Offload(owner, key, bytes, &placed).ok());
  ASSERT_TRUE(Offload(owner, other, bytes, &placed_other).ok());
  EXPECT_NE(placed.placement(), 0u);
  EXPECT_NE(placed.placement(), placed_other.placement());
  std::string got(bytes.size(), '\0');
  ASSERT_TRUE(conn_->Get(got.data(), got.size(), arena_, placed.offset()).Wait(Deadline()).ok());
  v1::FreeActivationsResponse r;
  // The other slice's reservation does not free this one.
  ASSERT_TRUE(act_->Free(owner, &key, false, &r, placed_other.placement()).ok());
  EXPECT_TRUE(r.moved());
  const grpc::Status s = act_->Free(owner, &key, false, &r, placed.placement());
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_FALSE(r.moved());
  EXPECT_EQ(r.freed(), 1u);
  EXPECT_EQ(r.bytes(), bytes.size());
  EXPECT_TRUE(got == bytes);
  v1::ActivationPlacement p;
  EXPECT_EQ(act_->Locate(owner, key, &p).error_code(), grpc::NOT_FOUND);
  ASSERT_TRUE(act_->Free(owner, &other, false, &r, placed_other.placement()).ok());
  EXPECT_EQ(r.freed(), 1u);
  EXPECT_EQ(Activation(), 0u);
}

}  // namespace
}  // namespace zeroshard
