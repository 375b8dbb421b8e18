// DaemonSliceStore against a stand-in Activation service
// (client/testing/fake_activation.h) over the inproc bulk transport and over
// the streaming RPCs: bytes come back bit for bit, each path is used when
// it should be, errors keep their codes, and the caller's buffers are lent
// only while a ticket is open.

#include "client/activation_store.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "client/activation_slices.h"
#include "client/bulk_data_path.h"
#include "client/rpc.h"
#include "client/testing/fake_shard.h"
#include "gtest/gtest.h"
#include "transport/inproc/inproc_transport.h"
#include "transport/testing/faulty_transport.h"

namespace zeroshard {
namespace {

using testing::FakeActivation;
using testing::FakeShard;
using transport::testing::FaultyTransport;

constexpr uint64_t kIncarnation = 5;

absl::Time In(absl::Duration d) { return absl::Now() + d; }

std::vector<uint8_t> Bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

struct Rig {
  // bulk: the store gets the inproc data path; arena 0: the fake hands out
  // no ACTIVATION_ARENA region.
  Rig(bool bulk, uint64_t arena_bytes, uint32_t rank = 0, FakeShard* shared = nullptr,
      bool checksums = false) {
    if (shared == nullptr) {
      FakeShard::Options o;
      o.activation_arena_bytes = arena_bytes;
      owned = *FakeShard::Start(o);
      shared = owned.get();
    }
    fake = shared;
    channel = MakeDaemonChannel(fake->address(), ChannelSecurity::Plaintext());
    if (bulk) {
      auto wrapped = std::make_unique<FaultyTransport>(*transport::inproc::CreateInprocTransport());
      faults = wrapped.get();
      path = std::make_unique<BulkDataPath>(fake->address(), channel,
                                            *BulkTransport::Of(std::move(wrapped)),
                                            BulkDataPath::Options{});
    }
    DaemonSliceStore::Options so;
    so.rpc_timeout = absl::Seconds(10);
    so.stream_chunk_bytes = 4096;  // several chunks per slice
    so.checksums = checksums;
    store = std::make_unique<DaemonSliceStore>(DaemonSliceStore::Owner{"job", rank, kIncarnation},
                                               fake->address(), channel, path.get(), so);
  }
  absl::Status Offload(const ActivationKey& k, const std::vector<uint8_t>& v) {
    absl::StatusOr<ActivationTicket> t = store->Offload(k, v.data(), v.size());
    if (!t.ok()) return t.status();
    return t->Wait(In(absl::Seconds(10)));
  }
  absl::Status Fetch(const ActivationKey& k, std::vector<uint8_t>* out, size_t n,
                     AfterFetch then = AfterFetch::kFree) {
    out->assign(n, 0);
    return store->Fetch(k, out->data(), n, then, In(absl::Seconds(10)));
  }

