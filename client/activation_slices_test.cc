// P_a: the cut of a checkpoint into M model-parallel slices (element-aligned,
// not necessarily equal) and its reassembly, bit for bit, with each MP rank
// of a simulated group keeping its slice in a store of its own.

#include "client/activation_slices.h"

#include <cstring>
#include <random>
#include <vector>

#include "client/activation_store.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(ActivationSlicesTest, SlicesTileTheTensorAtElementBoundaries) {
  for (uint32_t m : {1u, 2u, 3u, 4u, 7u}) {
    for (uint64_t elements : {0ull, 1ull, 2ull, 5ull, 1001ull, 4096ull}) {
      for (size_t esize : {size_t{1}, size_t{2}, size_t{4}}) {
        uint64_t next = 0, smallest = UINT64_MAX, largest = 0;
        for (uint32_t r = 0; r < m; ++r) {
          absl::StatusOr<ActivationSliceRange> s = ActivationSlice(elements * esize, esize, r, m);
          ASSERT_TRUE(s.ok()) << s.status();
          EXPECT_EQ(s->offset, next);
          EXPECT_EQ(s->offset % esize, 0u);
          EXPECT_EQ(s->bytes % esize, 0u);
          next = s->offset + s->bytes;
          smallest = std::min(smallest, s->bytes / esize);
          largest = std::max(largest, s->bytes / esize);
        }
        EXPECT_EQ(next, elements * esize) << "M " << m << " elements " << elements;
        EXPECT_LE(largest - smallest, 1u);
      }
    }
  }
}

TEST(ActivationSlicesTest, RejectsBadArguments) {
  EXPECT_TRUE(absl::IsInvalidArgument(ActivationSlice(10, 4, 0, 2).status()));  // not whole
  EXPECT_TRUE(absl::IsInvalidArgument(ActivationSlice(8, 0, 0, 2).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ActivationSlice(8, 4, 0, 0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ActivationSlice(8, 4, 2, 2).status()));
  // No key could carry more MP slices than the daemon accepts.
  EXPECT_TRUE(ActivationSlice(8, 4, 0, kMaxModelParallel).ok());
  const absl::Status m = ActivationSlice(8, 4, 0, kMaxModelParallel + 1).status();
  EXPECT_TRUE(absl::IsInvalidArgument(m)) << m;
  EXPECT_NE(m.message().find("mp_size: must be in [1, 4096]"), std::string::npos) << m;
  std::vector<uint8_t> whole(12), a(4), b(4);  // slice 0 has 8 bytes
  const absl::Span<const uint8_t> parts[] = {a, b};
  const absl::Status s = ReassembleActivation(parts, 4, whole.data(), whole.size());
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_NE(s.message().find("slices[0]"), std::string::npos) << s;
}

// An MP group of M ranks: each cuts its slice of the same checkpoint and
// offloads it to its own store; each fetches its slice back, and the
// all-gather among them (here: collecting the fetched slices) reassembles
// the tensor.
void RoundTripThroughGroup(uint32_t m, const std::vector<uint8_t>& original, size_t esize) {
  std::vector<LocalSliceStore> stores(m);
  for (uint32_t r = 0; r < m; ++r) {
    const ActivationSliceRange s = *ActivationSlice(original.size(), esize, r, m);
    const ActivationKey key{7, 0, 3, r, m};
    ASSERT_TRUE(
        stores[r].Offload(key, original.data() + s.offset, std::max<uint64_t>(1, s.bytes)).ok());
  }
  std::vector<std::vector<uint8_t>> fetched(m);
  for (uint32_t r = 0; r < m; ++r) {
    const ActivationSliceRange s = *ActivationSlice(original.size(), esize, r, m);
    fetched[r].resize(std::max<uint64_t>(1, s.bytes));
    ASSERT_TRUE(stores[r]
                    .Fetch({7, 0, 3, r, m}, fetched[r].data(), fetched[r].size(), AfterFetch::kFree,
                           absl::InfiniteFuture())
                    .ok());
    fetched[r].resize(s.bytes);
  }
  std::vector<absl::Span<const uint8_t>> parts(fetched.begin(), fetched.end());
  std::vector<uint8_t> whole(original.size(), 0xAB);
  ASSERT_TRUE(ReassembleActivation(parts, esize, whole.data(), whole.size()).ok());
  EXPECT_EQ(std::memcmp(whole.data(), original.data(), original.size()), 0) << "M " << m;
}

TEST(ActivationSlicesTest, MpGroupsOfTwoAndThreeReassembleBitForBit) {
  std::mt19937 rng(12);
  // 1001 elements: neither 2 nor 3 divides it.
  for (size_t esize : {size_t{4}, size_t{2}}) {
    std::vector<uint8_t> original(1001 * esize);
    for (uint8_t& b : original) b = static_cast<uint8_t>(rng());
    for (uint32_t m : {2u, 3u}) RoundTripThroughGroup(m, original, esize);
  }
}

}  // namespace
}  // namespace zeroshard
