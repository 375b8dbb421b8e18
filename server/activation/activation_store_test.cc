// The activation store on its own: the ledger booking of the arena (each
// job's blocks, the largest free block and the fragmentation add up to the
// arena), spilling a job ten times the arena to files and reading every
// slice back exactly, capacity limits that refuse and change nothing,
// reservation leases, and job removal.

#include "server/activation/activation_store.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/crc32c.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "server/activation/activation_store_testing.h"
#include "transport/transport.h"

namespace zeroshard {
namespace {

constexpr int kAct = static_cast<int>(MemoryCategory::kActivation);
constexpr int kFrag = static_cast<int>(MemoryCategory::kFragmentation);

std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  return absl::StrCat(base != nullptr ? base : "/tmp", "/", name);
}

using testing::SpillFilesIn;

std::string Pattern(uint64_t seed, size_t bytes) { return testing::PatternBytes(seed, bytes); }

ActivationKey Key(uint64_t step, uint32_t layer, uint32_t micro_batch = 0) {
  ActivationKey k;
  k.step = step;
  k.layer = layer;
  k.micro_batch = micro_batch;
  return k;
}

class StoreTest : public ::testing::Test {
 protected:
  // A store of `arena` bytes; `spill` bytes of spill files when > 0; over an
  // inproc transport when `bulk`.
  void Start(uint64_t arena, uint64_t spill = 0, bool bulk = false,
             absl::Duration lease = absl::Seconds(30)) {
    metrics_ = std::make_unique<ActivationMetrics>(&registry_);
    if (bulk) {
      server_ = *transport::CreateTransport("inproc");
      client_ = *transport::CreateTransport("inproc");
    }
    ActivationStore::Options o;
    o.arena_bytes = arena;
    if (spill > 0) {
      spill_dir_ = TempDir(absl::StrCat("store_spill_", ::testing::UnitTest::GetInstance()
                                                            ->current_test_info()
                                                            ->name()));
      o.spill_dir = spill_dir_;
      o.spill_bytes = spill;
    }
    o.reservation_lease = lease;
    o.janitor_period = absl::ZeroDuration();  // Tick() by hand
    o.idle_removals = idle_removals_;
    o.max_slices_per_job = max_slices_per_job_;
    absl::StatusOr<std::unique_ptr<ActivationStore>> s =
        ActivationStore::Create(o, server_.get(), &ledger_, metrics_.get());
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
    if (bulk) {
      v1::ExchangeEndpointResponse r;
      store_->FillRegion(&r);
      ASSERT_EQ(r.regions_size(), 0) << "a key before any tenancy";
      ASSERT_TRUE(store_->IssueTenantKey().ok());
      store_->FillRegion(&r);
      ASSERT_EQ(r.regions_size(), 1);
      ASSERT_EQ(r.regions(0).purpose(), v1::REGION_PURPOSE_ACTIVATION_ARENA);
      region_.address = r.regions(0).address();
      region_.length = r.regions(0).length();
      region_.rkey = r.regions(0).rkey();
      EXPECT_EQ(region_.length, store_->region_bytes());
      EXPECT_EQ(store_->capacity(), arena);
      conn_ = *client_->Connect(server_->LocalAddress(), absl::Now() + absl::Seconds(10));
    }
    instance_ = std::make_shared<int>(1);
  }

  SliceOwner Owner(const std::string& job = "a", uint32_t rank = 0) {
    SliceOwner o;
    o.job_id = job;
    o.instance = job == "a" ? instance_ : other_instance_;
    o.rank = rank;
    return o;
  }
  static absl::Time Deadline() { return absl::Now() + absl::Seconds(30); }

  // Offloads over the streaming path.
  absl::Status Offload(const SliceOwner& owner, const ActivationKey& key,
                       const std::string& bytes) {
    absl::StatusOr<std::unique_ptr<ActivationStore::Incoming>> in =
        store_->ReserveIncoming(owner, key, bytes.size(), Deadline());
    if (!in.ok()) return in.status();
    std::memcpy((*in)->data(), bytes.data(), bytes.size());
    return (*in)->Commit(Crc32c(bytes.data(), bytes.size()));
  }
  // Fetches over the streaming path.
  absl::StatusOr<std::string> FetchBytes(const SliceOwner& owner, const ActivationKey& key,
                                         bool* missed = nullptr) {
    std::string out;
    absl::Status s = store_->Fetch(owner, key, Deadline(), 1 << 20,
                                   [&](const SlicePlacement& p, uint64_t offset,
                                       absl::string_view data) {
                                     if (missed != nullptr) *missed = p.was_spilled;
                                     EXPECT_EQ(offset, out.size());
                                     out.append(data.data(), data.size());
                                     return true;
                                   });
    if (!s.ok()) return s;
    return out;
  }
  // Offloads over the bulk path: reserve, put, commit (with the CRC-32C of
  // the bytes, or none).
  absl::Status Put(const SliceOwner& owner, const ActivationKey& key, const std::string& bytes,
                   bool with_crc = true, SlicePlacement* placed = nullptr) {
    absl::StatusOr<SlicePlacement> p = store_->Reserve(owner, key, bytes.size(), Deadline());
    if (!p.ok()) return p.status();
    if (placed != nullptr) *placed = *p;
    EXPECT_EQ((region_.address + p->offset) % store_->alignment(), 0u);
    absl::Status put = conn_->Put(bytes.data(), bytes.size(), region_, p->offset).Wait(Deadline());
    if (!put.ok()) return put;
    return store_
        ->Commit(
            owner, key,
            with_crc ? std::optional<uint32_t>(Crc32c(bytes.data(), bytes.size())) : std::nullopt)
        .status();
  }
  // Locates and gets over the bulk path; checks the CRC the daemon answers,
  // if any.
  absl::StatusOr<std::string> Get(const SliceOwner& owner, const ActivationKey& key,
                                  bool* missed = nullptr) {
    absl::StatusOr<SlicePlacement> p = store_->Locate(owner, key, Deadline());
    if (!p.ok()) return p.status();
    std::string out(p->bytes, '\0');
    absl::Status get = conn_->Get(out.data(), out.size(), region_, p->offset).Wait(Deadline());
    if (!get.ok()) return get;
    if (p->crc32c.has_value()) EXPECT_EQ(Crc32c(out.data(), out.size()), *p->crc32c);
    if (missed != nullptr) *missed = p->was_spilled;
    return out;
  }

