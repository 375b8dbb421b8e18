// The trainer's activation stores: the daemon-backed one returns the very
// tensors saved (shape, dtype, bytes), fetches ahead in backward order, and
// holds checkpoints for its prefetch depth and in-flight offloads only, not
// for the model's depth; over a client LocalSliceStore and over a
// stand-in daemon (client/testing/fake_shard.h) on the inproc transport.

#include "examples/activation_store.h"

#include <cstring>

#include "client/bulk_data_path.h"
#include "client/rpc.h"
#include "client/testing/fake_shard.h"
#include "gtest/gtest.h"

namespace zeroshard::examples {
namespace {

constexpr int kLayers = 12;

torch::Tensor Checkpoint(int layer) {
  torch::manual_seed(layer);
  // Shapes and dtypes differ by layer; the last is not contiguous.
  if (layer % 3 == 1) return torch::randn({3, 17, 5}).to(torch::kBFloat16);
  if (layer == kLayers - 1) return torch::randn({16, 9}).t();
  return torch::randn({4, 33, 8});
}

bool SameBytes(const torch::Tensor& a, const torch::Tensor& b) {
  const torch::Tensor ca = a.contiguous(), cb = b.contiguous();
  return ca.sizes() == cb.sizes() && ca.scalar_type() == cb.scalar_type() &&
         std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.numel() * ca.element_size()) == 0;
}

// The layers in the order backward loads them.
std::vector<int> BackwardOrder() {
  std::vector<int> order;
  for (int l = kLayers - 1; l >= 0; --l) order.push_back(l);
  return order;
}

// One step: every layer saved, then loaded in backward order, each load
// equal to its save.
void RunStep(ActivationStore& store, uint64_t step) {
  ASSERT_TRUE(store.BeginStep(step).ok());
  for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(store.Save(l, Checkpoint(l)).ok());
  ASSERT_TRUE(store.BeginBackward(BackwardOrder()).ok());
  for (int l : BackwardOrder()) {
    absl::StatusOr<torch::Tensor> t = store.Load(l);
    ASSERT_TRUE(t.ok()) << "step " << step << " layer " << l << ": " << t.status();
    EXPECT_TRUE(SameBytes(*t, Checkpoint(l))) << "step " << step << " layer " << l;
  }
  ASSERT_TRUE(store.EndStep().ok());
  EXPECT_EQ(store.bytes(), 0u);
}

// Two steps of forward saves and backward loads; every load equals its save.
// `keep_last`: DaemonActivationStore::Options::keep_last.
void RunSteps(ActivationStore& store, bool keeps_all, uint32_t keep_last = 1) {
  uint64_t largest = 0, total = 0;
  for (int l = 0; l < kLayers; ++l) {
    const torch::Tensor t = Checkpoint(l);
    largest = std::max<uint64_t>(largest, t.numel() * t.element_size());
    total += t.numel() * t.element_size();
  }
  for (uint64_t step = 1; step <= 2; ++step) RunStep(store, step);
  EXPECT_EQ(store.peak_step_bytes(), total);
  if (keeps_all) {
    EXPECT_EQ(store.peak_bytes(), total);
  } else {
    // Two offloads in flight and those kept, or two fetches ahead, the one
    // loaded and those still kept: with one kept, at most three checkpoints
    // at a time, of twelve.
    EXPECT_LE(store.peak_bytes(), (2 + std::max(1u, keep_last)) * largest);
    if (keep_last <= 1) EXPECT_LT(store.peak_bytes(), total / 2);
  }
}

TEST(ActivationStoreTest, InMemoryKeepsEveryCheckpoint) {
  InMemoryActivationStore store;
  RunSteps(store, true);
  EXPECT_TRUE(absl::IsNotFound(store.Load(3).status()));
}

TEST(ActivationStoreTest, DaemonStoreOverALocalClientStoreHoldsOnlyItsDepth) {
  auto client_store = std::make_unique<LocalSliceStore>();
  LocalSliceStore* inner = client_store.get();
  DaemonActivationStore store(std::move(client_store), {});
  RunSteps(store, false);
  EXPECT_EQ(inner->Stats().stored_bytes, 0u);
  // The last checkpoint of each step stays in the trainer (keep_last 1).
  EXPECT_EQ(inner->Stats().fetches, 2u * (kLayers - 1));
  EXPECT_TRUE(absl::IsNotFound(store.Load(3).status()));
}

// A LocalSliceStore that has no room for some layers' slices: layer 2's
// offload fails at once with RESOURCE_EXHAUSTED (a full arena), layer 5's on
// its ticket with UNAVAILABLE (a daemon whose spill disk hangs), in step 1
// only; layer 7's always fails with DATA_LOSS, in step 2 only.
class RefusingStore final : public ActivationSliceStore {
 public:
  std::string name() const override { return "refusing"; }
  absl::StatusOr<ActivationTicket> Offload(const ActivationKey& key, const void* data,
                                           uint64_t bytes) override {
    if (key.step == 1 && key.layer == 2) return absl::ResourceExhaustedError("arena full");
    if (key.step == 1 && key.layer == 5) {
      return ActivationTicket::Ready(absl::UnavailableError("spill disk hung"));
    }
    if (key.step == 2 && key.layer == 7) return ActivationTicket::Ready(absl::DataLossError("bad"));
    return inner_.Offload(key, data, bytes);
  }
  absl::StatusOr<ActivationTicket> StartFetch(const ActivationKey& key, void* dst, uint64_t bytes,
                                              AfterFetch then) override {
    return inner_.StartFetch(key, dst, bytes, then);
  }
  absl::StatusOr<ActivationTicket> Prefetch(absl::Span<const ActivationKey> keys) override {
    return inner_.Prefetch(keys);
  }
  absl::StatusOr<uint64_t> Free(const ActivationKey& key, absl::Time deadline) override {
    return inner_.Free(key, deadline);
  }
  absl::StatusOr<uint64_t> FreeStep(uint64_t step, absl::Time deadline) override {
    return inner_.FreeStep(step, deadline);
  }
  SliceStoreStats Stats() const override { return inner_.Stats(); }

