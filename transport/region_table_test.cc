#include "transport/region_table.h"

#include <atomic>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace zeroshard::transport {
namespace {

bool Live(RegionRecord& record) {
  absl::ReaderMutexLock lock(&record.mu);
  return record.live;
}

TEST(RegionTableTest, AddKeepsFieldsAndFindReturnsTheRecord) {
  RegionTable table;
  char buffer[16];
  auto record = table.Add(7, buffer, sizeof(buffer), Access::kRemoteRead);
  EXPECT_NE(record->id, 0u);
  EXPECT_EQ(record->owner, 7u);
  EXPECT_EQ(record->base, buffer);
  EXPECT_EQ(record->length, sizeof(buffer));
  EXPECT_EQ(record->access, Access::kRemoteRead);
  EXPECT_TRUE(Live(*record));
  EXPECT_EQ(table.Find(record->id), record);
  EXPECT_EQ(table.Find(record->id + 1), nullptr);
}

TEST(RegionTableTest, IdsAreUnique) {
  RegionTable table;
  char buffer[1];
  std::vector<std::shared_ptr<RegionRecord>> records;
  absl::flat_hash_set<uint64_t> ids;
  for (int i = 0; i < 100; ++i) {
    records.push_back(table.Add(i % 3, buffer, 1, Access::kRemoteReadWrite));
    EXPECT_TRUE(ids.insert(records.back()->id).second);
  }
  // Revoking one does not free its id for reuse.
  table.Revoke(*records[50]);
  EXPECT_TRUE(
      ids.insert(table.Add(0, buffer, 1, Access::kRemoteReadWrite)->id).second);
}

TEST(RegionTableTest, TokensDiffer) {
  RegionTable table;
  char buffer[1];
  absl::flat_hash_set<uint64_t> tokens;
  for (int i = 0; i < 100; ++i) {
    tokens.insert(table.Add(0, buffer, 1, Access::kRemoteReadWrite)->token);
  }
  EXPECT_EQ(tokens.size(), 100u);
}

TEST(RegionTableTest, FindAfterRevokeIsNull) {
  RegionTable table;
  char buffer[1];
  auto record = table.Add(0, buffer, 1, Access::kRemoteReadWrite);
  auto other = table.Add(0, buffer, 1, Access::kRemoteReadWrite);
  table.Revoke(*record);
  EXPECT_EQ(table.Find(record->id), nullptr);
  EXPECT_FALSE(Live(*record));
  EXPECT_EQ(table.Find(other->id), other);
  EXPECT_TRUE(Live(*other));
  table.Revoke(*record);  // idempotent
  EXPECT_FALSE(Live(*record));
}

// Runs `revoke` on a thread while another holds `record.mu` shared: the
// table forgets the record at once, but `revoke` returns only after the
// holder lets go, and leaves the record dead.
void ExpectRevocationWaitsForHolder(RegionTable& table, RegionRecord& record,
                                    const std::function<void()>& revoke) {
  absl::Notification holding, release;
  std::thread copier([&] {
    absl::ReaderMutexLock lock(&record.mu);
    holding.Notify();
    release.WaitForNotification();
  });
  holding.WaitForNotification();
  std::atomic<bool> revoked{false};
  std::thread revoker([&] {
    revoke();
    revoked = true;
  });
  while (table.Find(record.id) != nullptr) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(revoked);
  release.Notify();
  revoker.join();
  copier.join();
  EXPECT_TRUE(revoked);
  EXPECT_FALSE(Live(record));
}

TEST(RegionTableTest, RevokeWaitsForAHolderOfTheSharedLock) {
  RegionTable table;
  char buffer[1];
  auto record = table.Add(0, buffer, 1, Access::kRemoteReadWrite);
  ExpectRevocationWaitsForHolder(table, *record,
                                 [&] { table.Revoke(*record); });
}

TEST(RegionTableTest, RevokeOwnedByWaitsForAHolderOfTheSharedLock) {
  RegionTable table;
  char buffer[1];
  auto record = table.Add(3, buffer, 1, Access::kRemoteReadWrite);
  ExpectRevocationWaitsForHolder(table, *record,
                                 [&] { table.RevokeOwnedBy(3); });
}

TEST(RegionTableTest, RevokeOwnedByRevokesOnlyThatOwnersRecords) {
  RegionTable table;
  char buffer[1];
  auto a1 = table.Add(1, buffer, 1, Access::kRemoteReadWrite);
  auto b = table.Add(2, buffer, 1, Access::kRemoteReadWrite);
  auto a2 = table.Add(1, buffer, 1, Access::kRemoteReadWrite);
  auto none = table.Add(0, buffer, 1, Access::kRemoteReadWrite);
  table.RevokeOwnedBy(1);
  EXPECT_EQ(table.Find(a1->id), nullptr);
  EXPECT_EQ(table.Find(a2->id), nullptr);
  EXPECT_FALSE(Live(*a1));
  EXPECT_FALSE(Live(*a2));
  EXPECT_EQ(table.Find(b->id), b);
  EXPECT_EQ(table.Find(none->id), none);
  EXPECT_TRUE(Live(*b));
  EXPECT_TRUE(Live(*none));
  // A record's own Revoke after its owner's is harmless.
  table.Revoke(*a1);
  EXPECT_FALSE(Live(*a1));
}

TEST(RegionTableTest, CheckAccessRefusesRangesOutsideAndDirectionsNotAllowed) {
  RegionTable table;
  char buffer[16];
  auto record = table.Add(0, buffer, sizeof(buffer), Access::kRemoteRead);
  EXPECT_TRUE(CheckAccess(*record, 0, 16, Access::kRemoteRead, "\"x\"").ok());
  EXPECT_TRUE(CheckAccess(*record, 16, 0, Access::kRemoteRead, "\"x\"").ok());
  const absl::Status outside =
      CheckAccess(*record, 8, 9, Access::kRemoteRead, "\"x\"");
  EXPECT_TRUE(absl::IsInvalidArgument(outside)) << outside;
  EXPECT_NE(outside.message().find("outside region"), absl::string_view::npos);
  EXPECT_NE(outside.message().find("\"x\""), absl::string_view::npos);
  EXPECT_TRUE(absl::IsInvalidArgument(
      CheckAccess(*record, 1, ~uint64_t{0}, Access::kRemoteRead, "\"x\"")));
  const absl::Status denied =
      CheckAccess(*record, 0, 1, Access::kRemoteWrite, "\"x\"");
  EXPECT_TRUE(absl::IsPermissionDenied(denied)) << denied;
  EXPECT_NE(denied.message().find("writes"), absl::string_view::npos);
  // The range is checked first.
  EXPECT_TRUE(absl::IsInvalidArgument(
      CheckAccess(*record, 0, 17, Access::kRemoteWrite, "\"x\"")));
}

}  // namespace
}  // namespace zeroshard::transport
