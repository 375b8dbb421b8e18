// BulkDataPath against a stand-in daemon (client/testing/fake_shard.h) whose
// staged pushes can be held before or while they read their slot and whose
// fences can fail: the staging-slot rules of shard.proto as the client must
// keep them (bug 1: a slot whose push was not answered is never written
// again before a fence answered; a push counts as delivered only when the
// fence says its generation was applied).

#include "client/bulk_data_path.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/rpc.h"
#include "client/testing/fake_shard.h"
#include "gtest/gtest.h"
#include "transport/inproc/inproc_transport.h"
#include "transport/piece_plan.h"
#include "transport/testing/faulty_transport.h"

namespace zeroshard {
namespace {

using testing::FakeShard;
using transport::testing::FaultyTransport;
using Mode = FaultyTransport::Mode;

constexpr uint64_t kIncarnation = 7;

struct Rig {
  explicit Rig(FakeShard::Options o = {}, std::shared_ptr<PushMemories> memories = nullptr,
               int progress_threads = 1) {
    fake = *FakeShard::Start(o);
    BulkDataPath::Options po;
    po.connections = 2;
    po.fence_timeout = absl::Seconds(5);
    po.push_memories = std::move(memories);
    transport::InprocTransportOptions to;
    to.progress_threads = progress_threads;
    auto wrapped = std::make_unique<FaultyTransport>(*transport::inproc::CreateInprocTransport(to));
    faults = wrapped.get();
    path = std::make_unique<BulkDataPath>(
        fake->address(), MakeDaemonChannel(fake->address(), ChannelSecurity::Plaintext()),
        *BulkTransport::Of(std::move(wrapped)), po);
  }
  std::unique_ptr<FakeShard> fake;
  // The client's transport: connections open unless a test closes or
  // stalls them (numbered from 0 as the client connects; each endpoint
  // makes two).
  FaultyTransport* faults;
  std::unique_ptr<BulkDataPath> path;
};

// 256 fp32 elements [begin, begin + 256), all `value`.
struct Grad {
  Grad(uint64_t begin, float value) : range{begin, begin + 256}, values(256, value) {}
  GradientPush Push(uint64_t step = 1) const {
    GradientPush p;
    p.job_id = "job";
    p.step = step;
    p.incarnation = kIncarnation;
    p.range = range;
    p.dtype = DType::kFp32;
    p.data = values.data();
    return p;
  }
  std::string bytes() const {
    return std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4);
  }
  FlatRange range;
  std::vector<float> values;
};

absl::Time In(absl::Duration d) { return absl::Now() + d; }

int IndexOf(const std::vector<std::string>& events, const std::string& e) {
  for (size_t i = 0; i < events.size(); ++i) {
    if (events[i] == e) return static_cast<int>(i);
  }
  return -1;
}

TEST(BulkDataPathTest, PushesGoThroughTheSlotsWithIncreasingGenerations) {
  Rig rig;
  const Grad a(0, 1.0f), b(256, 2.0f), c(512, 3.0f);
  for (const Grad* g : {&a, &b, &c}) {
    absl::StatusOr<uint64_t> sent = rig.path->PushGradient(g->Push(), In(absl::Seconds(5)));
    ASSERT_TRUE(sent.ok()) << sent.status();
    EXPECT_EQ(*sent, 256u * 4);
  }
  const std::vector<FakeShard::Applied> applied = rig.fake->applied();
  ASSERT_EQ(applied.size(), 3u);
  EXPECT_EQ(applied[0].bytes, a.bytes());
  EXPECT_EQ(applied[1].bytes, b.bytes());
  EXPECT_EQ(applied[2].bytes, c.bytes());
  // Each slot's generations start at 1 and increase.
  std::vector<uint64_t> last(2, 0);
  for (const auto& e : applied) {
    EXPECT_GT(e.generation, last[e.slot]);
    last[e.slot] = e.generation;
  }
  EXPECT_EQ(applied[0].generation, 1u);
  // A gather reads the parameter region after the wait_only check.
  std::vector<float> got(10);
  GatherRequestSpec g{"job", 0, kIncarnation, 0, {10, 20}, DType::kFp32, absl::ZeroDuration()};
  absl::StatusOr<uint64_t> read = rig.path->Gather(g, got.data(), In(absl::Seconds(5)));
  ASSERT_TRUE(read.ok()) << read.status();
  for (int i = 0; i < 10; ++i) EXPECT_EQ(got[i], 0.5f * (10 + i));
  EXPECT_EQ(rig.path->exchanges(), 1u);
  EXPECT_STREQ(rig.path->name(), "inproc");
}

// A daemon that confirmed a step committed is not asked again for that step
// or an older one (same dtype) while at least half of its answer's read
// lease is left; a newer step, a range past the highest end it accepted or
// outside its region, or a lease past its half asks again, and the next request that asks
// reports the bytes read meanwhile (as TakeUnreportedReads hands them to a
// Leave). The daemon's refusal of a bad range reaches the caller.
TEST(BulkDataPathTest, AConfirmedStepIsReadWithoutAskingAgainWithinHalfTheLease) {
  FakeShard::Options o;
  o.read_lease_ms = 4000;
  Rig rig(o);
  std::vector<float> got(10);
  auto gather = [&](uint64_t after_step, FlatRange range) {
    GatherRequestSpec g{"job", 0, kIncarnation, after_step, range, DType::kFp32,
                        absl::ZeroDuration()};
    return rig.path->Gather(g, got.data(), In(absl::Seconds(5)));
  };
  // Each asking gather as (after_step, bytes it reported).
  auto asked = [&] {
    std::vector<std::pair<uint64_t, uint64_t>> out;
    for (const FakeShard::WaitOnly& w : rig.fake->wait_only_gathers()) {
      out.emplace_back(w.after_step, w.unreported_read_bytes);
    }
    return out;
  };
  using Asked = std::vector<std::pair<uint64_t, uint64_t>>;
  for (uint64_t step : {3, 3, 2, 3}) {
    absl::StatusOr<uint64_t> read = gather(step, {10, 20});
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, 40u);
    EXPECT_EQ(got[9], 0.5f * 19);
  }
  EXPECT_EQ(asked(), Asked({{3, 0}}));
  ASSERT_TRUE(gather(4, {0, 10}).ok());
  EXPECT_EQ(asked(), Asked({{3, 0}, {4, 120}}));  // the 3 reads without asking
  // Past the highest end the daemon accepted (the region may end in
  // padding the daemon refuses): asked, then read without asking.
  ASSERT_TRUE(gather(4, {100, 110}).ok());
  ASSERT_TRUE(gather(4, {100, 110}).ok());
  EXPECT_EQ(asked(), Asked({{3, 0}, {4, 120}, {4, 0}}));
  // Outside the parameters: the daemon's answer, not a read; the bytes its
  // request reported stay to be reported again.
  absl::StatusOr<uint64_t> outside = gather(4, {2000, 2010});
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument) << outside.status();
  EXPECT_EQ(asked().size(), 3u);
  // Past half the lease: asked again, and the new answer serves the next.
  absl::SleepFor(absl::Milliseconds(2100));
  ASSERT_TRUE(gather(4, {0, 10}).ok());
  ASSERT_TRUE(gather(4, {0, 10}).ok());
  EXPECT_EQ(asked(), Asked({{3, 0}, {4, 120}, {4, 0}, {4, 40}}));
  // What a Leave would report: the last read, once.
  EXPECT_EQ(rig.path->TakeUnreportedReads(), 40u);
  EXPECT_EQ(rig.path->TakeUnreportedReads(), 0u);
}