  std::unique_ptr<FakeShard> owned;
  FakeShard* fake = nullptr;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<BulkDataPath> path;
  // The bulk path's transport (bulk only): connections open unless a test
  // stalls or closes them.
  FaultyTransport* faults = nullptr;
  std::unique_ptr<DaemonSliceStore> store;
};

ActivationKey Key(uint32_t layer, uint64_t step = 1) { return {step, 0, layer, 0, 1}; }

class PathTest : public ::testing::TestWithParam<bool> {};

TEST_P(PathTest, SlicesComeBackBitForBitAndAreFreedOnceFetched) {
  const bool bulk = GetParam();
  Rig rig(bulk, 1 << 20);
  const std::vector<std::vector<uint8_t>> slices = {Bytes(10007, 1), Bytes(1, 2), Bytes(65536, 3)};
  for (uint32_t l = 0; l < slices.size(); ++l) {
    ASSERT_TRUE(rig.Offload(Key(l), slices[l]).ok());
  }
  EXPECT_EQ(rig.fake->activation().slices(), 3u);
  EXPECT_EQ(rig.store->Stats().stored_bytes, 10007u + 1 + 65536);
  for (int l = static_cast<int>(slices.size()) - 1; l >= 0; --l) {
    std::vector<uint8_t> got;
    const absl::Status s = rig.Fetch(Key(l), &got, slices[l].size());
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(got, slices[l]) << "layer " << l;
  }
  EXPECT_EQ(rig.fake->activation().slices(), 0u);
  const SliceStoreStats st = rig.store->Stats();
  EXPECT_EQ(st.stored_bytes, 0u);
  EXPECT_EQ(st.trainer_bytes, 0u);
  EXPECT_EQ(st.offloads, 3u);
  EXPECT_EQ(st.fetches, 3u);
  EXPECT_EQ(st.failures, 0u);
  const testing::FakeActivation::Counts c = rig.fake->activation().counts();
  if (bulk) {
    EXPECT_EQ(c.reserve, 3);
    EXPECT_EQ(c.commit, 3);
    // Each fetch read the slice where it was reserved and freed it there.
    EXPECT_EQ(c.locate, 0);
    EXPECT_EQ(c.free_in_place, 3);
    EXPECT_EQ(c.offload_stream + c.fetch_stream, 0);
    EXPECT_EQ(st.streamed, 0u);
    EXPECT_TRUE(absl::StrContains(rig.store->name(), "inproc")) << rig.store->name();
  } else {
    EXPECT_EQ(c.offload_stream, 3);
    EXPECT_EQ(c.fetch_stream, 3);
    EXPECT_EQ(c.reserve + c.locate, 0);
    EXPECT_EQ(st.streamed, 6u);
  }
  EXPECT_EQ(c.free, 3);
  EXPECT_EQ(rig.fake->activation().last_owner(), "job/0/5");
  // The daemon confirmed each free: freeing the step sends nothing.
  absl::StatusOr<uint64_t> freed = rig.store->FreeStep(1, In(absl::Seconds(10)));
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 0u);
  EXPECT_EQ(rig.fake->activation().counts().free, 3);
}

TEST_P(PathTest, ErrorsKeepTheirCodes) {
  Rig rig(GetParam(), 1 << 20);
  const std::vector<uint8_t> v = Bytes(4096, 4);
  ASSERT_TRUE(rig.Offload(Key(0), v).ok());
  std::vector<uint8_t> got;
  // A key offloaded already, at once and without a request.
  const int reserves = rig.fake->activation().counts().reserve;
  absl::StatusOr<ActivationTicket> again = rig.store->Offload(Key(0), v.data(), v.size());
  EXPECT_TRUE(absl::IsAlreadyExists(again.status())) << again.status();
  EXPECT_EQ(rig.fake->activation().counts().reserve, reserves);
  // Bad keys and sizes, at once, by the daemon's own rules
  // (common/activation_protocol.h): nothing reaches the daemon.
  const testing::FakeActivation::Counts before = rig.fake->activation().counts();
  EXPECT_TRUE(absl::IsInvalidArgument(rig.store->Offload({1, 0, 0, 2, 2}, v.data(), 4).status()));
  absl::StatusOr<ActivationTicket> bad =
      rig.store->Offload({1, 0, 0, 0, kMaxModelParallel + 1}, v.data(), 4);
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status())) << bad.status();
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "key.mp_size")) << bad.status();
  EXPECT_TRUE(absl::IsInvalidArgument(rig.store->Offload(Key(1), v.data(), 0).status()));
  bad = rig.store->Offload(Key(1), v.data(), kMaxActivationSliceBytes + 1);
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status())) << bad.status();
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "bytes: at most")) << bad.status();
  EXPECT_TRUE(absl::IsInvalidArgument(rig.store->Offload(Key(1), nullptr, 4).status()));
  const ActivationKey bad_hint[] = {Key(1), {1, 0, 2, 0, 0}};
  EXPECT_TRUE(absl::IsInvalidArgument(rig.store->Prefetch(bad_hint).status()));
  EXPECT_EQ(rig.fake->activation().counts().reserve, before.reserve);
  EXPECT_EQ(rig.fake->activation().counts().offload_stream, before.offload_stream);
  EXPECT_EQ(rig.fake->activation().counts().prefetch, before.prefetch);
  // Wrong size: the slice stays.
  absl::Status s = rig.Fetch(Key(0), &got, 4095, AfterFetch::kKeep);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "4096")) << s;
  // Unknown and freed keys.
  s = rig.Fetch(Key(9), &got, 16);
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  ASSERT_TRUE(rig.Fetch(Key(0), &got, v.size()).ok());
  EXPECT_EQ(got, v);
  s = rig.Fetch(Key(0), &got, v.size());
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "layer 0")) << s;
}