  // The booking is exact: every job's blocks, the largest free block and
  // the fragmentation add up to the arena.
  void ExpectExactBooking() {
    const ActivationStore::Stats st = store_->GetStats();
    uint64_t sum = 0;
    for (const auto& [job, bytes] : ledger_.Snapshot()) {
      sum += bytes[kAct] + bytes[kFrag];
      for (int c = 0; c < kNumMemoryCategories; ++c) {
        if (c != kAct && c != kFrag) EXPECT_EQ(bytes[c], 0u) << job << " " << c;
      }
    }
    EXPECT_EQ(sum, store_->region_bytes());
    EXPECT_EQ(ledger_.total(), store_->region_bytes());
    const CategoryBytes daemon = ledger_.JobBytes(kDaemonLedgerEntry);
    EXPECT_EQ(daemon[kAct], st.arena_largest_free);
    EXPECT_EQ(daemon[kFrag], st.fragmentation + store_->region_bytes() - store_->capacity());
  }

  uint64_t JobActivation(const std::string& job) { return ledger_.JobBytes(job)[kAct]; }

  size_t SettledSpillFiles() { return testing::SettledSpillFiles(*store_, spill_dir_); }

  // The ledger's entries that hold any bytes.
  std::map<std::string, CategoryBytes> Ledger() const {
    std::map<std::string, CategoryBytes> out;
    for (const auto& [job, bytes] : ledger_.Snapshot()) {
      if (bytes != CategoryBytes{}) out[job] = bytes;
    }
    return out;
  }

  double Sample(const std::string& series) {
    const std::string text = prometheus::TextSerializer().Serialize(registry_.Collect());
    for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
      if (absl::StartsWith(line, series + " ")) {
        double v = 0;
        EXPECT_TRUE(absl::SimpleAtod(line.substr(series.size() + 1), &v));
        return v;
      }
    }
    return 0;
  }

  MemoryLedger ledger_{0};
  prometheus::Registry registry_;
  std::unique_ptr<ActivationMetrics> metrics_;
  std::unique_ptr<transport::Transport> server_;
  std::unique_ptr<transport::Transport> client_;
  std::unique_ptr<transport::Connection> conn_;
  transport::RegionDescriptor region_;
  std::string spill_dir_;
  bool idle_removals_ = true;  // Start's ActivationStore::Options::idle_removals
  size_t max_slices_per_job_ = size_t{1} << 16;
  std::shared_ptr<int> instance_;
  std::shared_ptr<int> other_instance_ = std::make_shared<int>(2);
  std::unique_ptr<ActivationStore> store_;
};

// A tenancy (the arena's key lent to one job) starts only while no other
// job has a slice in the arena or its spill files, on an arena whose bytes
// outside the tenant's own blocks are zero (what a former job left in a
// freed block is not readable with the key), and keeps other jobs' slices
// out until it ends.
TEST_F(StoreTest, ATenancyStartsOnAZeroedArenaAndKeepsOtherJobsOut) {
  Start(1 << 20, 0, /*bulk=*/true);
  auto region_bytes = [&] {
    std::string all(region_.length, '\0');
    EXPECT_TRUE(conn_->Get(all.data(), all.size(), region_, 0).Wait(Deadline()).ok());
    return all;
  };
  const std::string left = Pattern(7, 8192), kept = Pattern(9, 4096);
  ASSERT_TRUE(Offload(Owner("b"), Key(1, 0), left).ok());
  EXPECT_FALSE(store_->BeginTenancy(instance_, "a")) << "job b has a slice";
  ASSERT_TRUE(store_->FreeKey(Owner("b"), Key(1, 0)).ok());
  ASSERT_NE(region_bytes().find(left), std::string::npos) << "a freed block keeps its bytes";
  // Another job's freed reservation keeps its block out its lease (a Put
  // may still land there): not yet either.
  ASSERT_TRUE(store_->Reserve(Owner("c"), Key(1, 5), 4096, Deadline()).ok());
  ASSERT_TRUE(store_->FreeKey(Owner("c"), Key(1, 5)).ok());
  EXPECT_FALSE(store_->BeginTenancy(instance_, "a"));
  store_->Tick(absl::Now() + absl::Seconds(31));
  ASSERT_TRUE(Put(Owner("a"), Key(1, 1), kept).ok());
  ASSERT_TRUE(store_->BeginTenancy(instance_, "a"));
  EXPECT_TRUE(store_->BeginTenancy(instance_, "a")) << "the tenant again";
  std::string all = region_bytes();
  EXPECT_EQ(all.find(left), std::string::npos);
  // All zero but the tenant's slice, which is intact.
  const size_t at = all.find(kept);
  ASSERT_NE(at, std::string::npos);
  all.replace(at, kept.size(), kept.size(), '\0');
  EXPECT_EQ(all, std::string(all.size(), '\0'));
  absl::StatusOr<std::string> got = Get(Owner("a"), Key(1, 1));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, kept);
  // Other jobs are kept out, on both paths; the tenant is not.
  absl::Status s = Offload(Owner("b"), Key(1, 2), left);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "lent to job a")) << s;
  s = Put(Owner("b"), Key(1, 3), left);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_FALSE(store_->BeginTenancy(other_instance_, "b"));
  EXPECT_TRUE(Offload(Owner("a"), Key(1, 4), left).ok());
  store_->EndTenancy();
  EXPECT_TRUE(Offload(Owner("b"), Key(1, 2), left).ok());
  EXPECT_FALSE(store_->BeginTenancy(instance_, "a")) << "job b has a slice again";
}