// A daemon that grants no read lease (read_lease_ms 0) is asked before
// every read.
TEST(BulkDataPathTest, WithoutALeaseEveryReadAsks) {
  Rig rig;
  std::vector<float> got(10);
  for (int i = 0; i < 3; ++i) {
    GatherRequestSpec g{"job", 0, kIncarnation, 1, {10, 20}, DType::kFp32, absl::ZeroDuration()};
    ASSERT_TRUE(rig.path->Gather(g, got.data(), In(absl::Seconds(5))).ok());
  }
  EXPECT_EQ(rig.fake->wait_only_gathers().size(), 3u);
  EXPECT_EQ(rig.path->TakeUnreportedReads(), 0u);
}

int Count(const std::vector<std::string>& events, absl::string_view prefix) {
  return static_cast<int>(std::count_if(events.begin(), events.end(), [&](const std::string& e) {
    return absl::StartsWith(e, prefix);
  }));
}

// A daemon that cannot map the client's push memory (this stand-in answers
// MapPushMemory FAILED_PRECONDITION, as one on another host does): pushes
// from it are Put into the slots like any others, and the daemon is asked
// once per endpoint.
TEST(BulkDataPathTest, PushesFromPushMemoryTheDaemonCannotMapArePut) {
  auto memories = std::make_shared<PushMemories>();
  absl::StatusOr<std::shared_ptr<transport::PushMemory>> memory = memories->Allocate(4096);
  ASSERT_TRUE(memory.ok());
  Rig rig({}, memories);
  float* values = static_cast<float*>((*memory)->data());
  for (int i = 0; i < 512; ++i) values[i] = 0.25f * i;
  // Not mapped yet: the client's collective does not batch pushes from it.
  EXPECT_EQ(rig.path->PullMemoryOf(values, 1024).serial, 0u);
  for (int k = 0; k < 2; ++k) {
    GradientPush p = Grad(256 * k, 0).Push();
    p.data = values + 256 * k;
    absl::StatusOr<uint64_t> sent = rig.path->PushGradient(p, In(absl::Seconds(5)));
    ASSERT_TRUE(sent.ok()) << sent.status();
  }
  const std::vector<FakeShard::Applied> applied = rig.fake->applied();
  ASSERT_EQ(applied.size(), 2u);
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(applied[k].bytes,
              std::string(reinterpret_cast<const char*>(values + 256 * k), 256 * 4));
  }
  EXPECT_EQ(rig.fake->push_memory_maps(), 1);
  EXPECT_EQ(rig.path->PullMemoryOf(values, 1024).serial, 0u);  // refused
}

