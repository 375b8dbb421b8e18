// The Activation service over its streaming path (OffloadActivation,
// FetchActivation) on a daemon without a bulk transport: a job needing ten
// times the arena spills and reads every slice back exactly; bad input to
// every RPC gets its code and a message naming the field, and changes
// nothing in the job, the ledger or the store; a job's slices and spill
// files go when it leaves.

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

namespace zeroshard {
namespace {

using testing::ActivationClient;
using testing::DaemonClient;
using testing::MakeKey;
using testing::MakeOwner;
using testing::PatternBytes;

constexpr uint64_t kArena = 2 << 20;
constexpr int kAct = static_cast<int>(MemoryCategory::kActivation);
constexpr int kFrag = static_cast<int>(MemoryCategory::kFragmentation);

class ActivationServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { StartWith(kArena, 64 << 20); }

  void StartWith(uint64_t arena, uint64_t spill) {
    spill_dir_ = testing::TestDir(
        absl::StrCat("act_", ::testing::UnitTest::GetInstance()->current_test_info()->name()));
    DaemonOptions o;
    o.listen = "127.0.0.1:0";
    o.memory_limit_bytes = 256 << 20;
    o.read_lease = absl::Seconds(30);
    o.activation_arena_bytes = arena;
    o.spill_dir = spill > 0 ? spill_dir_ : "";
    o.spill_bytes = spill > 0 ? spill : 1;
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    client_ = std::make_unique<DaemonClient>(daemon_->address());
    act_ = std::make_unique<ActivationClient>(daemon_->address());
    spec_ = testing::MakeSpec("job", testing::SampleLayout(), 3, 2, {daemon_->address()});
    ASSERT_TRUE(client_->Register(spec_, 0).ok());
    ASSERT_TRUE(client_->JoinAll(spec_).ok());
  }

  template <typename Call>
  void ExpectRejected(grpc::StatusCode code, const std::string& text, Call call) {
    testing::ExpectActivationRejected(*daemon_, "job", code, text, call);
  }

  uint64_t Activation(const std::string& job) { return daemon_->ledger().JobBytes(job)[kAct]; }

  // Every byte of the arena is booked once: the jobs' blocks, the free
  // block and the fragmentation.
  void ExpectArenaBookedExactly() {
    const CategoryBytes d = daemon_->ledger().JobBytes(kDaemonLedgerEntry);
    const ActivationStore::Stats st = daemon_->activations()->GetStats();
    EXPECT_EQ(d[kAct], st.arena_largest_free);
    EXPECT_EQ(d[kFrag], st.fragmentation + daemon_->activations()->region_bytes() -
                            daemon_->activations()->capacity());
    EXPECT_EQ(d[kAct] + d[kFrag] + Activation("job"), daemon_->activations()->region_bytes());
    EXPECT_EQ(daemon_->activations()->capacity(), kArena);
  }

  grpc::Status Leave(uint32_t rank) {
    grpc::ClientContext ctx;
    v1::LeaveRequest req;
    req.set_job_id("job");
    req.set_rank(rank);
    req.set_incarnation(testing::kTestIncarnation);
    v1::LeaveResponse resp;
    return client_->control->Leave(&ctx, req, &resp);
  }