INSTANTIATE_TEST_SUITE_P(BulkAndStream, PathTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? "Bulk" : "Stream";
                         });

TEST(ActivationStoreTest, StreamsWhenTheDaemonHasNoArenaOrTheSliceIsLarger) {
  {
    Rig rig(/*bulk=*/true, /*arena_bytes=*/0);
    const std::vector<uint8_t> v = Bytes(5000, 5);
    ASSERT_TRUE(rig.Offload(Key(0), v).ok());
    std::vector<uint8_t> got;
    ASSERT_TRUE(rig.Fetch(Key(0), &got, v.size()).ok());
    EXPECT_EQ(got, v);
    EXPECT_EQ(rig.fake->activation().counts().reserve, 0);
    EXPECT_EQ(rig.store->Stats().streamed, 2u);
  }
  Rig rig(/*bulk=*/true, /*arena_bytes=*/8192);
  const std::vector<uint8_t> small = Bytes(4000, 6), large = Bytes(20000, 7);
  ASSERT_TRUE(rig.Offload(Key(0), small).ok());
  ASSERT_TRUE(rig.Offload(Key(1), large).ok());
  std::vector<uint8_t> got;
  ASSERT_TRUE(rig.Fetch(Key(1), &got, large.size()).ok());
  EXPECT_EQ(got, large);
  ASSERT_TRUE(rig.Fetch(Key(0), &got, small.size()).ok());
  EXPECT_EQ(got, small);
  const testing::FakeActivation::Counts c = rig.fake->activation().counts();
  EXPECT_EQ(c.reserve, 1);
  EXPECT_EQ(c.offload_stream, 1);
  EXPECT_EQ(c.fetch_stream, 1);
}

TEST(ActivationStoreTest, ACorruptedSliceIsDataLoss) {
  Rig rig(true, 1 << 16, 0, nullptr, /*checksums=*/true);
  const std::vector<uint8_t> v = Bytes(3000, 8);
  ASSERT_TRUE(rig.Offload(Key(0), v).ok());
  ASSERT_TRUE(rig.Offload(Key(1), v).ok());
  EXPECT_EQ(rig.fake->activation().counts().commits_with_crc, 2);
  // A located fetch checks the daemon's checksum.
  rig.fake->activation().set_corrupt_locate_crc(true);
  std::vector<uint8_t> got;
  absl::Status s = rig.Fetch(Key(0), &got, v.size(), AfterFetch::kKeep);
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_EQ(rig.store->Stats().failures, 1u);
  // One read where it was reserved checks its own: other bytes there are
  // located and read again, and fail again.
  rig.fake->activation().set_corrupt_locate_crc(false);
  rig.fake->activation().CorruptArenaSlices();
  s = rig.Fetch(Key(1), &got, v.size());
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_EQ(rig.store->Stats().failures, 2u);
  EXPECT_EQ(rig.fake->activation().counts().free_in_place, 0);
  EXPECT_EQ(rig.fake->activation().counts().locate, 2);
}

// Without checksums (the default) the commit carries none and the fetch
// takes the bytes as the transport brought them: one read of each byte
// fewer on each side.
TEST(ActivationStoreTest, WithoutChecksumsTheTransportIsTrusted) {
  Rig rig(true, 1 << 16);
  const std::vector<uint8_t> v = Bytes(3000, 8);
  ASSERT_TRUE(rig.Offload(Key(0), v).ok());
  EXPECT_EQ(rig.fake->activation().counts().commit, 1);
  EXPECT_EQ(rig.fake->activation().counts().commits_with_crc, 0);
  rig.fake->activation().set_corrupt_locate_crc(true);  // not checked without checksums
  std::vector<uint8_t> got;
  const absl::Status s = rig.Fetch(Key(0), &got, v.size(), AfterFetch::kKeep);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(got == v);
  EXPECT_EQ(rig.fake->activation().counts().locate, 1);
  EXPECT_EQ(rig.store->Stats().streamed, 0u);
}