// A daemon that maps the client's push memory: once it has, PullMemoryOf
// names that memory (serial, bounds), and pushes from it, together larger
// than a slot, are announced in one request and read where they lie.
TEST(BulkDataPathTest, PushesFromPushMemoryTheDaemonMapsArePulledTogether) {
  auto memories = std::make_shared<PushMemories>();
  absl::StatusOr<std::shared_ptr<transport::PushMemory>> memory = memories->Allocate(16384);
  ASSERT_TRUE(memory.ok());
  FakeShard::Options o;
  o.map_push_memory = true;
  Rig rig(o, memories);  // slots of 4096 bytes
  float* values = static_cast<float*>((*memory)->data());
  for (int i = 0; i < 4096; ++i) values[i] = 0.5f * i;
  EXPECT_EQ(rig.path->PullMemoryOf(values, 1024).serial, 0u);  // not mapped yet
  GradientPush first = Grad(0, 0).Push();
  first.data = values;
  absl::StatusOr<uint64_t> sent = rig.path->PushGradient(first, In(absl::Seconds(5)));
  ASSERT_TRUE(sent.ok()) << sent.status();
  EXPECT_EQ(rig.fake->push_memory_maps(), 1);
  const DataPath::PullMemory m = rig.path->PullMemoryOf(values + 256, 1024);
  EXPECT_NE(m.serial, 0u);
  EXPECT_EQ(m.begin, reinterpret_cast<uintptr_t>((*memory)->data()));
  EXPECT_EQ(m.bytes, (*memory)->size());
  EXPECT_TRUE(m.Holds(values + 4096 - 256, 1024));
  EXPECT_EQ(rig.path->PullMemoryOf(values + 4096 - 256, 1024).serial, m.serial);
  // 8 KiB of pushes for a 4 KiB slot: one announcement.
  std::vector<GradientPush> pushes;
  for (int k = 1; k <= 8; ++k) {
    GradientPush p = Grad(256 * k, 0).Push();
    p.data = values + 256 * k;
    pushes.push_back(p);
  }
  const int announced = Count(rig.fake->events(), "announce");
  std::vector<absl::StatusOr<uint64_t>> results =
      rig.path->PushGradients(pushes, In(absl::Seconds(5)));
  for (const absl::StatusOr<uint64_t>& r : results) ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Count(rig.fake->events(), "announce"), announced + 1);
  const std::vector<FakeShard::Applied> applied = rig.fake->applied();
  ASSERT_EQ(applied.size(), 9u);
  for (int k = 0; k <= 8; ++k) {
    EXPECT_EQ(applied[k].range.begin, 256u * k);
    EXPECT_EQ(applied[k].bytes,
              std::string(reinterpret_cast<const char*>(values + 256 * k), 256 * 4));
  }
}

// What a push memory holds, for the collective's batches: pushes inside it
// whole, at offsets any element size divides.
TEST(BulkDataPathTest, APullMemoryHoldsWhatADaemonReadsFromIt) {
  alignas(8) static uint8_t bytes[4096];
  const DataPath::PullMemory m{3, reinterpret_cast<uintptr_t>(bytes), sizeof(bytes)};
  EXPECT_TRUE(m.Holds(bytes, 4096));
  EXPECT_TRUE(m.Holds(bytes + 4092, 4));
  EXPECT_FALSE(m.Holds(bytes + 4092, 8));  // past its end
  EXPECT_FALSE(m.Holds(bytes + 2, 4));     // an offset 4 does not divide
  EXPECT_FALSE(m.Holds(bytes, 0));
  const DataPath::PullMemory later{3, reinterpret_cast<uintptr_t>(bytes + 8), 4088};
  EXPECT_FALSE(later.Holds(bytes + 4, 8));  // before its first byte
  EXPECT_TRUE(later.Holds(bytes + 8, 8));
  EXPECT_FALSE(DataPath::PullMemory{}.Holds(bytes, 4));  // none
}

// Buckets that fit one slot together (the short last buckets of several
// micro-batches) are put into it back to back and announced in one request;
// pushes larger than a slot together go one by one.
TEST(BulkDataPathTest, PushesThatFitOneSlotShareItAndOneRequest) {
  Rig rig;  // slots of 4096 bytes: four 1024-byte buckets
  const Grad a(0, 1.0f), b(256, 2.0f), c(768, 3.0f);
  std::vector<absl::StatusOr<uint64_t>> sent =
      rig.path->PushGradients({a.Push(), b.Push(), c.Push()}, In(absl::Seconds(5)));
  ASSERT_EQ(sent.size(), 3u);
  for (const auto& r : sent) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(*r, 1024u);
  }
  std::vector<FakeShard::Applied> applied = rig.fake->applied();
  ASSERT_EQ(applied.size(), 3u);
  EXPECT_EQ(applied[0].bytes, a.bytes());
  EXPECT_EQ(applied[1].bytes, b.bytes());
  EXPECT_EQ(applied[2].bytes, c.bytes());
  EXPECT_EQ(applied[2].range, c.range);
  for (const auto& e : applied) {
    EXPECT_EQ(e.slot, applied[0].slot);
    EXPECT_EQ(e.generation, 1u);
  }
  EXPECT_EQ(Count(rig.fake->events(), "announce "), 1);
  // Five buckets are more than a slot: one request each.
  std::vector<Grad> five;
  std::vector<GradientPush> pushes;
  for (int i = 0; i < 5; ++i) five.emplace_back(1024 + 256 * i, 4.0f + i);
  for (const Grad& g : five) pushes.push_back(g.Push());
  sent = rig.path->PushGradients(pushes, In(absl::Seconds(5)));
  ASSERT_EQ(sent.size(), 5u);
  for (const auto& r : sent) EXPECT_TRUE(r.ok()) << r.status();
  applied = rig.fake->applied();
  ASSERT_EQ(applied.size(), 8u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(applied[3 + i].bytes, five[i].bytes());
  EXPECT_EQ(Count(rig.fake->events(), "announce "), 6);
}