 private:
  LocalSliceStore inner_;
};

// Checkpoints the store has no room for stay in the trainer and load as
// saved; another failure is the step's error.
TEST(ActivationStoreTest, CheckpointsTheStoreHasNoRoomForStayInTheTrainer) {
  DaemonActivationStore::Options o;
  o.keep_last = 0;
  DaemonActivationStore store(std::make_unique<RefusingStore>(), o);
  RunStep(store, 1);
  EXPECT_EQ(store.refused(), 2u);

  ASSERT_TRUE(store.BeginStep(2).ok());
  absl::Status failed;
  for (int l = 0; l < kLayers && failed.ok(); ++l) failed = store.Save(l, Checkpoint(l));
  if (failed.ok()) failed = store.BeginBackward(BackwardOrder());
  EXPECT_EQ(failed.code(), absl::StatusCode::kDataLoss) << failed;
  EXPECT_EQ(store.refused(), 2u);
}

TEST(ActivationStoreTest, DaemonStoreOverAStandInDaemon) {
  for (uint32_t keep_last : {0u, 1u, 3u}) {
    SCOPED_TRACE(keep_last);
    testing::FakeShard::Options fo;
    fo.activation_arena_bytes = 16 << 10;  // half a step: the daemon spills
    std::unique_ptr<testing::FakeShard> fake = *testing::FakeShard::Start(fo);
    auto channel = MakeDaemonChannel(fake->address(), ChannelSecurity::Plaintext());
    BulkDataPath path(fake->address(), channel, *BulkTransport::Create("inproc", {}), {});
    {
      auto client_store =
          std::make_unique<DaemonSliceStore>(DaemonSliceStore::Owner{"job", 0, 1}, fake->address(),
                                             channel, &path, DaemonSliceStore::Options{});
      DaemonActivationStore::Options o;
      o.prefetch_depth = 2;
      o.max_offloads_in_flight = 2;
      o.keep_last = keep_last;
      DaemonActivationStore store(std::move(client_store), o);
      RunSteps(store, false, keep_last);
      // The last keep_last checkpoints of each step never leave the trainer.
      const SliceStoreStats st = store.stats();
      EXPECT_EQ(st.offloads, 2u * (kLayers - keep_last));
      EXPECT_EQ(st.fetches, 2u * (kLayers - keep_last));
      EXPECT_EQ(st.failures, 0u);
      EXPECT_GT(st.spilled_fetches, 0u);
    }
    EXPECT_EQ(fake->activation().slices(), 0u);
    EXPECT_GT(fake->activation().counts().prefetch, 0);
  }
}

}  // namespace
}  // namespace zeroshard::examples