// A daemon that numbers no reservations (one without
// FreeActivations.if_placement) gets located fetches; a free that gets no
// answer sends the fetch to the locate unless the commit's checksum vouches
// for the bytes, and then the step's free asks the daemon.
TEST(ActivationStoreTest, FetchesLocateWhenTheDaemonCannotConfirmAFreeInPlace) {
  {
    Rig rig(true, 1 << 20);
    rig.fake->activation().set_placements(false);
    const std::vector<uint8_t> v = Bytes(5000, 40);
    ASSERT_TRUE(rig.Offload(Key(0), v).ok());
    std::vector<uint8_t> got;
    ASSERT_TRUE(rig.Fetch(Key(0), &got, v.size()).ok());
    EXPECT_EQ(got, v);
    const testing::FakeActivation::Counts c = rig.fake->activation().counts();
    EXPECT_EQ(c.locate, 1);
    EXPECT_EQ(c.free_in_place, 0);
    EXPECT_EQ(c.free, 1);
  }
  for (const bool checksums : {false, true}) {
    Rig rig(true, 1 << 20, 0, nullptr, checksums);
    rig.fake->activation().set_fail_releases(true);
    const std::vector<uint8_t> v = Bytes(5000, 41);
    ASSERT_TRUE(rig.Offload(Key(0), v).ok());
    std::vector<uint8_t> got;
    const absl::Status s = rig.Fetch(Key(0), &got, v.size());
    ASSERT_TRUE(s.ok()) << s << " checksums " << checksums;
    EXPECT_EQ(got, v);
    testing::FakeActivation::Counts c = rig.fake->activation().counts();
    EXPECT_EQ(c.free_in_place, 1);
    EXPECT_EQ(c.locate, checksums ? 0 : 1) << checksums;
    // Located, the slice was freed by a plain free; trusted by its
    // checksum, it may still be on the daemon: the step's free asks.
    EXPECT_EQ(rig.fake->activation().slices(), checksums ? 1u : 0u);
    ASSERT_TRUE(rig.store->FreeStep(1, In(absl::Seconds(10))).ok());
    EXPECT_EQ(rig.fake->activation().slices(), 0u);
    EXPECT_EQ(rig.fake->activation().counts().free, c.free + (checksums ? 1 : 0)) << checksums;
  }
}

// A slice larger than one read piece (4 MiB) comes back whole, and its
// checksum, taken piece by piece while the next piece is read, still
// catches a corruption.
TEST(ActivationStoreTest, LargeSlicesAreReadAndCheckedInPieces) {
  Rig rig(true, 16 << 20, 0, nullptr, /*checksums=*/true);
  const std::vector<uint8_t> v = Bytes((9 << 20) + 5, 9);
  ASSERT_TRUE(rig.Offload(Key(0), v).ok());
  std::vector<uint8_t> got;
  absl::Status s = rig.Fetch(Key(0), &got, v.size(), AfterFetch::kKeep);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(got == v);
  EXPECT_EQ(rig.store->Stats().streamed, 0u);
  rig.fake->activation().CorruptArenaSlices();
  s = rig.Fetch(Key(0), &got, v.size());
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
}

// The offload is asynchronous: Offload returns while the daemon is still
// committing, the buffer counts as the trainer's until the ticket completes,
// and a fetch submitted right after waits for the offload by itself.
TEST(ActivationStoreTest, OffloadsRunBehindTheCallerAndFetchesWaitForThem) {
  Rig rig(true, 1 << 20);
  rig.fake->activation().set_commit_delay(absl::Milliseconds(600));
  const std::vector<uint8_t> a = Bytes(30000, 9), b = Bytes(20000, 10);
  const absl::Time start = absl::Now();
  absl::StatusOr<ActivationTicket> ta = rig.store->Offload(Key(0), a.data(), a.size());
  absl::StatusOr<ActivationTicket> tb = rig.store->Offload(Key(1), b.data(), b.size());
  ASSERT_TRUE(ta.ok() && tb.ok());
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(500));
  EXPECT_FALSE(ta->done());
  EXPECT_EQ(rig.store->Stats().trainer_bytes, a.size() + b.size());
  std::vector<uint8_t> got(b.size());
  absl::StatusOr<ActivationTicket> tf =
      rig.store->StartFetch(Key(1), got.data(), got.size(), AfterFetch::kFree);
  ASSERT_TRUE(tf.ok());
  ASSERT_TRUE(tf->Wait(In(absl::Seconds(10))).ok());
  EXPECT_EQ(got, b);
  ASSERT_TRUE(ta->Wait(In(absl::Seconds(10))).ok());
  EXPECT_TRUE(tb->done());
  const SliceStoreStats st = rig.store->Stats();
  EXPECT_EQ(st.trainer_bytes, 0u);
  EXPECT_EQ(st.peak_trainer_bytes, a.size() + b.size() + b.size());
  EXPECT_EQ(st.stored_bytes, a.size());
}