// ALREADY_EXISTS for several buckets in one slot means the daemon holds one
// of them and applied none: each is sent again alone, and each alone is
// delivered by its own ALREADY_EXISTS or applied.
TEST(BulkDataPathTest, AlreadyExistsForSharedSlotSendsEachAlone) {
  Rig rig;
  rig.fake->set_push_status(grpc::Status(grpc::StatusCode::ALREADY_EXISTS, "duplicate"));
  const Grad a(0, 1.0f), b(256, 2.0f);
  const std::vector<absl::StatusOr<uint64_t>> sent =
      rig.path->PushGradients({a.Push(), b.Push()}, In(absl::Seconds(5)));
  ASSERT_EQ(sent.size(), 2u);
  for (const auto& r : sent) EXPECT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(rig.fake->applied().empty());
  EXPECT_EQ(Count(rig.fake->events(), "announce "), 3);
  EXPECT_EQ(rig.path->quarantined_slots(), 0);
}

// A shared slot whose request timed out while the daemon read it: the
// fence says its generation was applied, so every bucket in it is
// delivered, with its own bytes.
TEST(BulkDataPathTest, ATimedOutSharedSlotTheDaemonAppliedDeliversEveryBucket) {
  FakeShard::Options o;
  o.staging_slots = 1;
  Rig rig(o);
  rig.fake->set_delay_while_reading(absl::Milliseconds(600));
  const Grad a(0, 1.0f), b(256, 2.0f), c(0, 5.0f);
  std::vector<absl::StatusOr<uint64_t>> sent =
      rig.path->PushGradients({a.Push(), b.Push()}, In(absl::Milliseconds(150)));
  ASSERT_EQ(sent.size(), 2u);
  for (const auto& r : sent) EXPECT_TRUE(r.ok()) << r.status();
  rig.fake->set_delay_while_reading(absl::ZeroDuration());
  ASSERT_TRUE(rig.path->PushGradient(c.Push(2), In(absl::Seconds(5))).ok());
  const std::vector<FakeShard::Applied> applied = rig.fake->applied();
  ASSERT_EQ(applied.size(), 3u);
  EXPECT_EQ(applied[0].bytes, a.bytes());
  EXPECT_EQ(applied[1].bytes, b.bytes());
  EXPECT_EQ(applied[2].generation, 2u);
  EXPECT_EQ(applied[2].bytes, c.bytes());
  const std::vector<std::string> events = rig.fake->events();
  EXPECT_LT(IndexOf(events, "fence 0 1 -> 1"), IndexOf(events, "announce 0 2"));
  EXPECT_GE(IndexOf(events, "fence 0 1 -> 1"), 0);
}

// A shared slot whose request timed out and whose fence failed too stays
// quarantined with every bucket it carried. A later push of any of them, in
// another grouping, fences it first and sends only what it did not apply.
TEST(BulkDataPathTest, AQuarantinedSharedSlotSettlesItsBucketsInAnyLaterGrouping) {
  Rig rig;  // two slots: the later pushes could take the other one

  rig.fake->set_delay_while_reading(absl::Milliseconds(600));
  rig.fake->fail_fences(1);
  const Grad a(0, 1.0f), b(256, 2.0f), c(512, 3.0f);
  std::vector<absl::StatusOr<uint64_t>> sent =
      rig.path->PushGradients({a.Push(), b.Push()}, In(absl::Milliseconds(150)));
  ASSERT_EQ(sent.size(), 2u);
  EXPECT_FALSE(sent[0].ok());
  EXPECT_FALSE(sent[1].ok());
  EXPECT_EQ(rig.path->quarantined_slots(), 1);
  rig.fake->set_delay_while_reading(absl::ZeroDuration());
  // `a` alone: the fence says the slot's generation was applied.
  absl::StatusOr<uint64_t> one = rig.path->PushGradient(a.Push(), In(absl::Seconds(5)));
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(rig.path->quarantined_slots(), 0);
  // `b` with `c`: `b` is known applied, only `c` goes.
  sent = rig.path->PushGradients({b.Push(), c.Push()}, In(absl::Seconds(5)));
  ASSERT_EQ(sent.size(), 2u);
  for (const auto& r : sent) EXPECT_TRUE(r.ok()) << r.status();
  const std::vector<FakeShard::Applied> applied = rig.fake->applied();
  ASSERT_EQ(applied.size(), 3u);
  EXPECT_EQ(applied[0].bytes, a.bytes());
  EXPECT_EQ(applied[1].bytes, b.bytes());
  EXPECT_EQ(applied[2].range, c.range);
  EXPECT_EQ(applied[2].bytes, c.bytes());
  EXPECT_EQ(Count(rig.fake->events(), "announce "), 2);
}