TEST_F(StoreTest, BooksTheArenaAsJobsActivationFreeBlockAndFragmentation) {
  Start(1 << 20);
  EXPECT_EQ(store_->region_bytes(), (1u << 20) + 64);
  EXPECT_EQ(store_->capacity(), 1u << 20);
  EXPECT_EQ(ledger_.total(), store_->region_bytes());
  EXPECT_EQ(ledger_.JobBytes(kDaemonLedgerEntry)[kAct], 1u << 20);
  EXPECT_EQ(ledger_.JobBytes(kDaemonLedgerEntry)[kFrag], 64u);
  ExpectExactBooking();
  // Forward: ten layers of two jobs, interleaved.
  for (uint32_t layer = 0; layer < 10; ++layer) {
    ASSERT_TRUE(Offload(Owner("a"), Key(1, layer), Pattern(layer, 30000 + layer)).ok());
    ASSERT_TRUE(Offload(Owner("b"), Key(1, layer), Pattern(100 + layer, 20000)).ok());
    ExpectExactBooking();
  }
  uint64_t expected_a = 0;
  for (uint32_t layer = 0; layer < 10; ++layer) expected_a += (30000 + layer + 63) / 64 * 64;
  EXPECT_EQ(JobActivation("a"), expected_a);
  EXPECT_EQ(JobActivation("b"), 10u * 20032);
  EXPECT_EQ(store_->GetStats().fragmentation, 0u);
  // Job b leaves holes between a's slices: fragmentation, booked as such.
  ASSERT_TRUE(store_->FreeStep(Owner("b"), 1).ok());
  EXPECT_EQ(JobActivation("b"), 0u);
  EXPECT_GT(store_->GetStats().fragmentation, 0u);
  EXPECT_EQ(store_->GetStats().fragmentation, 9u * 20032);  // nine holes below the free tail
  ExpectExactBooking();
  // a's backward frees in reverse: the holes merge back.
  for (int layer = 9; layer >= 0; --layer) {
    absl::StatusOr<std::string> got = FetchBytes(Owner("a"), Key(1, layer));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, Pattern(layer, 30000 + layer));
    ASSERT_TRUE(store_->FreeKey(Owner("a"), Key(1, layer)).ok());
    ExpectExactBooking();
  }
  EXPECT_EQ(store_->GetStats().fragmentation, 0u);
  EXPECT_EQ(ledger_.JobBytes(kDaemonLedgerEntry)[kAct], store_->capacity());
  EXPECT_EQ(Sample("zeroshard_activation_hits_total{job=\"a\"}"), 10);
}

