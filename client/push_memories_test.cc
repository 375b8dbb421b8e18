#include "client/push_memories.h"

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(PushMemoriesTest, FindsTheMemoryARangeLiesInWhileItsOwnerHoldsIt) {
  PushMemories memories;
  absl::StatusOr<std::shared_ptr<transport::PushMemory>> a = memories.Allocate(8192);
  absl::StatusOr<std::shared_ptr<transport::PushMemory>> b = memories.Allocate(4096);
  ASSERT_TRUE(a.ok() && b.ok());
  char* in_b = static_cast<char*>((*b)->data()) + 100;
  std::optional<PushMemories::Found> found = memories.Find(in_b, 200);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->memory.get(), b->get());
  EXPECT_EQ(found->offset, 100u);
  const uint64_t b_serial = found->serial;
  found = memories.Find((*a)->data(), (*a)->size());
  ASSERT_TRUE(found.has_value());
  EXPECT_NE(found->serial, b_serial);
  // Not whole inside one, empty, or elsewhere: not found.
  EXPECT_FALSE(memories.Find(in_b, (*b)->size()).has_value());
  EXPECT_FALSE(memories.Find(in_b, 0).has_value());
  int elsewhere = 0;
  EXPECT_FALSE(memories.Find(&elsewhere, sizeof(elsewhere)).has_value());
  // Let go of by its owner: no longer found, and a later memory gets a new
  // serial even at the same address.
  found.reset();
  b->reset();
  EXPECT_FALSE(memories.Find(in_b, 1).has_value());
  absl::StatusOr<std::shared_ptr<transport::PushMemory>> c = memories.Allocate(4096);
  ASSERT_TRUE(c.ok());
  found = memories.Find((*c)->data(), 1);
  ASSERT_TRUE(found.has_value());
  EXPECT_NE(found->serial, b_serial);
}

}  // namespace
}  // namespace zeroshard