// Bug 1: the push RPC times out while the daemon is still reading the slot.
// The old client freed the slot at once, so the next push overwrote bytes
// the daemon then applied for the first one; and a retry's ALREADY_EXISTS
// counted as delivered. Now the slot is fenced first; the fence waits for the
// read and says the generation was applied, so the push is delivered, with
// its own bytes.
TEST(BulkDataPathTest, ATimedOutPushTheDaemonAppliedIsDeliveredWithItsOwnBytes) {
  FakeShard::Options o;
  o.staging_slots = 1;
  Rig rig(o);
  rig.fake->set_delay_while_reading(absl::Milliseconds(600));
  const Grad a(0, 1.0f), b(0, 2.0f);
  absl::StatusOr<uint64_t> sent = rig.path->PushGradient(a.Push(), In(absl::Milliseconds(150)));
  EXPECT_TRUE(sent.ok()) << sent.status();
  rig.fake->set_delay_while_reading(absl::ZeroDuration());
  sent = rig.path->PushGradient(b.Push(2), In(absl::Seconds(5)));
  ASSERT_TRUE(sent.ok()) << sent.status();
  const std::vector<FakeShard::Applied> applied = rig.fake->applied();
  ASSERT_EQ(applied.size(), 2u);
  EXPECT_EQ(applied[0].generation, 1u);
  EXPECT_TRUE(applied[0].bytes == a.bytes()) << "the daemon applied bytes of a later push";
  EXPECT_EQ(applied[1].generation, 2u);
  EXPECT_EQ(applied[1].bytes, b.bytes());
  const std::vector<std::string> events = rig.fake->events();
  const int fence = IndexOf(events, "fence 0 1 -> 1");
  ASSERT_GE(fence, 0);
  EXPECT_LT(fence, IndexOf(events, "announce 0 2"));
}

// The fence wins the race with a push still waiting to read: the daemon
// refuses that generation, the push fails with its own error, and the slot
// is free for the next push at once.
TEST(BulkDataPathTest, ATimedOutPushTheDaemonDidNotApplyFailsAndIsNeverApplied) {
  FakeShard::Options o;
  o.staging_slots = 1;
  Rig rig(o);
  rig.fake->set_delay_before_read(absl::Milliseconds(500));
  const Grad a(0, 1.0f), b(0, 2.0f);
  absl::StatusOr<uint64_t> sent = rig.path->PushGradient(a.Push(), In(absl::Milliseconds(150)));
  EXPECT_EQ(sent.status().code(), absl::StatusCode::kDeadlineExceeded) << sent.status();
  rig.fake->set_delay_before_read(absl::ZeroDuration());
  sent = rig.path->PushGradient(b.Push(), In(absl::Seconds(5)));
  ASSERT_TRUE(sent.ok()) << sent.status();
  rig.fake->WaitIdle();
  const std::vector<FakeShard::Applied> applied = rig.fake->applied();
  ASSERT_EQ(applied.size(), 1u);
  EXPECT_EQ(applied[0].generation, 2u);
  EXPECT_EQ(applied[0].bytes, b.bytes());
  const std::vector<std::string> events = rig.fake->events();
  EXPECT_GE(IndexOf(events, "fence 0 1 -> 0"), 0);
  EXPECT_GE(IndexOf(events, "refuse 0 1"), 0);
  EXPECT_EQ(rig.path->quarantined_slots(), 0);
}

// A fence that fails quarantines the slot: other slots keep serving, and the
// quarantined one is fenced again before it is written.
TEST(BulkDataPathTest, AFailedFenceQuarantinesTheSlotUntilAFenceAnswers) {
  Rig rig;  // two slots
  rig.fake->set_delay_before_read(absl::Milliseconds(400));
  rig.fake->fail_fences(1);
  const Grad a(0, 1.0f), b(256, 2.0f), c(512, 3.0f), d(768, 4.0f);
  absl::StatusOr<uint64_t> sent = rig.path->PushGradient(a.Push(), In(absl::Milliseconds(100)));
  EXPECT_EQ(sent.status().code(), absl::StatusCode::kDeadlineExceeded) << sent.status();
  EXPECT_EQ(rig.path->quarantined_slots(), 1);
  rig.fake->set_delay_before_read(absl::ZeroDuration());
  ASSERT_TRUE(rig.path->PushGradient(b.Push(), In(absl::Seconds(5))).ok());
  EXPECT_EQ(rig.fake->applied().back().slot, 1u);  // slot 0 stays out of use
  // Hold slot 1 with a slow push, so the next push needs slot 0.
  rig.fake->set_delay_while_reading(absl::Milliseconds(300));
  std::thread slow(
      [&] { EXPECT_TRUE(rig.path->PushGradient(c.Push(), In(absl::Seconds(5))).ok()); });
  while (IndexOf(rig.fake->events(), "announce 1 2") < 0) absl::SleepFor(absl::Milliseconds(1));
  rig.fake->set_delay_while_reading(absl::ZeroDuration());
  sent = rig.path->PushGradient(d.Push(), In(absl::Seconds(5)));
  ASSERT_TRUE(sent.ok()) << sent.status();
  slow.join();
  rig.fake->WaitIdle();
  const std::vector<std::string> events = rig.fake->events();
  const int failed = IndexOf(events, "fence-failed 0 1");
  const int fenced = std::max(IndexOf(events, "fence 0 1 -> 0"), IndexOf(events, "fence 0 1 -> 1"));
  const int reused = IndexOf(events, "announce 0 2");
  ASSERT_GE(failed, 0);
  ASSERT_GT(fenced, failed);
  EXPECT_GT(reused, fenced);
  EXPECT_EQ(rig.path->quarantined_slots(), 0);
  // Whatever the daemon applied for slot 0 generation 1 (if the held push
  // woke before the fence) is a's own bytes: nothing wrote the slot meanwhile.
  for (const auto& e : rig.fake->applied()) {
    if (e.slot == 0 && e.generation == 1) {
      EXPECT_EQ(e.bytes, a.bytes());
    }
  }
}