// Ten times the arena: the daemon spills, fetches read back, a prefetch
// hint brings spilled slices back, and FreeStep frees what was not fetched.
TEST(ActivationStoreTest, SlicesBeyondTheArenaSpillAndComeBack) {
  Rig rig(true, 16 << 10);
  std::vector<std::vector<uint8_t>> v;
  for (uint32_t l = 0; l < 10; ++l) {
    v.push_back(Bytes(16000, 20 + l));
    ASSERT_TRUE(rig.Offload(Key(l), v.back()).ok()) << l;
  }
  EXPECT_GE(rig.fake->activation().counts().spills, 9u);
  const ActivationKey hint[] = {Key(8), Key(7)};
  absl::StatusOr<ActivationTicket> p = rig.store->Prefetch(hint);
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(p->Wait(In(absl::Seconds(10))).ok());
  EXPECT_EQ(rig.fake->activation().counts().prefetch, 1);
  for (int l = 9; l >= 2; --l) {
    std::vector<uint8_t> got;
    ASSERT_TRUE(rig.Fetch(Key(l), &got, v[l].size()).ok()) << l;
    EXPECT_EQ(got, v[l]) << l;
  }
  EXPECT_GT(rig.store->Stats().spilled_fetches, 0u);
  // Slices spilled since their commit were not where they were reserved:
  // those fetches located them (the daemon answered `moved`).
  const testing::FakeActivation::Counts c = rig.fake->activation().counts();
  EXPECT_GT(c.locate, 0);
  EXPECT_EQ(c.free_in_place, 8);
  absl::StatusOr<uint64_t> freed = rig.store->FreeStep(1, In(absl::Seconds(10)));
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 2u * 16000);
  EXPECT_EQ(rig.fake->activation().slices(), 0u);
  EXPECT_EQ(rig.store->Stats().stored_bytes, 0u);
}

// A Put into a reservation has half the reservation's lease, whatever the
// store's rpc_timeout (the daemon may hand the block out again at the
// lease's end).
TEST(ActivationStoreTest, APutIntoAReservationHasHalfItsLease) {
  Rig rig(true, 1 << 20);
  rig.fake->activation().set_reservation_lease(absl::Milliseconds(400));
  rig.faults->SetMode(0, FaultyTransport::Mode::kStalled);  // the endpoint's one
  const std::vector<uint8_t> a = Bytes(10000, 40);
  const absl::Time start = absl::Now();
  const absl::Status s = rig.Offload(Key(0), a);
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "rpc_timeout is 10 s";
  FakeActivation::Counts counts = rig.fake->activation().counts();
  EXPECT_EQ(counts.reserve, 1);
  EXPECT_EQ(counts.commit, 0);
  EXPECT_EQ(counts.free, 1);  // handed back (the daemon keeps the block out its lease)
  // The connection of the stopped Put was closed by its abort: the next
  // offload connects again.
  for (uint32_t layer = 1; layer <= 2; ++layer) {
    const absl::Status again = rig.Offload(Key(layer), a);
    ASSERT_TRUE(again.ok()) << again;
  }
  std::vector<uint8_t> got;
  ASSERT_TRUE(rig.Fetch(Key(1), &got, a.size()).ok());
  EXPECT_EQ(got, a);
}

