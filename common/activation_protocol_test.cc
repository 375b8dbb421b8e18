#include "common/activation_protocol.h"

#include <limits>
#include <map>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/hash/hash_testing.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

ActivationKey Key(uint64_t step, uint32_t micro_batch, uint32_t layer, uint32_t mp_rank = 0,
                  uint32_t mp_size = 1) {
  return ActivationKey{step, micro_batch, layer, mp_rank, mp_size};
}

// The status's message when it is InvalidArgument; fails the test otherwise.
std::string Rejection(const absl::Status& s) {
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  return std::string(s.message());
}

TEST(ActivationProtocolTest, DefaultKeyIsValid) {
  EXPECT_TRUE(ValidateActivationKey(ActivationKey{}).ok());
  EXPECT_EQ(ActivationKey{}.mp_size, 1u);
}

TEST(ActivationProtocolTest, ModelParallelDegreeBounds) {
  EXPECT_TRUE(ValidateActivationKey(Key(1, 0, 0, 0, 1)).ok());
  EXPECT_TRUE(ValidateActivationKey(Key(1, 0, 0, kMaxModelParallel - 1, kMaxModelParallel)).ok());
  EXPECT_EQ(Rejection(ValidateActivationKey(Key(1, 0, 0, 0, 0))),
            "key.mp_size: must be in [1, 4096], got 0");
  EXPECT_EQ(Rejection(ValidateActivationKey(Key(1, 0, 0, 0, kMaxModelParallel + 1))),
            "key.mp_size: must be in [1, 4096], got 4097");
  EXPECT_EQ(Rejection(ValidateActivationKey(Key(1, 0, 0, 2, 2))),
            "key.mp_rank: must be < mp_size (2), got 2");
  EXPECT_EQ(Rejection(ValidateActivationKey(
                Key(1, 0, 0, std::numeric_limits<uint32_t>::max(), kMaxModelParallel))),
            "key.mp_rank: must be < mp_size (4096), got 4294967295");
}

TEST(ActivationProtocolTest, MessagesNameTheKeyField) {
  EXPECT_EQ(Rejection(ValidateActivationKey(Key(1, 0, 0, 3, 3), "keys[1]")),
            "keys[1].mp_rank: must be < mp_size (3), got 3");
  EXPECT_EQ(Rejection(ValidateActivationKey(Key(1, 0, 0, 0, 0), "chunk 0.key")),
            "chunk 0.key.mp_size: must be in [1, 4096], got 0");
  EXPECT_EQ(Rejection(ValidateModelParallelRank(0, 0, "")), "mp_size: must be in [1, 4096], got 0");
}

TEST(ActivationProtocolTest, SliceBytes) {
  EXPECT_TRUE(ValidateActivationSliceBytes(1, "bytes").ok());
  EXPECT_TRUE(ValidateActivationSliceBytes(kMaxActivationSliceBytes, "bytes").ok());
  EXPECT_EQ(Rejection(ValidateActivationSliceBytes(0, "bytes")), "bytes: must be >= 1");
  EXPECT_EQ(Rejection(ValidateActivationSliceBytes(kMaxActivationSliceBytes + 1, "total_bytes")),
            "total_bytes: at most 68719476736 bytes per slice, got 68719476737");
}

TEST(ActivationProtocolTest, RoundTripThroughTheWire) {
  constexpr uint32_t kMax32 = std::numeric_limits<uint32_t>::max();
  for (const ActivationKey& k :
       {ActivationKey{}, Key(7, 2, 31, 3, 4), Key(std::numeric_limits<uint64_t>::max(), kMax32,
                                                  kMax32, kMaxModelParallel - 1,
                                                  kMaxModelParallel)}) {
    const v1::ActivationKey wire = ActivationKeyToProto(k);
    EXPECT_EQ(wire.step(), k.step);
    EXPECT_EQ(wire.micro_batch(), k.micro_batch);
    EXPECT_EQ(wire.layer(), k.layer);
    EXPECT_EQ(wire.mp_rank(), k.mp_rank);
    EXPECT_EQ(wire.mp_size(), k.mp_size);
    EXPECT_EQ(ActivationKeyFromProto(wire), k);
    absl::StatusOr<ActivationKey> parsed = ParseActivationKey(wire);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, k) << DescribeActivationKey(k);
  }
}

TEST(ActivationProtocolTest, ParseValidatesWhatFromProtoTakesAsItIs) {
  // A default wire key says mp_size 0 (proto3): not a key.
  const v1::ActivationKey unset;
  EXPECT_EQ(ActivationKeyFromProto(unset).mp_size, 0u);
  EXPECT_EQ(Rejection(ParseActivationKey(unset).status()),
            "key.mp_size: must be in [1, 4096], got 0");
  v1::ActivationKey k = ActivationKeyToProto(Key(1, 0, 0, 5, 5));
  EXPECT_EQ(Rejection(ParseActivationKey(k, "keys[2]").status()),
            "keys[2].mp_rank: must be < mp_size (5), got 5");
}

TEST(ActivationProtocolTest, StepOrdersFirst) {
  // A step's keys are adjacent in an ordered map whatever their other fields.
  std::map<ActivationKey, int> m;
  m[Key(2, 0, 0)] = 0;
  m[Key(1, 9, 9, 3, 4)] = 1;
  m[Key(3, 0, 0)] = 2;
  m[Key(2, 5, 1, 1, 2)] = 3;
  m[Key(1, 0, 0)] = 4;
  std::vector<uint64_t> steps;
  for (const auto& [k, v] : m) steps.push_back(k.step);
  EXPECT_EQ(steps, (std::vector<uint64_t>{1, 1, 2, 2, 3}));
  EXPECT_LT(Key(1, 0, 1), Key(1, 1, 0));  // micro-batch before layer
  EXPECT_NE(Key(1, 0, 0, 0, 1), Key(1, 0, 0, 0, 2));
}

TEST(ActivationProtocolTest, Hash) {
  EXPECT_TRUE(absl::VerifyTypeImplementsAbslHashCorrectly(
      {ActivationKey{}, Key(1, 0, 0), Key(0, 1, 0), Key(0, 0, 1), Key(0, 0, 0, 1, 2),
       Key(0, 0, 0, 0, 2), Key(1, 2, 3, 4, 5)}));
  absl::flat_hash_set<ActivationKey> set = {Key(1, 0, 0), Key(1, 0, 0), Key(1, 0, 1)};
  EXPECT_EQ(set.size(), 2u);
}

TEST(ActivationProtocolTest, Describe) {
  EXPECT_EQ(DescribeActivationKey(Key(7, 2, 31, 3, 4)), "step 7 micro-batch 2 layer 31 mp 3/4");
}

}  // namespace
}  // namespace zeroshard