TEST(BulkDataPathTest, WithEverySlotQuarantinedAPushIsUnavailableNamingTheDaemon) {
  FakeShard::Options o;
  o.staging_slots = 1;
  Rig rig(o);
  rig.fake->set_delay_before_read(absl::Milliseconds(300));
  rig.fake->fail_fences(2);
  const Grad a(0, 1.0f), b(256, 2.0f);
  EXPECT_EQ(rig.path->PushGradient(a.Push(), In(absl::Milliseconds(100))).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  rig.fake->set_delay_before_read(absl::ZeroDuration());
  const absl::Status s = rig.path->PushGradient(b.Push(), In(absl::Seconds(5))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), rig.fake->address())) << s;
  // Once a fence answers, the slot serves again.
  absl::StatusOr<uint64_t> sent = rig.path->PushGradient(b.Push(), In(absl::Seconds(5)));
  ASSERT_TRUE(sent.ok()) << sent.status();
  rig.fake->WaitIdle();
  ASSERT_EQ(rig.fake->applied().size(), 1u);
  EXPECT_EQ(rig.fake->applied()[0].bytes, b.bytes());
}

// A retried push whose earlier attempt sits in a quarantined slot learns
// that attempt's outcome from a fence instead of sending again (the daemon
// would refuse a staged duplicate).
TEST(BulkDataPathTest, ARetryOfAnAppliedButUnansweredPushIsNotSentAgain) {
  Rig rig;
  rig.fake->set_delay_while_reading(absl::Milliseconds(300));
  rig.fake->fail_fences(1);
  const Grad a(0, 1.0f);
  EXPECT_FALSE(rig.path->PushGradient(a.Push(), In(absl::Milliseconds(100))).ok());
  rig.fake->WaitIdle();
  rig.fake->set_delay_while_reading(absl::ZeroDuration());
  absl::StatusOr<uint64_t> sent = rig.path->PushGradient(a.Push(), In(absl::Seconds(5)));
  ASSERT_TRUE(sent.ok()) << sent.status();
  ASSERT_EQ(rig.fake->applied().size(), 1u);
  EXPECT_EQ(rig.fake->applied()[0].bytes, a.bytes());
  EXPECT_EQ(IndexOf(rig.fake->events(), "announce 0 2"), -1);
}

// A staged duplicate is delivered: the daemon answers ALREADY_EXISTS only
// when it holds the contribution (a restarted rank replaying the open step:
// equal CRC-32C, or its predecessor's staged push). The slot is free again.
TEST(BulkDataPathTest, StagedAlreadyExistsIsDelivered) {
  Rig rig;
  rig.fake->set_push_status(grpc::Status(grpc::StatusCode::ALREADY_EXISTS, "duplicate"));
  const Grad a(0, 1.0f);
  const absl::StatusOr<uint64_t> sent = rig.path->PushGradient(a.Push(), In(absl::Seconds(5)));
  ASSERT_TRUE(sent.ok()) << sent.status();
  EXPECT_EQ(*sent, a.bytes().size());
  EXPECT_TRUE(rig.fake->applied().empty());
  rig.fake->set_push_status(grpc::Status::OK);
  ASSERT_TRUE(rig.path->PushGradient(a.Push(), In(absl::Seconds(5))).ok());
  EXPECT_EQ(rig.fake->applied().size(), 1u);
}