  std::string spill_dir_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<DaemonClient> client_;
  std::unique_ptr<ActivationClient> act_;
  v1::JobSpec spec_;
};

// The brief's spill check over the streaming path: a 2 MiB arena and a rank
// that offloads 20 MiB over two steps.
TEST_F(ActivationServiceTest, StreamsTenTimesTheArenaThroughSpillFiles) {
  const v1::ActivationOwner owner = MakeOwner("job", 1);
  auto bytes_of = [](uint64_t step, uint32_t layer, uint32_t mb) {
    return PatternBytes(step * 100 + layer * 2 + mb, (512 << 10) + 1000 * layer + 3 * mb + step);
  };
  uint64_t offloaded = 0;
  for (uint64_t step = 1; step <= 2; ++step) {
    for (uint32_t layer = 0; layer < 10; ++layer) {
      for (uint32_t mb = 0; mb < 2; ++mb) {
        const std::string b = bytes_of(step, layer, mb);
        v1::ActivationStored stored;
        grpc::Status s = act_->Offload(owner, MakeKey(step, layer, mb), b, 100000, nullptr, &stored);
        ASSERT_TRUE(s.ok()) << s.error_message();
        EXPECT_EQ(stored.bytes(), b.size());
        offloaded += b.size();
        ExpectArenaBookedExactly();
      }
    }
  }
  EXPECT_GE(offloaded, 10 * kArena);
  const double spills = testing::MetricValue(*daemon_, "zeroshard_activation_spills_total{job=\"job\"}");
  EXPECT_GT(spills, 0);
  EXPECT_EQ(testing::SpillFilesIn(spill_dir_), daemon_->activations()->GetStats().spill_files);
  EXPECT_GT(testing::MetricValue(*daemon_, "zeroshard_activation_spill_bytes_total{job=\"job\"}"),
            spills * (512 << 10));
  // Backward of step 2: prefetch two layers ahead, fetch, free.
  for (int layer = 9; layer >= 0; --layer) {
    for (int mb = 1; mb >= 0; --mb) {
      std::vector<v1::ActivationKey> ahead;
      for (int l = layer - 1; l >= std::max(0, layer - 2); --l) ahead.push_back(MakeKey(2, l, mb));
      ASSERT_TRUE(act_->Prefetch(owner, ahead).ok());
      std::string got;
      grpc::Status s = act_->Fetch(owner, MakeKey(2, layer, mb), &got, 64 << 10);
      ASSERT_TRUE(s.ok()) << "layer " << layer << ": " << s.error_message();
      EXPECT_TRUE(got == bytes_of(2, layer, mb)) << "layer " << layer << " mb " << mb;
      const v1::ActivationKey key = MakeKey(2, layer, mb);
      v1::FreeActivationsResponse freed;
      ASSERT_TRUE(act_->Free(owner, &key, false, &freed).ok());
      EXPECT_EQ(freed.freed(), 1u);
      EXPECT_EQ(freed.bytes(), got.size());
    }
  }
  const double hits = testing::MetricValue(*daemon_, "zeroshard_activation_hits_total{job=\"job\"}");
  const double misses =
      testing::MetricValue(*daemon_, "zeroshard_activation_misses_total{job=\"job\"}");
  EXPECT_EQ(hits + misses, 20);
  EXPECT_GT(misses, 0);
  EXPECT_EQ(testing::MetricValue(*daemon_,
                                 "zeroshard_activation_fetch_seconds_count{job=\"job\"}"),
            20);
  // Step 1 freed at once: its spill files go with it.
  const v1::ActivationKey step1 = MakeKey(1, 0);
  v1::FreeActivationsResponse freed;
  ASSERT_TRUE(act_->Free(owner, &step1, /*whole_step=*/true, &freed).ok());
  EXPECT_EQ(freed.freed(), 20u);
  EXPECT_EQ(testing::SpillFilesIn(spill_dir_), 0u);
  EXPECT_EQ(Activation("job"), 0u);
  ExpectArenaBookedExactly();
  std::printf("offloaded %.1f MiB through a %.0f MiB arena: %.0f spills, %.0f hits, %.0f misses\n",
              offloaded / 1048576.0, kArena / 1048576.0, spills, hits, misses);
}

// Everything a job stored goes when its last rank leaves: slices, spill
// files, and (once reaped) its ledger entry.
TEST_F(ActivationServiceTest, LeavingFreesTheJobsSlicesAndSpillFiles) {
  for (uint32_t rank = 0; rank < 2; ++rank) {
    for (uint32_t layer = 0; layer < 8; ++layer) {
      ASSERT_TRUE(act_->Offload(MakeOwner("job", rank), MakeKey(1, layer),
                                PatternBytes(layer, 600 << 10))
                      .ok());
    }
  }
  EXPECT_GT(testing::SpillFilesIn(spill_dir_), 0u);
  EXPECT_GT(Activation("job"), 0u);
  ASSERT_TRUE(Leave(0).ok());
  EXPECT_GT(daemon_->activations()->GetStats().slices, 0u) << "rank 1 is still there";
  ASSERT_TRUE(Leave(1).ok());
  EXPECT_EQ(daemon_->activations()->GetStats().slices, 0u);
  EXPECT_EQ(testing::SpillFilesIn(spill_dir_), 0u);
  EXPECT_EQ(Activation("job"), 0u);
  // A new registration under the same id starts empty.
  ASSERT_TRUE(client_->Register(spec_, 0).ok());
  ASSERT_TRUE(client_->JoinAll(spec_).ok());
  std::string got;
  EXPECT_EQ(act_->Fetch(MakeOwner("job", 0), MakeKey(1, 0), &got).error_code(), grpc::NOT_FOUND);
}

TEST_F(ActivationServiceTest, BadInputToEveryRpcChangesNothing) {
  const v1::ActivationOwner owner = MakeOwner("job", 0);
  const std::string stored = PatternBytes(1, 300000);
  ASSERT_TRUE(act_->Offload(owner, MakeKey(1, 0), stored).ok());
  const v1::ActivationKey freed_key = MakeKey(1, 9);
  ASSERT_TRUE(act_->Offload(owner, freed_key, PatternBytes(9, 1000)).ok());
  ASSERT_TRUE(act_->Free(owner, &freed_key).ok());

  // Owners: a foreign job, a rank out of range, a rank not joined as that
  // incarnation, a fenced incarnation.
  const v1::ActivationKey key = MakeKey(1, 1);
  const std::string b = PatternBytes(2, 5000);
  auto offload = [&](const v1::ActivationOwner& o) {
    return [&, o] { return act_->Offload(o, key, b); };
  };
  ExpectRejected(grpc::NOT_FOUND, "not registered", offload(MakeOwner("other", 0)));
  ExpectRejected(grpc::INVALID_ARGUMENT, "owner.rank", offload(MakeOwner("job", 2)));
  ExpectRejected(grpc::FAILED_PRECONDITION, "has not joined", offload(MakeOwner("job", 0, 7)));
  ExpectRejected(grpc::INVALID_ARGUMENT, "owner.incarnation", offload(MakeOwner("job", 0, 0)));
  ASSERT_TRUE(client_->Join(spec_, 1, testing::kTestIncarnation + 1).ok());
  ExpectRejected(grpc::FAILED_PRECONDITION, "fenced", offload(MakeOwner("job", 1)));

  // OffloadActivation: keys, sizes, chunks.
  ExpectRejected(grpc::INVALID_ARGUMENT, "chunk 0.key.mp_rank",
                 [&] { return act_->Offload(owner, MakeKey(1, 1, 0, 2, 2), b); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "chunk 0.key.mp_size",
                 [&] { return act_->Offload(owner, MakeKey(1, 1, 0, 0, 0), b); });
  // The client's rule (common/activation_protocol.h), word for word.
  ExpectRejected(grpc::INVALID_ARGUMENT, "chunk 0.key.mp_size: must be in [1, 4096], got 4097",
                 [&] {
                   return act_->Offload(owner, MakeKey(1, 1, 0, 0, kMaxModelParallel + 1), b);
                 });
  ExpectRejected(grpc::INVALID_ARGUMENT, "chunk 0.total_bytes",
                 [&] { return act_->Offload(owner, key, ""); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "chunk 0.total_bytes",
                 [&] { return act_->Offload(owner, key, std::string(kArena + 1, 'x'), 1 << 20); });
  ExpectRejected(grpc::ALREADY_EXISTS, "already stored",
                 [&] { return act_->Offload(owner, MakeKey(1, 0), b); });
  // The chunks carry fewer bytes than total_bytes said, or more.
  ExpectRejected(grpc::INVALID_ARGUMENT, "of total_bytes", [&] {
    return act_->Offload(owner, key, b, 1000, [](size_t i, v1::ActivationChunk* c) {
      if (i == 0) c->set_total_bytes(c->total_bytes() + 1);
    });
  });
  ExpectRejected(grpc::INVALID_ARGUMENT, "run past total_bytes", [&] {
    return act_->Offload(owner, key, b, 1000, [](size_t i, v1::ActivationChunk* c) {
      if (i == 0) c->set_total_bytes(c->total_bytes() - 1);
    });
  });
  ExpectRejected(grpc::INVALID_ARGUMENT, "chunk 2.offset", [&] {
    return act_->Offload(owner, key, b, 1000, [](size_t i, v1::ActivationChunk* c) {
      if (i == 2) c->set_offset(c->offset() + 1);
    });
  });
  ExpectRejected(grpc::DATA_LOSS, "chunk 3: CRC-32C", [&] {
    return act_->Offload(owner, key, b, 1000, [](size_t i, v1::ActivationChunk* c) {
      if (i == 3) c->set_crc32c(c->crc32c() ^ 1);
    });
  });
  ExpectRejected(grpc::INVALID_ARGUMENT, "chunk 1.key", [&] {
    return act_->Offload(owner, key, b, 1000, [](size_t i, v1::ActivationChunk* c) {
      if (i == 1) *c->mutable_key() = MakeKey(1, 2);
    });
  });
  ExpectRejected(grpc::INVALID_ARGUMENT, "chunk 1.owner", [&] {
    return act_->Offload(owner, key, b, 1000, [](size_t i, v1::ActivationChunk* c) {
      if (i == 1) *c->mutable_owner() = MakeOwner("job", 1);
    });
  });

  // FetchActivation: unknown, freed, other rank's, bad chunk size, foreign job.
  std::string got;
  ExpectRejected(grpc::NOT_FOUND, "key: no activation",
                 [&] { return act_->Fetch(owner, MakeKey(1, 5), &got); });
  ExpectRejected(grpc::NOT_FOUND, "key: no activation",
                 [&] { return act_->Fetch(owner, freed_key, &got); });
  ExpectRejected(grpc::NOT_FOUND, "key: no activation",
                 [&] { return act_->Fetch(MakeOwner("job", 0), MakeKey(1, 0, 1), &got); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "max_chunk_bytes",
                 [&] { return act_->Fetch(owner, MakeKey(1, 0), &got, 10); });
  ExpectRejected(grpc::NOT_FOUND, "not registered",
                 [&] { return act_->Fetch(MakeOwner("other", 0), MakeKey(1, 0), &got); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "key: required", [&] {
    grpc::ClientContext ctx;
    v1::FetchActivationRequest req;
    *req.mutable_owner() = owner;
    auto reader = act_->stub->FetchActivation(&ctx, req);
    v1::ActivationChunk c;
    while (reader->Read(&c)) {
    }
    return reader->Finish();
  });

  // Reserve / Commit / Locate: this daemon has no bulk transport.
  ExpectRejected(grpc::UNAVAILABLE, "no bulk transport",
                 [&] { return act_->Reserve(owner, key, 100); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "bytes: must be >= 1",
                 [&] { return act_->Reserve(owner, key, 0); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "bytes: at most",
                 [&] { return act_->Reserve(owner, key, ~uint64_t{0}); });
  ExpectRejected(grpc::UNAVAILABLE, "no bulk transport", [&] {
    v1::ActivationPlacement p;
    return act_->Locate(owner, MakeKey(1, 0), &p);
  });
  ExpectRejected(grpc::NOT_FOUND, "key: no activation",
                 [&] { return act_->Commit(owner, key, 0); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "owner: required", [&] {
    grpc::ClientContext ctx;
    v1::CommitActivationRequest req;
    v1::ActivationStored resp;
    return act_->stub->CommitActivation(&ctx, req, &resp);
  });

  // PrefetchActivations.
  ExpectRejected(grpc::INVALID_ARGUMENT, "keys: at most 1024", [&] {
    return act_->Prefetch(owner,
                          std::vector<v1::ActivationKey>(kMaxPrefetchKeys + 1, MakeKey(1, 0)));
  });
  ExpectRejected(grpc::INVALID_ARGUMENT, "keys[1].mp_rank",
                 [&] { return act_->Prefetch(owner, {MakeKey(1, 0), MakeKey(1, 0, 0, 3, 3)}); });
  ExpectRejected(grpc::NOT_FOUND, "not registered",
                 [&] { return act_->Prefetch(MakeOwner("other", 0), {MakeKey(1, 0)}); });

  // FreeActivations.
  const v1::ActivationKey unknown = MakeKey(4, 4);
  ExpectRejected(grpc::NOT_FOUND, "key: no activation", [&] { return act_->Free(owner, &unknown); });
  ExpectRejected(grpc::NOT_FOUND, "key: no activation",
                 [&] { return act_->Free(owner, &freed_key); });
  ExpectRejected(grpc::INVALID_ARGUMENT, "whole_step",
                 [&] { return act_->Free(owner, nullptr, /*whole_step=*/true); });
  ExpectRejected(grpc::NOT_FOUND, "not registered",
                 [&] { return act_->Free(MakeOwner("other", 0), nullptr); });

  // After all that, the stored slice is intact.
  ASSERT_TRUE(act_->Fetch(owner, MakeKey(1, 0), &got).ok());
  EXPECT_TRUE(got == stored);
}

// Past the arena and the spill space: RESOURCE_EXHAUSTED naming both sizes;
// nothing stored is lost and nothing changes.
TEST_F(ActivationServiceTest, PastCapacityIsResourceExhaustedNamingBothSizes) {
  daemon_.reset();
  StartWith(kArena, /*spill=*/3 << 20);
  const v1::ActivationOwner owner = MakeOwner("job", 0);
  std::vector<std::string> stored;
  grpc::Status s;
  for (uint32_t layer = 0; layer < 64; ++layer) {
    std::string b = PatternBytes(layer, 900 << 10);
    s = act_->Offload(owner, MakeKey(1, layer), b);
    if (!s.ok()) break;
    stored.push_back(std::move(b));
  }
  EXPECT_EQ(s.error_code(), grpc::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_GE(stored.size(), 4u);
  ExpectRejected(grpc::RESOURCE_EXHAUSTED, "--activation_arena_bytes=2097152", [&] {
    return act_->Offload(owner, MakeKey(1, 63), PatternBytes(63, 900 << 10));
  });
  ExpectRejected(grpc::RESOURCE_EXHAUSTED, "--spill_bytes=3145728", [&] {
    return act_->Offload(owner, MakeKey(1, 63), PatternBytes(63, 900 << 10));
  });
  for (int layer = static_cast<int>(stored.size()) - 1; layer >= 0; --layer) {
    std::string got;
    grpc::Status f = act_->Fetch(owner, MakeKey(1, layer), &got);
    ASSERT_TRUE(f.ok()) << f.error_message();
    EXPECT_TRUE(got == stored[layer]) << "layer " << layer;
    const v1::ActivationKey k = MakeKey(1, layer);
    ASSERT_TRUE(act_->Free(owner, &k).ok());
  }
}

TEST(ActivationServiceOff, WithoutAnArenaEveryRpcIsFailedPrecondition) {
  std::unique_ptr<Daemon> daemon = testing::StartDaemon();
  EXPECT_EQ(daemon->activations(), nullptr);
  DaemonClient client(daemon->address());
  const v1::JobSpec spec = testing::MakeSpec("job", testing::SampleLayout(), 3, 1, {daemon->address()});
  ASSERT_TRUE(client.Register(spec, 0).ok());
  ASSERT_TRUE(client.JoinAll(spec).ok());
  ActivationClient act(daemon->address());
  const v1::ActivationOwner owner = MakeOwner("job", 0);
  const v1::ActivationKey key = MakeKey(1, 0);
  std::string got;
  v1::ActivationPlacement p;
  const std::vector<std::function<grpc::Status()>> calls = {
      [&] { return act.Reserve(owner, key, 10); },
      [&] { return act.Commit(owner, key, 0); },
      [&] { return act.Offload(owner, key, "abc"); },
      [&] { return act.Locate(owner, key, &p); },
      [&] { return act.Fetch(owner, key, &got); },
      [&] { return act.Prefetch(owner, {key}); },
      [&] { return act.Free(owner, &key); },
  };
  for (const auto& call : calls) {
    testing::ExpectActivationRejected(*daemon, "job", grpc::FAILED_PRECONDITION,
                                      "--activation_arena_bytes=0", call);
  }
}

TEST(ActivationServiceOptions, ArenaAndSpillOptionsAreChecked) {
  DaemonOptions o;
  o.memory_limit_bytes = 1 << 20;
  o.activation_arena_bytes = 2 << 20;
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(d.status().message().find("--memory_limit"), std::string::npos) << d.status();
  o = DaemonOptions();
  o.spill_dir = testing::TestDir("no_arena");
  d = Daemon::Start(o);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("--activation_arena_bytes"), std::string::npos);
}

}  // namespace
}  // namespace zeroshard