TEST_F(StoreTest, RefusedRequestsChangeNothing) {
  Start(1 << 20);
  ASSERT_TRUE(Offload(Owner(), Key(1, 0), Pattern(1, 600000)).ok());
  const uint64_t hash = store_->StateHash();
  const auto ledger = Ledger();
  auto unchanged = [&] {
    EXPECT_EQ(store_->StateHash(), hash);
    EXPECT_EQ(Ledger(), ledger);
  };
  // Past the arena: InvalidArgument.
  absl::Status s = store_->Reserve(Owner(), Key(1, 1), (1 << 20) + 1, Deadline()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("--activation_arena_bytes"), std::string::npos) << s;
  unchanged();
  // Fits the arena but not next to what is stored, and nothing can spill:
  // ResourceExhausted naming both sizes.
  s = store_->Reserve(Owner(), Key(1, 1), 600000, Deadline()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("--activation_arena_bytes=1048576"), std::string::npos) << s;
  EXPECT_NE(s.message().find("spill space is 0"), std::string::npos) << s;
  unchanged();
  EXPECT_EQ(Offload(Owner(), Key(1, 1), Pattern(2, 600000)).code(),
            absl::StatusCode::kResourceExhausted);
  unchanged();
  // The same key again.
  EXPECT_EQ(store_->Reserve(Owner(), Key(1, 0), 10, Deadline()).status().code(),
            absl::StatusCode::kAlreadyExists);
  unchanged();
  // Unknown keys (another layer, another rank, another micro-batch).
  EXPECT_EQ(store_->Locate(Owner(), Key(1, 5), Deadline()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(FetchBytes(Owner("a", 1), Key(1, 0)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->FreeKey(Owner(), Key(1, 0, 1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Commit(Owner(), Key(2, 0), 0).status().code(), absl::StatusCode::kNotFound);
  unchanged();
  // Committing the stored slice again: the same CRC is answered like the
  // first commit; another is ALREADY_EXISTS.
  const std::string first = Pattern(1, 600000);
  EXPECT_EQ(*store_->Commit(Owner(), Key(1, 0), Crc32c(first.data(), first.size())), 600000u);
  EXPECT_EQ(store_->Commit(Owner(), Key(1, 0), 12345).status().code(),
            absl::StatusCode::kAlreadyExists);
  unchanged();
  // Freeing nothing of a step changes nothing either.
  absl::StatusOr<ActivationStore::Freed> none = store_->FreeStep(Owner(), 7);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->slices, 0u);
  unchanged();
}

TEST_F(StoreTest, BulkCommitChecksTheBytesPut) {
  Start(1 << 20, 0, /*bulk=*/true);
  const std::string bytes = Pattern(3, 5000);
  const auto before = Ledger();
  const uint64_t hash = store_->StateHash();
  absl::StatusOr<SlicePlacement> p = store_->Reserve(Owner(), Key(1, 0), bytes.size(), Deadline());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(JobActivation("a"), 5056u);
  // Not committed: not fetchable.
  EXPECT_EQ(store_->Locate(Owner(), Key(1, 0), Deadline()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(conn_->Put(bytes.data(), bytes.size(), region_, p->offset).Wait(Deadline()).ok());
  // A commit naming another CRC: DATA_LOSS and the reservation is gone.
  absl::Status s = store_->Commit(Owner(), Key(1, 0), Crc32c(bytes.data(), bytes.size()) ^ 1).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(store_->StateHash(), hash);
  EXPECT_EQ(Ledger(), before);
  EXPECT_EQ(store_->Commit(Owner(), Key(1, 0), 0).status().code(), absl::StatusCode::kNotFound);
  // Done right, it is stored and read back as it was put.
  ASSERT_TRUE(Put(Owner(), Key(1, 0), bytes).ok());
  absl::StatusOr<std::string> got = Get(Owner(), Key(1, 0));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, bytes);
  ExpectExactBooking();
}

// A commit without a CRC-32C trusts the transport: stored as put, with no
// checksum to report. Committed again: without one answers like the first
// commit, with one is ALREADY_EXISTS. Spilled, the slice gets the daemon's
// checksum before its bytes go to disk, so that a spill file that no longer
// holds them is DATA_LOSS on reading back, never wrong bytes.
TEST_F(StoreTest, CommitWithoutChecksumAndItsSpill) {
  constexpr uint64_t kSlice = 600000;
  Start(1 << 20, /*spill=*/16 << 20, /*bulk=*/true);
  const std::string a = Pattern(11, kSlice), b = Pattern(12, kSlice), c = Pattern(13, kSlice);
  ASSERT_TRUE(Put(Owner(), Key(1, 0), a, /*with_crc=*/false).ok());
  absl::StatusOr<SlicePlacement> p = store_->Locate(Owner(), Key(1, 0), Deadline());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->crc32c.has_value());
  EXPECT_EQ(*store_->Commit(Owner(), Key(1, 0), std::nullopt), kSlice);
  const uint64_t hash = store_->StateHash();
  absl::Status s = store_->Commit(Owner(), Key(1, 0), Crc32c(a.data(), a.size())).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_NE(s.message().find("its commit carried no CRC-32C"), std::string::npos) << s;
  EXPECT_EQ(store_->StateHash(), hash);
  ASSERT_TRUE(store_->FreeKey(Owner(), Key(1, 0)).ok());

  // b is spilled to make room for c, and read back intact (spilling c),
  // with the daemon's checksum.
  ASSERT_TRUE(Put(Owner(), Key(2, 0), b, /*with_crc=*/false).ok());
  ASSERT_TRUE(Put(Owner(), Key(2, 1), c, /*with_crc=*/false).ok());
  ASSERT_EQ(SpillFilesIn(spill_dir_), 1u);
  bool missed = false;
  absl::StatusOr<std::string> got = Get(Owner(), Key(2, 0), &missed);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(missed);
  EXPECT_TRUE(*got == b);
  p = store_->Locate(Owner(), Key(2, 0), Deadline());
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(p->crc32c.has_value());
  EXPECT_EQ(*p->crc32c, Crc32c(b.data(), b.size()));
  ASSERT_TRUE(store_->FreeKey(Owner(), Key(2, 0)).ok());

  // d fits where b was. c's file is damaged: reading it back (which spills
  // d to make room) is DATA_LOSS; d comes back intact.
  const std::string d = Pattern(14, kSlice);
  ASSERT_TRUE(Put(Owner(), Key(3, 0), d, /*with_crc=*/false).ok());
  ASSERT_EQ(SettledSpillFiles(), 1u);
  for (const auto& entry : std::filesystem::directory_iterator(spill_dir_)) {
    std::fstream f(entry.path(), std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.is_open()) << entry.path();
    f.seekp(12345);
    f.put(static_cast<char>(c[12345] ^ 0x10));
  }
  s = store_->Locate(Owner(), Key(2, 1), Deadline()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("spill file"), std::string::npos) << s;
  got = Get(Owner(), Key(3, 0));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(*got == d);
  ExpectExactBooking();
}

// A fetch that reads a slice where it was reserved, without locating it,
// and then releases it: freed only while it never left that reservation's
// block.
TEST_F(StoreTest, AReleaseAfterAnUnlocatedGetFreesOnlyASliceThatNeverMoved) {
  constexpr uint64_t kSlice = 600000;
  Start(1 << 20, /*spill=*/16 << 20, /*bulk=*/true);
  const std::string a = Pattern(21, kSlice), b = Pattern(22, kSlice), c = Pattern(23, kSlice);
  SlicePlacement at;
  ASSERT_TRUE(Put(Owner(), Key(1, 0), a, /*with_crc=*/false, &at).ok());
  EXPECT_NE(at.placement, 0u);
  std::string got(kSlice, '\0');
  ASSERT_TRUE(conn_->Get(got.data(), got.size(), region_, at.offset).Wait(Deadline()).ok());
  EXPECT_TRUE(got == a);
  const uint64_t hash = store_->StateHash();
  const auto ledger = Ledger();
  // Another reservation's number, another key, another rank: nothing
  // changes.
  absl::StatusOr<std::optional<ActivationStore::Freed>> r =
      store_->ReleaseFetched(Owner(), Key(1, 0), at.placement + 1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->has_value());
  EXPECT_EQ(store_->ReleaseFetched(Owner(), Key(1, 1), at.placement).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->ReleaseFetched(Owner("a", 1), Key(1, 0), at.placement).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->StateHash(), hash);
  EXPECT_EQ(Ledger(), ledger);
  EXPECT_EQ(Sample("zeroshard_activation_hits_total{job=\"a\"}"), 0);
  r = store_->ReleaseFetched(Owner(), Key(1, 0), at.placement);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->has_value());
  EXPECT_EQ((*r)->slices, 1u);
  EXPECT_EQ((*r)->bytes, kSlice);
  EXPECT_EQ(Sample("zeroshard_activation_hits_total{job=\"a\"}"), 1);
  EXPECT_EQ(store_->GetStats().slices, 0u);
  ExpectExactBooking();

  // The same key offloaded again, into the same block: the first
  // reservation's number no longer frees it.
  SlicePlacement again;
  ASSERT_TRUE(Put(Owner(), Key(1, 0), a, /*with_crc=*/false, &again).ok());
  EXPECT_EQ(again.offset, at.offset);
  r = store_->ReleaseFetched(Owner(), Key(1, 0), at.placement);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->has_value());
  // Reserved, not committed: FAILED_PRECONDITION.
  absl::StatusOr<SlicePlacement> reserved = store_->Reserve(Owner(), Key(1, 5), 1000, Deadline());
  ASSERT_TRUE(reserved.ok()) << reserved.status();
  EXPECT_EQ(store_->ReleaseFetched(Owner(), Key(1, 5), reserved->placement).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(store_->FreeStep(Owner(), 1).ok());

  // b is spilled to make room for c: it left its block, so the release
  // answers "moved" and keeps it; read back (wherever it lands), it is
  // still not in the block of its reservation.
  SlicePlacement at_b;
  ASSERT_TRUE(Put(Owner(), Key(2, 0), b, /*with_crc=*/false, &at_b).ok());
  ASSERT_TRUE(Put(Owner(), Key(2, 1), c, /*with_crc=*/false).ok());
  ASSERT_EQ(SettledSpillFiles(), 1u);
  const uint64_t spilled_hash = store_->StateHash();
  r = store_->ReleaseFetched(Owner(), Key(2, 0), at_b.placement);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->has_value());
  EXPECT_EQ(store_->StateHash(), spilled_hash);
  absl::StatusOr<std::string> back = Get(Owner(), Key(2, 0));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == b);
  r = store_->ReleaseFetched(Owner(), Key(2, 0), at_b.placement);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->has_value());
  ASSERT_TRUE(store_->FreeKey(Owner(), Key(2, 0)).ok());
  ExpectExactBooking();
}