// The daemon no longer knows the job (a restart): the endpoint is dropped
// and the next call exchanges again.
TEST(BulkDataPathTest, NotFoundDropsTheEndpoint) {
  Rig rig;
  const Grad a(0, 1.0f);
  rig.fake->set_push_status(grpc::Status(grpc::StatusCode::NOT_FOUND, "no such job"));
  EXPECT_EQ(rig.path->PushGradient(a.Push(), In(absl::Seconds(5))).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(rig.path->exchanges(), 1u);
  rig.fake->set_push_status(grpc::Status::OK);
  ASSERT_TRUE(rig.path->PushGradient(a.Push(), In(absl::Seconds(5))).ok());
  EXPECT_EQ(rig.path->exchanges(), 2u);
  EXPECT_EQ(rig.fake->exchanges(), 2);
}

// A connection found closed (Cancelled: UCX closes one to stop an operation
// aborted at its deadline) drops the endpoint, and the call is tried once
// more at once on a fresh one: a push whose Put failed (nothing announced,
// so nothing applied), a gather, and a region access with one of its parts
// on the closed connection. A call whose fresh connections are closed as
// well fails, naming the daemon.
TEST(BulkDataPathTest, APushWhosePutFindsItsConnectionClosedIsSentOnAFreshEndpoint) {
  Rig rig;
  const Grad a(0, 1.0f), b(256, 2.0f);
  ASSERT_TRUE(rig.path->PushGradient(a.Push(), In(absl::Seconds(5))).ok());
  ASSERT_EQ(rig.faults->connections_made(), 2);
  rig.faults->SetMode(0, Mode::kClosed);  // the pushes' connection
  absl::StatusOr<uint64_t> sent = rig.path->PushGradient(b.Push(), In(absl::Seconds(5)));
  ASSERT_TRUE(sent.ok()) << sent.status();
  EXPECT_EQ(rig.path->exchanges(), 2u);
  EXPECT_EQ(rig.faults->connections_made(), 4);
  EXPECT_EQ(rig.faults->operations(0), 2);  // a's Put, and b's that failed
  EXPECT_EQ(rig.faults->operations(2), 1);
  const std::vector<FakeShard::Applied> applied = rig.fake->applied();
  ASSERT_EQ(applied.size(), 2u);
  EXPECT_EQ(applied[1].bytes, b.bytes());
  EXPECT_EQ(Count(rig.fake->events(), "announce "), 2);
  EXPECT_EQ(rig.path->quarantined_slots(), 0);
}

TEST(BulkDataPathTest, AGatherWhoseConnectionIsClosedIsReadOnAFreshEndpoint) {
  Rig rig;
  std::vector<float> got(10);
  GatherRequestSpec g{"job", 0, kIncarnation, 0, {10, 20}, DType::kFp32, absl::ZeroDuration()};
  ASSERT_TRUE(rig.path->Gather(g, got.data(), In(absl::Seconds(5))).ok());
  rig.faults->SetMode(0, Mode::kClosed);
  rig.faults->SetMode(1, Mode::kClosed);
  std::fill(got.begin(), got.end(), 0.0f);
  absl::StatusOr<uint64_t> read = rig.path->Gather(g, got.data(), In(absl::Seconds(5)));
  ASSERT_TRUE(read.ok()) << read.status();
  for (int i = 0; i < 10; ++i) EXPECT_EQ(got[i], 0.5f * (10 + i));
  EXPECT_EQ(rig.path->exchanges(), 2u);
}

TEST(BulkDataPathTest, ARegionAccessWithAPartOnAClosedConnectionIsRetriedOnce) {
  FakeShard::Options o;
  o.activation_arena_bytes = 4 << 20;
  Rig rig(o, nullptr, /*progress_threads=*/2);
  const BulkDataPath::RegionAccess at{"job", 0, kIncarnation,
                                      v1::REGION_PURPOSE_ACTIVATION_ARENA};
  ASSERT_TRUE(rig.path->RegionLength(at, In(absl::Seconds(5))).ok());
  ASSERT_EQ(rig.faults->connections_made(), 2);
  rig.faults->SetMode(1, Mode::kClosed);
  const uint64_t bytes = 3 << 20;
  std::string out(bytes, '\0'), in(bytes, '\0');
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(i * 13 + i / 4096);
  absl::Status s = rig.path->PutRegion(at, 0, out.data(), bytes, In(absl::Seconds(5)));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(rig.path->exchanges(), 2u);
  // Both parts again, on the fresh endpoint's connections.
  EXPECT_EQ(rig.faults->operations(2), 1);
  EXPECT_EQ(rig.faults->operations(3), 1);
  ASSERT_TRUE(rig.path->GetRegion(at, 0, in.data(), bytes, In(absl::Seconds(5))).ok());
  EXPECT_TRUE(in == out);
  // Once only: with the next endpoint's connections closed too, the access
  // fails Cancelled, naming the daemon, and the next call connects again.
  for (int c = 2; c < 6; ++c) rig.faults->SetMode(c, Mode::kClosed);
  s = rig.path->GetRegion(at, 0, in.data(), bytes, In(absl::Seconds(5)));
  EXPECT_TRUE(absl::IsCancelled(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), rig.fake->address())) << s;
  EXPECT_EQ(rig.path->exchanges(), 3u);
  EXPECT_EQ(rig.faults->connections_made(), 6);
  ASSERT_TRUE(rig.path->GetRegion(at, 0, in.data(), bytes, In(absl::Seconds(5))).ok());
  EXPECT_EQ(rig.path->exchanges(), 4u);
}

// A call that ran out of time is not tried again, even though the abort of
// its timed-out Put closed the connection and failed its other Put
// Cancelled (as UCX does): it fails DeadlineExceeded, with nothing
// announced. Its endpoint is kept; the next call finds the connection
// closed and goes on a fresh one.
TEST(BulkDataPathTest, APushThatRanOutOfTimeIsNotRetriedAndItsClosedConnectionIsReplacedLater) {
  Rig rig;
  const Grad a(0, 1.0f), b(256, 2.0f), c(512, 3.0f), d(768, 4.0f);
  ASSERT_TRUE(rig.path->PushGradient(a.Push(), In(absl::Seconds(5))).ok());
  rig.faults->SetMode(0, Mode::kStalled);
  // b and c share a slot: two Puts on connection 0.
  const std::vector<absl::StatusOr<uint64_t>> sent =
      rig.path->PushGradients({b.Push(), c.Push()}, In(absl::Milliseconds(300)));
  ASSERT_EQ(sent.size(), 2u);
  for (const auto& r : sent) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  }
  EXPECT_EQ(rig.faults->operations(0), 3);
  EXPECT_EQ(rig.path->exchanges(), 1u);
  EXPECT_EQ(Count(rig.fake->events(), "announce "), 1);
  EXPECT_EQ(rig.path->quarantined_slots(), 0);
  absl::StatusOr<uint64_t> later = rig.path->PushGradient(d.Push(), In(absl::Seconds(5)));
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_EQ(rig.path->exchanges(), 2u);
  EXPECT_EQ(rig.faults->operations(0), 4);  // found closed
  const std::vector<FakeShard::Applied> applied = rig.fake->applied();
  ASSERT_EQ(applied.size(), 2u);
  EXPECT_EQ(applied[1].bytes, d.bytes());
}