// FreeStep sends FreeActivations unless the daemon confirmed every slice of
// the step freed: a failed offload may have left one there.
TEST(ActivationStoreTest, FreeStepAsksTheDaemonOnlyForSlicesItMayStillHold) {
  FakeShard::Options o;
  o.activation_arena_bytes = 16 << 10;
  o.activation_spill_bytes = 0;
  std::unique_ptr<FakeShard> fake = *FakeShard::Start(o);
  Rig rig(true, 0, 0, fake.get());
  const std::vector<uint8_t> a = Bytes(10000, 30), b = Bytes(10000, 31);
  ASSERT_TRUE(rig.Offload(Key(0, 1), a).ok());
  const absl::Status full = rig.Offload(Key(1, 1), b);
  ASSERT_TRUE(absl::IsResourceExhausted(full)) << full;
  std::vector<uint8_t> got;
  ASSERT_TRUE(rig.Fetch(Key(0, 1), &got, a.size()).ok());
  EXPECT_EQ(got, a);
  int frees = fake->activation().counts().free;
  ASSERT_TRUE(rig.store->FreeStep(1, In(absl::Seconds(10))).ok());
  EXPECT_EQ(fake->activation().counts().free, frees + 1);

  ASSERT_TRUE(rig.Offload(Key(0, 2), b).ok());
  ASSERT_TRUE(rig.Fetch(Key(0, 2), &got, b.size()).ok());
  EXPECT_EQ(got, b);
  frees = fake->activation().counts().free;
  ASSERT_TRUE(rig.store->FreeStep(2, In(absl::Seconds(10))).ok());
  EXPECT_EQ(fake->activation().counts().free, frees);
  // A slice kept after its fetch is still there: freed by the step's free.
  ASSERT_TRUE(rig.Offload(Key(0, 3), a).ok());
  ASSERT_TRUE(rig.Fetch(Key(0, 3), &got, a.size(), AfterFetch::kKeep).ok());
  absl::StatusOr<uint64_t> freed = rig.store->FreeStep(3, In(absl::Seconds(10)));
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, a.size());
  EXPECT_EQ(fake->activation().slices(), 0u);
}

// P_a over daemons: an MP group of M ranks (M = 2, 3) each offloads its
// slice of one checkpoint of 1001 fp32 elements (neither M divides it) to the
// same daemon, fetches it back, and the collected slices reassemble the
// tensor bit for bit.
TEST(ActivationStoreTest, MpSlicesThroughADaemonReassembleBitForBit) {
  FakeShard::Options o;
  o.activation_arena_bytes = 1 << 20;
  std::unique_ptr<FakeShard> fake = *FakeShard::Start(o);
  const std::vector<uint8_t> original = Bytes(1001 * 4, 30);
  for (uint32_t m : {2u, 3u}) {
    std::vector<std::unique_ptr<Rig>> group;
    for (uint32_t r = 0; r < m; ++r) {
      group.push_back(std::make_unique<Rig>(r % 2 == 0, 0, r, fake.get()));
      const ActivationSliceRange s = *ActivationSlice(original.size(), 4, r, m);
      const std::vector<uint8_t> slice(original.begin() + s.offset,
                                       original.begin() + s.offset + s.bytes);
      ASSERT_TRUE(group[r]->Offload({3, 0, 5, r, m}, slice).ok());
    }
    std::vector<std::vector<uint8_t>> fetched(m);
    for (uint32_t r = 0; r < m; ++r) {
      const ActivationSliceRange s = *ActivationSlice(original.size(), 4, r, m);
      ASSERT_TRUE(group[r]->Fetch({3, 0, 5, r, m}, &fetched[r], s.bytes).ok());
    }
    std::vector<absl::Span<const uint8_t>> parts(fetched.begin(), fetched.end());
    std::vector<uint8_t> whole(original.size());
    ASSERT_TRUE(ReassembleActivation(parts, 4, whole.data(), whole.size()).ok());
    EXPECT_EQ(std::memcmp(whole.data(), original.data(), whole.size()), 0) << "M " << m;
  }
  EXPECT_EQ(fake->activation().slices(), 0u);
}

}  // namespace
}  // namespace zeroshard