TEST_F(StoreTest, UncommittedReservationsExpire) {
  Start(1 << 20, 0, /*bulk=*/false, /*lease=*/absl::Milliseconds(1));
  const auto before = Ledger();
  ASSERT_TRUE(store_->Reserve(Owner(), Key(1, 0), 1000, Deadline()).ok());
  // A stream's reservation never expires while the stream runs.
  absl::StatusOr<std::unique_ptr<ActivationStore::Incoming>> in =
      store_->ReserveIncoming(Owner(), Key(1, 1), 1000, Deadline());
  ASSERT_TRUE(in.ok());
  absl::SleepFor(absl::Milliseconds(5));
  store_->Tick();
  EXPECT_EQ(store_->Commit(Owner(), Key(1, 0), 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->GetStats().slices, 1u);
  in->reset();  // abandoned: dropped
  EXPECT_EQ(store_->GetStats().slices, 0u);
  EXPECT_EQ(Ledger(), before);
}

// The brief's spill check: an arena of 4 MiB and a job that offloads 40 MiB
// over two steps. Every fetch returns the right bytes, spills are counted,
// and the spill files go when the step is freed and when the job leaves.
TEST_F(StoreTest, SpillsAJobTenTimesTheArena) {
  constexpr uint64_t kArena = 4 << 20;
  Start(kArena, /*spill=*/256 << 20, /*bulk=*/true);
  std::printf("spill directory: O_DIRECT %s, alignment %lu\n",
              store_->spill_directory()->direct() ? "yes" : "no",
              static_cast<unsigned long>(store_->alignment()));
  constexpr uint32_t kLayers = 10;
  constexpr uint32_t kMicroBatches = 2;
  auto size_of = [](uint64_t step, uint32_t layer, uint32_t mb) {
    return (1 << 20) + 4099 * layer + 77 * mb + step;
  };
  auto bytes_of = [&](uint64_t step, uint32_t layer, uint32_t mb) {
    return Pattern(step * 1000 + layer * 10 + mb, size_of(step, layer, mb));
  };
  uint64_t offloaded = 0;
  const absl::Time start = absl::Now();
  for (uint64_t step = 1; step <= 2; ++step) {
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      for (uint32_t mb = 0; mb < kMicroBatches; ++mb) {
        // Step 1 goes over the bulk path, step 2 over the stream.
        const std::string b = bytes_of(step, layer, mb);
        absl::Status s = step == 1 ? Put(Owner(), Key(step, layer, mb), b)
                                   : Offload(Owner(), Key(step, layer, mb), b);
        ASSERT_TRUE(s.ok()) << "step " << step << " layer " << layer << ": " << s;
        offloaded += b.size();
        ExpectExactBooking();
      }
    }
  }
  EXPECT_GE(offloaded, 10 * kArena);
  const double forward_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const ActivationStore::Stats after_forward = store_->GetStats();
  EXPECT_GT(after_forward.spill_files, 0u);
  EXPECT_EQ(SpillFilesIn(spill_dir_), after_forward.spill_files);
  const double spills = Sample("zeroshard_activation_spills_total{job=\"a\"}");
  EXPECT_EQ(spills, static_cast<double>(after_forward.spill_files));
  EXPECT_GT(Sample("zeroshard_activation_spill_bytes_total{job=\"a\"}"), 30.0 * (1 << 20));
  std::printf("offloaded %.1f MiB into a %.0f MiB arena in %.3f s: %.0f spills, %zu files\n",
              offloaded / 1048576.0, kArena / 1048576.0, forward_seconds, spills,
              after_forward.spill_files);
  const absl::Time backward = absl::Now();

  // Backward of step 2, layers in reverse, prefetching two ahead; each slice
  // located, read and freed. The first are hits, the rest come back from
  // the files.
  int misses = 0;
  for (int layer = kLayers - 1; layer >= 0; --layer) {
    for (int mb = kMicroBatches - 1; mb >= 0; --mb) {
      std::vector<ActivationKey> ahead;
      for (int l = layer - 1; l >= std::max(0, layer - 2); --l) ahead.push_back(Key(2, l, mb));
      ASSERT_TRUE(store_->Prefetch(Owner(), ahead, Deadline()).ok());
      bool missed = false;
      absl::StatusOr<std::string> got = Get(Owner(), Key(2, layer, mb), &missed);
      ASSERT_TRUE(got.ok()) << "layer " << layer << ": " << got.status();
      EXPECT_TRUE(*got == bytes_of(2, layer, mb)) << "layer " << layer << " mb " << mb;
      misses += missed;
      ASSERT_TRUE(store_->FreeKey(Owner(), Key(2, layer, mb)).ok());
      ExpectExactBooking();
    }
  }
  std::printf("fetched step 2 (%d of %u slices read back) in %.3f s\n", misses,
              kLayers * kMicroBatches, absl::ToDoubleSeconds(absl::Now() - backward));
  EXPECT_GT(Sample("zeroshard_activation_hits_total{job=\"a\"}"), 0);
  EXPECT_EQ(Sample("zeroshard_activation_misses_total{job=\"a\"}"), misses);
  // Step 1's slices: fetched over the stream (not pinned), then the step
  // freed at once: its files are gone.
  for (uint32_t layer = 0; layer < kLayers; layer += 3) {
    absl::StatusOr<std::string> got = FetchBytes(Owner(), Key(1, layer, 1));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(*got == bytes_of(1, layer, 1)) << "layer " << layer;
  }
  absl::StatusOr<ActivationStore::Freed> freed = store_->FreeStep(Owner(), 1);
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(freed->slices, kLayers * kMicroBatches);
  EXPECT_EQ(store_->GetStats().spill_files, 0u);
  EXPECT_EQ(store_->GetStats().spill_used, 0u);
  EXPECT_EQ(SpillFilesIn(spill_dir_), 0u);
  EXPECT_EQ(JobActivation("a"), 0u);
  ExpectExactBooking();

  // Again, and this time the job leaves with everything stored.
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    ASSERT_TRUE(Offload(Owner(), Key(3, layer), bytes_of(3, layer, 0)).ok());
    ASSERT_TRUE(Offload(Owner(), Key(3, layer, 1), bytes_of(3, layer, 1)).ok());
  }
  EXPECT_GT(SpillFilesIn(spill_dir_), 0u);
  store_->RemoveJob("a", instance_);
  EXPECT_EQ(SpillFilesIn(spill_dir_), 0u);
  EXPECT_EQ(store_->GetStats().slices, 0u);
  EXPECT_EQ(JobActivation("a"), 0u);
  EXPECT_EQ(store_->Locate(Owner(), Key(3, 0), Deadline()).status().code(),
            absl::StatusCode::kNotFound);
  ExpectExactBooking();
}