// Many threads push distinct ranges with short and long deadlines while the
// daemon is slow at random points: every push the client calls delivered
// was applied exactly once with its own bytes, none was applied twice, and
// nothing applied carries another push's bytes.
TEST(BulkDataPathTest, ConcurrentPushesWithTimeoutsNeverApplyForeignBytes) {
  FakeShard::Options o;
  o.staging_slots = 3;
  Rig rig(o);
  rig.fake->set_delay_while_reading(absl::Milliseconds(2));
  constexpr int kThreads = 6, kPushes = 12;
  std::vector<Grad> grads;
  for (int i = 0; i < kThreads * kPushes; ++i) grads.emplace_back(256 * i, 1.0f + i);
  std::vector<int> delivered(grads.size(), 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int k = 0; k < kPushes; ++k) {
        const int i = t * kPushes + k;
        const absl::Duration timeout = absl::Milliseconds(rng() % 3 == 0 ? 3 : 3000);
        delivered[i] = rig.path->PushGradient(grads[i].Push(), In(timeout)).ok();
        if (rng() % 4 == 0) absl::SleepFor(absl::Microseconds(rng() % 500));
      }
    });
  }
  for (auto& th : threads) th.join();
  rig.fake->WaitIdle();
  std::vector<int> applied_count(grads.size(), 0);
  for (const auto& e : rig.fake->applied()) {
    const size_t i = e.range.begin / 256;
    ASSERT_LT(i, grads.size());
    ++applied_count[i];
    EXPECT_EQ(e.bytes, grads[i].bytes()) << "push " << i;
  }
  // Delivered iff applied, and then once.
  for (size_t i = 0; i < grads.size(); ++i) EXPECT_EQ(applied_count[i], delivered[i]) << i;
}

// Other regions the daemon hands out (the activation arena): Put and Get on
// the same endpoint as the pushes, the range checked against the region.
TEST(BulkDataPathTest, PutAndGetIntoAnotherRegion) {
  FakeShard::Options o;
  o.activation_arena_bytes = 8192;
  Rig rig(o);
  const BulkDataPath::RegionAccess at{"job", 0, kIncarnation,
                                      v1::REGION_PURPOSE_ACTIVATION_ARENA};
  absl::StatusOr<uint64_t> length = rig.path->RegionLength(at, In(absl::Seconds(5)));
  ASSERT_TRUE(length.ok()) << length.status();
  EXPECT_EQ(*length, 8192u);
  std::string out(1000, '\0'), in(1000, '\0');
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(i * 7);
  ASSERT_TRUE(rig.path->PutRegion(at, 4096, out.data(), out.size(), In(absl::Seconds(5))).ok());
  ASSERT_TRUE(rig.path->GetRegion(at, 4096, in.data(), in.size(), In(absl::Seconds(5))).ok());
  EXPECT_EQ(in, out);
  absl::Status s = rig.path->PutRegion(at, 8000, out.data(), out.size(), In(absl::Seconds(5)));
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_EQ(rig.path->exchanges(), 1u);
  // A daemon without the region: none, and Put/Get say so.
  Rig bare;
  length = bare.path->RegionLength(at, In(absl::Seconds(5)));
  ASSERT_TRUE(length.ok()) << length.status();
  EXPECT_EQ(*length, 0u);
  s = bare.path->GetRegion(at, 0, in.data(), 16, In(absl::Seconds(5)));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "ACTIVATION_ARENA")) << s;
}

// An access long enough to be split over the endpoint's two connections
// (on two progress threads) is, a part on each, and arrives whole and in
// place, at an odd length and offset.
TEST(BulkDataPathTest, ALongRegionAccessSplitOverConnectionsArrivesWhole) {
  FakeShard::Options o;
  o.activation_arena_bytes = 4 << 20;
  Rig rig(o, nullptr, /*progress_threads=*/2);
  const BulkDataPath::RegionAccess at{"job", 0, kIncarnation,
                                      v1::REGION_PURPOSE_ACTIVATION_ARENA};
  const uint64_t bytes = (3 << 20) + 123, offset = 4096 + 8;
  std::string out(bytes, '\0'), in(bytes, '\0');
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(i * 7 + i / 4096);
  ASSERT_TRUE(rig.path->PutRegion(at, offset, out.data(), bytes, In(absl::Seconds(5))).ok());
  ASSERT_TRUE(rig.path->GetRegion(at, offset, in.data(), bytes, In(absl::Seconds(5))).ok());
  EXPECT_TRUE(in == out);
  // One part of each access on each connection.
  EXPECT_EQ(rig.faults->operations(0), 2);
  EXPECT_EQ(rig.faults->operations(1), 2);
  // Short reads (one part each) at the ends and across the parts' boundary.
  const uint64_t boundary = transport::PartBytes(bytes, 2, 1 << 20, 4096);
  for (const uint64_t at_byte : {uint64_t{0}, boundary - 4096, bytes - 8192}) {
    std::string piece(8192, '\0');
    ASSERT_TRUE(rig.path
                    ->GetRegion(at, offset + at_byte, piece.data(), piece.size(),
                                In(absl::Seconds(5)))
                    .ok());
    EXPECT_TRUE(piece == out.substr(at_byte, piece.size())) << at_byte;
  }
  EXPECT_EQ(rig.faults->operations(0) + rig.faults->operations(1), 7);
  // Past the region: refused before anything moves.
  absl::Status s = rig.path->PutRegion(at, (1 << 20) + 1, out.data(), bytes, In(absl::Seconds(5)));
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
}

}  // namespace
}  // namespace zeroshard
