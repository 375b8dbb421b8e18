#include "transport/piece_plan.h"

#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard::transport {
namespace {

std::vector<PiecePlan::Piece> AllPieces(PiecePlan plan) {
  std::vector<PiecePlan::Piece> pieces;
  while (!plan.done()) pieces.push_back(plan.Next());
  return pieces;
}

TEST(PiecePlanTest, CutsIntoFullPiecesAndOneShortLastPiece) {
  const std::vector<PiecePlan::Piece> pieces = AllPieces(PiecePlan(10, 4));
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0].offset, 0u);
  EXPECT_EQ(pieces[0].length, 4u);
  EXPECT_EQ(pieces[1].offset, 4u);
  EXPECT_EQ(pieces[1].length, 4u);
  EXPECT_EQ(pieces[2].offset, 8u);
  EXPECT_EQ(pieces[2].length, 2u);
}

TEST(PiecePlanTest, ExactMultipleHasNoEmptyTail) {
  const std::vector<PiecePlan::Piece> pieces = AllPieces(PiecePlan(8, 4));
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(pieces[1].offset + pieces[1].length, 8u);
}

TEST(PiecePlanTest, PieceLargerThanTheOperationAndNoLimitGiveOnePiece) {
  for (const PiecePlan& plan : {PiecePlan(5, 1 << 20), PiecePlan(5)}) {
    const std::vector<PiecePlan::Piece> pieces = AllPieces(plan);
    ASSERT_EQ(pieces.size(), 1u);
    EXPECT_EQ(pieces[0].length, 5u);
  }
}

TEST(PiecePlanTest, EmptyOperationIsDoneAtOnce) {
  EXPECT_TRUE(PiecePlan().done());
  PiecePlan plan(0, 4);
  EXPECT_TRUE(plan.done());
  const PiecePlan::Piece piece = plan.Next();
  EXPECT_EQ(piece.length, 0u);
  EXPECT_TRUE(plan.done());
}

TEST(PiecePlanTest, HugeLengthsDoNotOverflow) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  PiecePlan plan(kMax, kMax - 1);
  EXPECT_EQ(plan.Next().length, kMax - 1);
  const PiecePlan::Piece last = plan.Next();
  EXPECT_EQ(last.offset, kMax - 1);
  EXPECT_EQ(last.length, 1u);
  EXPECT_TRUE(plan.done());
}

TEST(PiecePlanTest, ReceiverTakesUpToTheLengthAndRefusesMore) {
  PiecePlan plan(10);
  EXPECT_TRUE(plan.Take(3));
  EXPECT_TRUE(plan.Take(0));
  EXPECT_EQ(plan.offset(), 3u);
  EXPECT_EQ(plan.remaining(), 7u);
  EXPECT_FALSE(plan.Take(8));  // past the end: nothing taken
  EXPECT_EQ(plan.offset(), 3u);
  EXPECT_FALSE(plan.Take(std::numeric_limits<uint64_t>::max()));
  EXPECT_TRUE(plan.Take(7));
  EXPECT_TRUE(plan.done());
  EXPECT_FALSE(plan.Take(1));
}

TEST(PartBytesTest, SplitsIntoAlignedPartsTheLastTakingTheRest) {
  constexpr uint64_t kMiB = 1 << 20;
  // Long enough for every part: as many parts as allowed.
  EXPECT_EQ(PartBytes(32 * kMiB, 2, kMiB, 4096), 16 * kMiB);
  EXPECT_EQ(AllPieces(PiecePlan(32 * kMiB, PartBytes(32 * kMiB, 4, kMiB, 4096))).size(), 4u);
  // An odd length: parts but the last page-aligned, together exactly it.
  const uint64_t odd = 3 * kMiB + 123;
  const uint64_t part = PartBytes(odd, 2, kMiB, 4096);
  EXPECT_EQ(part % 4096, 0u);
  const std::vector<PiecePlan::Piece> pieces = AllPieces(PiecePlan(odd, part));
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(pieces[1].offset + pieces[1].length, odd);
  EXPECT_GE(pieces[1].length, kMiB);
  // Too short for two parts of the minimum, or one part allowed: whole.
  EXPECT_EQ(PartBytes(kMiB + kMiB / 2, 2, kMiB, 4096), kMiB + kMiB / 2);
  EXPECT_EQ(PartBytes(32 * kMiB, 1, kMiB, 4096), 32 * kMiB);
  EXPECT_EQ(PartBytes(32 * kMiB, 0, kMiB, 4096), 32 * kMiB);
  // Three allowed, length for two: two.
  EXPECT_EQ(AllPieces(PiecePlan(2 * kMiB, PartBytes(2 * kMiB, 3, kMiB, 4096))).size(), 2u);
  // Just over two minimums: the last part is the rest, below the minimum.
  const std::vector<PiecePlan::Piece> rest =
      AllPieces(PiecePlan(2 * kMiB + 1, PartBytes(2 * kMiB + 1, 2, kMiB, 4096)));
  ASSERT_EQ(rest.size(), 2u);
  EXPECT_EQ(rest[0].length, kMiB + 4096);
  EXPECT_EQ(rest[1].length, kMiB - 4095);
}

TEST(PartBytesTest, EdgeCasesGiveAtMostTheAllowedPartsCoveringTheLength) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  EXPECT_EQ(PartBytes(0, 2, 1 << 20, 4096), 0u);
  EXPECT_TRUE(AllPieces(PiecePlan(0, PartBytes(0, 2, 1 << 20, 4096))).empty());
  // No minimum: as many parts as allowed, whatever the length.
  EXPECT_EQ(AllPieces(PiecePlan(10, PartBytes(10, 3, 0, 1))).size(), 3u);
  // Alignment 0 counts as 1; an alignment past the length leaves one part.
  EXPECT_EQ(PartBytes(10, 2, 0, 0), 5u);
  EXPECT_EQ(AllPieces(PiecePlan(10, PartBytes(10, 2, 0, 4096))).size(), 1u);
  // The largest length: two parts that cover it, no overflow.
  const uint64_t half = PartBytes(kMax, 2, 1, 4096);
  EXPECT_EQ(half % 4096, 0u);
  const std::vector<PiecePlan::Piece> huge = AllPieces(PiecePlan(kMax, half));
  ASSERT_EQ(huge.size(), 2u);
  EXPECT_EQ(huge[0].length + huge[1].length, kMax);
}

}  // namespace
}  // namespace zeroshard::transport