// Arena and spill both full: RESOURCE_EXHAUSTED naming both sizes, and every
// slice stored before is still there, byte for byte.
TEST_F(StoreTest, PastArenaAndSpillNothingIsLost) {
  Start(1 << 20, /*spill=*/3 << 20);
  std::vector<std::string> stored;
  absl::Status s;
  for (uint32_t layer = 0; layer < 100; ++layer) {
    std::string b = Pattern(layer, 700000);
    s = Offload(Owner(), Key(1, layer), b);
    if (!s.ok()) break;
    stored.push_back(std::move(b));
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("--activation_arena_bytes=1048576"), std::string::npos) << s;
  EXPECT_NE(s.message().find("--spill_bytes=3145728"), std::string::npos) << s;
  EXPECT_GE(stored.size(), 4u);
  const uint64_t hash = store_->StateHash();
  const auto ledger = Ledger();
  EXPECT_EQ(store_->Reserve(Owner(), Key(1, 99), 700000, Deadline()).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store_->StateHash(), hash);
  EXPECT_EQ(Ledger(), ledger);
  // Backward reads each back and frees it: all survived.
  for (int layer = static_cast<int>(stored.size()) - 1; layer >= 0; --layer) {
    absl::StatusOr<std::string> got = FetchBytes(Owner(), Key(1, layer));
    ASSERT_TRUE(got.ok()) << "layer " << layer << ": " << got.status();
    EXPECT_TRUE(*got == stored[layer]) << "layer " << layer;
    ASSERT_TRUE(store_->FreeKey(Owner(), Key(1, layer)).ok());
  }
  EXPECT_EQ(SettledSpillFiles(), 0u);
  ExpectExactBooking();
}

// A job registered again is a new instance: the old one's slices are gone
// and its requests are refused.
TEST_F(StoreTest, RemovedJobInstanceKeepsNothing) {
  Start(1 << 20);
  ASSERT_TRUE(Offload(Owner(), Key(1, 0), Pattern(1, 1000)).ok());
  store_->RemoveJob("a", instance_);
  EXPECT_EQ(JobActivation("a"), 0u);
  EXPECT_EQ(Offload(Owner(), Key(1, 1), Pattern(1, 1000)).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->FreeAll(Owner()).status().code(), absl::StatusCode::kNotFound);
  // The same id, a new job object.
  SliceOwner fresh = Owner();
  fresh.instance = std::make_shared<int>(3);
  EXPECT_EQ(FetchBytes(fresh, Key(1, 0)).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(Offload(fresh, Key(1, 0), Pattern(2, 1000)).ok());
  // A late request of the removed instance finds nothing and harms nothing.
  EXPECT_EQ(Offload(Owner(), Key(1, 2), Pattern(1, 10)).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->FreeAll(Owner()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(FetchBytes(fresh, Key(1, 0)).ok());
  // Removing the old instance again leaves the new one alone.
  store_->RemoveJob("a", instance_);
  EXPECT_TRUE(FetchBytes(fresh, Key(1, 0)).ok());
  ExpectExactBooking();
  // Tombstones go once their job object is gone.
  instance_.reset();
  fresh.instance.reset();
  store_->RemoveJob("a", nullptr);
  store_->Tick();
  EXPECT_EQ(store_->GetStats().slices, 0u);
}

// Ranks offload, fetch and free concurrently through a small arena that
// spills; every byte comes back right and the booking stays exact.
TEST_F(StoreTest, ConcurrentRanksWithSpill) {
  Start(2 << 20, /*spill=*/64 << 20);
  std::vector<std::thread> ranks;
  std::atomic<int> failures{0};
  for (uint32_t rank = 0; rank < 4; ++rank) {
    ranks.emplace_back([&, rank] {
      for (uint64_t step = 1; step <= 3; ++step) {
        for (uint32_t layer = 0; layer < 6; ++layer) {
          const std::string b = Pattern(rank * 100 + step * 10 + layer, 200000 + layer * 1000);
          absl::Status s = Offload(Owner("a", rank), Key(step, layer), b);
          if (!s.ok()) {
            ADD_FAILURE() << s;
            ++failures;
          }
        }
        for (int layer = 5; layer >= 0; --layer) {
          absl::StatusOr<std::string> got = FetchBytes(Owner("a", rank), Key(step, layer));
          if (!got.ok() ||
              *got != Pattern(rank * 100 + step * 10 + layer, 200000 + layer * 1000)) {
            ADD_FAILURE() << "rank " << rank << " layer " << layer << " "
                          << (got.ok() ? "wrong bytes" : got.status().ToString());
            ++failures;
          }
        }
        if (!store_->FreeStep(Owner("a", rank), step).ok()) ++failures;
      }
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(store_->GetStats().slices, 0u);
  EXPECT_EQ(store_->GetStats().spill_files, 0u);
  EXPECT_EQ(SettledSpillFiles(), 0u);
  ExpectExactBooking();
}

// A reservation that comes while another waits for room plans its spills
// after the room of the one ahead, rather than count on the spill made for
// that one: here the second, which gives up at once (its deadline has
// passed), has all the same started the spill of the other stored slice.
TEST_F(StoreTest, WaitingReservationsPlanAfterTheRoomOfThoseAhead) {
  constexpr uint64_t kSlice = 8 << 20;
  Start(2 * kSlice, /*spill=*/8 * kSlice);
  ASSERT_TRUE(Offload(Owner(), Key(1, 0), Pattern(0, kSlice)).ok());
  ASSERT_TRUE(Offload(Owner(), Key(1, 1), Pattern(1, kSlice)).ok());
  absl::StatusOr<SlicePlacement> first;
  std::thread a([&] { first = store_->Reserve(Owner(), Key(2, 0), kSlice, Deadline()); });
  // The second comes once the first is waiting (or already served).
  const absl::Time give_up = Deadline();
  while (store_->GetStats().slices < 3 && absl::Now() < give_up) {
    absl::SleepFor(absl::Microseconds(50));
  }
  ASSERT_EQ(store_->GetStats().slices, 3u);
  if (store_->GetStats().in_flight == 0) {
    std::printf("the first reservation had its room already: nothing waited\n");
  }
  const absl::Status second =
      store_->Reserve(Owner(), Key(2, 1), kSlice, absl::Now() - absl::Seconds(1)).status();
  EXPECT_EQ(second.code(), absl::StatusCode::kDeadlineExceeded) << second;
  a.join();
  ASSERT_TRUE(first.ok()) << first.status();
  while (store_->GetStats().in_flight > 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(store_->GetStats().spill_files, 2u);
  EXPECT_EQ(SpillFilesIn(spill_dir_), 2u);
  for (uint32_t layer = 0; layer < 2; ++layer) {
    absl::StatusOr<std::string> got = FetchBytes(Owner(), Key(1, layer));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(*got == Pattern(layer, kSlice)) << "layer " << layer;
  }
}

// A free of a slice whose spill is under way (or not yet begun) waits for
// the write, and a job's free then returns with every file gone. (A single
// key's free leaves its file to the remover, which runs when the disk is
// idle: how soon depends on the machine's load, so it is not checked here.)
TEST_F(StoreTest, AFreeDuringASpillReturnsWithTheFileGone) {
  constexpr uint64_t kSlice = 8 << 20;
  Start(2 * kSlice, /*spill=*/8 * kSlice);
  for (uint64_t step = 1; step <= 4; ++step) {
    ASSERT_TRUE(Offload(Owner(), Key(step, 0), Pattern(step, kSlice)).ok());
    ASSERT_TRUE(Offload(Owner(), Key(step, 1), Pattern(step + 10, kSlice)).ok());
    // Room for the next step's first slice: (step, 0) is spilled for it.
    absl::StatusOr<SlicePlacement> next;
    std::thread a([&] { next = store_->Reserve(Owner(), Key(step + 100, 0), kSlice, Deadline()); });
    const absl::Time give_up = Deadline();
    while (store_->GetStats().slices < 3 && absl::Now() < give_up) {
      absl::SleepFor(absl::Microseconds(20));
    }
    ASSERT_TRUE(store_->FreeKey(Owner(), Key(step, 0)).ok());
    a.join();
    ASSERT_TRUE(next.ok()) << next.status();
    // Committed: freed at once (a freed reservation would keep its block
    // out its lease).
    ASSERT_TRUE(store_->Commit(Owner(), Key(step + 100, 0), std::nullopt).ok());
    ASSERT_TRUE(store_->FreeAll(Owner()).ok());
    EXPECT_EQ(store_->GetStats().spill_files, 0u);
    EXPECT_EQ(SpillFilesIn(spill_dir_), 0u);
  }
  ExpectExactBooking();
}

// A backward pass's read-backs drop their files; the files go once no
// read-back is in flight (or a spill needs their space), and before a free
// of the whole step returns. The files never hold more than --spill_bytes.
TEST_F(StoreTest, DroppedFilesGoOnceTheDiskIsIdleAndWithTheStep) {
  constexpr uint64_t kSlice = 4 << 20;
  constexpr uint32_t kLayers = 12;
  constexpr uint64_t kSpill = 10 * kSlice;  // the arena holds 2: the rest just fits
  Start(2 * kSlice, kSpill);
  auto within_budget = [&](const char* when) {
    EXPECT_LE(SpillFilesIn(spill_dir_) * kSlice, kSpill) << when;
  };
  int deferred = 0;  // times files were seen waiting for the disk
  for (uint64_t step = 1; step <= 3; ++step) {
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      ASSERT_TRUE(Offload(Owner(), Key(step, layer), Pattern(step * 100 + layer, kSlice)).ok());
      within_budget("after an offload");
    }
    std::vector<ActivationKey> hint;
    for (uint32_t layer = kLayers; layer-- > 0;) hint.push_back(Key(step, layer));
    ASSERT_TRUE(store_->Prefetch(Owner(), hint, Deadline()).ok());
    // Backward: fetch and free each slice; the next step's first slices
    // come while the last ones are still read back (their spills need the
    // space the dropped files take).
    const uint32_t last = step == 3 ? 0 : 4;
    for (uint32_t layer = kLayers; layer-- > last;) {
      absl::StatusOr<std::string> got = FetchBytes(Owner(), Key(step, layer));
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_TRUE(*got == Pattern(step * 100 + layer, kSlice)) << "layer " << layer;
      ASSERT_TRUE(store_->FreeKey(Owner(), Key(step, layer)).ok());
      const ActivationStore::Stats st = store_->GetStats();
      if (st.dropped_files > 0) ++deferred;
      EXPECT_EQ(st.dropped_bytes, st.dropped_files * kSlice);
      within_budget("after a free");
    }
    if (step < 3) {
      for (uint32_t layer = 0; layer < 4; ++layer) {
        ASSERT_TRUE(Offload(Owner(), Key(step + 10, layer), Pattern(7, kSlice)).ok());
        within_budget("after a spill beside read-backs");
      }
      ASSERT_TRUE(store_->FreeStep(Owner(), step).ok());
      EXPECT_EQ(store_->GetStats().dropped_files, 0u) << "step " << step;
      ASSERT_TRUE(store_->FreeStep(Owner(), step + 10).ok());
      EXPECT_EQ(SpillFilesIn(spill_dir_), 0u) << "step " << step;
    }
  }
  // The last step freed key by key: its files go once the reads end.
  const absl::Time give_up = Deadline();
  while (store_->GetStats().in_flight > 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(SettledSpillFiles(), 0u);
  EXPECT_EQ(store_->GetStats().dropped_files, 0u);
  EXPECT_EQ(store_->GetStats().spill_files, 0u);
  std::printf("files waited for the disk after %d of the frees\n", deferred);
  ExpectExactBooking();
}

// Without the remover thread, the files of slices read back stay (dropped)
// until a spill needs their space, which removes the oldest until the files
// fit --spill_bytes, or until the step is freed.
TEST_F(StoreTest, DroppedFilesGoWhenASpillNeedsTheirSpaceOrTheStepIsFreed) {
  constexpr uint64_t kSlice = 4 << 20;
  constexpr uint32_t kLayers = 12;
  constexpr uint64_t kSpill = 10 * kSlice;  // the arena holds 2: the rest just fits
  idle_removals_ = false;
  Start(2 * kSlice, kSpill);
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    ASSERT_TRUE(Offload(Owner(), Key(1, layer), Pattern(layer, kSlice)).ok());
  }
  ASSERT_EQ(store_->GetStats().spill_files, 10u);
  // Backward of the last 8 layers, reading ahead.
  std::vector<ActivationKey> hint;
  for (uint32_t layer = kLayers; layer-- > 0;) hint.push_back(Key(1, layer));
  ASSERT_TRUE(store_->Prefetch(Owner(), hint, Deadline()).ok());
  for (uint32_t layer = kLayers; layer-- > 4;) {
    absl::StatusOr<std::string> got = FetchBytes(Owner(), Key(1, layer));
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE(*got == Pattern(layer, kSlice)) << "layer " << layer;
    ASSERT_TRUE(store_->FreeKey(Owner(), Key(1, layer)).ok());
  }
  const absl::Time give_up = Deadline();
  while (store_->GetStats().in_flight > 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ActivationStore::Stats st = store_->GetStats();
  // Every file read back (layers 9 to 4 at least) is dropped, none removed.
  EXPECT_GE(st.dropped_files, 6u);
  EXPECT_EQ(st.dropped_files + st.spill_files, 10u);
  EXPECT_EQ(st.dropped_bytes, st.dropped_files * kSlice);
  EXPECT_EQ(SpillFilesIn(spill_dir_), 10u);
  // The next step's slices need spills: the oldest dropped files make room.
  size_t dropped = st.dropped_files;
  for (uint32_t layer = 0; layer < 4; ++layer) {
    ASSERT_TRUE(Offload(Owner(), Key(2, layer), Pattern(100 + layer, kSlice)).ok());
    st = store_->GetStats();
    EXPECT_LE(st.spill_used + st.dropped_bytes, kSpill) << "layer " << layer;
    EXPECT_LE(SpillFilesIn(spill_dir_) * kSlice, kSpill) << "layer " << layer;
    EXPECT_LE(st.dropped_files, dropped) << "layer " << layer;
    dropped = st.dropped_files;
  }
  EXPECT_LT(dropped, 6u);
  ASSERT_TRUE(store_->FreeStep(Owner(), 1).ok());
  EXPECT_EQ(store_->GetStats().dropped_files, 0u);
  EXPECT_EQ(SpillFilesIn(spill_dir_), store_->GetStats().spill_files);
  for (uint32_t layer = 4; layer-- > 0;) {
    absl::StatusOr<std::string> got = FetchBytes(Owner(), Key(2, layer));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(*got == Pattern(100 + layer, kSlice)) << "layer " << layer;
  }
  ASSERT_TRUE(store_->FreeStep(Owner(), 2).ok());
  EXPECT_EQ(SpillFilesIn(spill_dir_), 0u);
  ExpectExactBooking();
}

// A bulk reservation freed before its lease ends (its Put stopped at its
// deadline may still land) keeps its block until then; a committed slice's
// block is freed at once, and the job's removal lets go of both.
TEST_F(StoreTest, AFreedReservationKeepsItsBlockUntilItsLeaseEnds) {
  Start(1 << 20, 0, /*bulk=*/true);  // a lease of 30 s
  const absl::Time past_lease = absl::Now() + absl::Seconds(31);
  const uint64_t free_before = store_->GetStats().arena_free;
  ASSERT_TRUE(store_->Reserve(Owner(), Key(1, 0), 4096, Deadline()).ok());
  const uint64_t free_reserved = store_->GetStats().arena_free;
  EXPECT_LT(free_reserved, free_before);
  ASSERT_TRUE(store_->FreeKey(Owner(), Key(1, 0)).ok());
  store_->Tick();
  EXPECT_EQ(store_->GetStats().arena_free, free_reserved) << "a Put may still land";
  // The key may be reserved again, in another block; committed, it goes at once.
  ASSERT_TRUE(store_->Reserve(Owner(), Key(1, 0), 4096, Deadline()).ok());
  ASSERT_TRUE(store_->Commit(Owner(), Key(1, 0), std::nullopt).ok());
  ASSERT_TRUE(store_->FreeKey(Owner(), Key(1, 0)).ok());
  EXPECT_EQ(store_->GetStats().arena_free, free_reserved);
  ExpectExactBooking();
  store_->Tick(past_lease);
  EXPECT_EQ(store_->GetStats().arena_free, free_before);
  // Nor does the job's removal let go of one before its lease ends (bytes
  // already sent may land after its key is revoked); the block's booking
  // and the job's ledger entry go with it.
  ASSERT_TRUE(store_->Reserve(Owner(), Key(1, 1), 4096, Deadline()).ok());
  ASSERT_TRUE(store_->FreeKey(Owner(), Key(1, 1)).ok());
  store_->RemoveJob("a", instance_);
  instance_.reset();
  EXPECT_EQ(store_->GetStats().arena_free, free_reserved);
  store_->Tick(past_lease);
  EXPECT_EQ(store_->GetStats().arena_free, free_before);
  EXPECT_EQ(ledger_.JobBytes("a")[kAct], 0u);
  ExpectExactBooking();
}

// However small its slices, a job holds at most max_slices_per_job of them
// (each costs bookkeeping and, spilled, a file): past it a reservation is
// refused and changes nothing; other jobs are not counted against it.
TEST_F(StoreTest, AJobHoldsAtMostItsShareOfSlices) {
  max_slices_per_job_ = 4;
  Start(1 << 20, 1 << 20);
  for (uint32_t layer = 0; layer < 4; ++layer) {
    ASSERT_TRUE(Offload(Owner(), Key(1, layer), Pattern(layer, 1)).ok());
  }
  const uint64_t hash = store_->StateHash();
  absl::Status s = Offload(Owner(), Key(1, 4), Pattern(4, 1));
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "holds 4 activation slices")) << s;
  s = store_->Reserve(Owner(), Key(1, 4), 1, Deadline()).status();
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_EQ(store_->StateHash(), hash);
  EXPECT_TRUE(Offload(Owner("b"), Key(1, 0), Pattern(9, 1)).ok());
  ASSERT_TRUE(store_->FreeKey(Owner(), Key(1, 0)).ok());
  EXPECT_TRUE(Offload(Owner(), Key(1, 4), Pattern(4, 1)).ok());
}

TEST_F(StoreTest, ArenaMustFitTheMemoryLimit) {
  MemoryLedger small(1 << 20);
  ActivationStore::Options o;
  o.arena_bytes = 2 << 20;
  o.janitor_period = absl::ZeroDuration();
  absl::StatusOr<std::unique_ptr<ActivationStore>> s =
      ActivationStore::Create(o, nullptr, &small, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.status().message().find("--memory_limit"), std::string::npos) << s.status();
  EXPECT_EQ(small.total(), 0u);
}

}  // namespace
}  // namespace zeroshard
