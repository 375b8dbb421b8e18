#include "transport/shm/push_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace zeroshard::transport {
namespace {

TEST(PushMemoryTest, APeerReadsWhatTheOwnerWritesInPlace) {
  absl::StatusOr<std::unique_ptr<PushMemory>> mine = PushMemory::Create(10000);
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_GE((*mine)->size(), 10000u);
  EXPECT_EQ((*mine)->size() % ::sysconf(_SC_PAGESIZE), 0u);
  EXPECT_EQ((*mine)->pid(), ::getpid());
  std::memset((*mine)->data(), 7, 100);
  absl::StatusOr<std::unique_ptr<PeerMemory>> peer =
      PeerMemory::Open((*mine)->pid(), (*mine)->fd(), (*mine)->name(), 10000);
  ASSERT_TRUE(peer.ok()) << peer.status();
  ASSERT_EQ((*peer)->bytes().size(), 10000u);
  EXPECT_NE((*peer)->bytes().data(), (*mine)->data());  // a mapping of its own
  EXPECT_EQ((*peer)->bytes()[99], 7);
  EXPECT_EQ((*peer)->bytes()[100], 0);
  static_cast<char*>((*mine)->data())[5000] = 42;  // later writes show through
  EXPECT_EQ((*peer)->bytes()[5000], 42);
  // The peer's mapping outlives the owner's.
  mine->reset();
  EXPECT_EQ((*peer)->bytes()[5000], 42);
}

TEST(PushMemoryTest, TwoMemoriesHaveDistinctSecretNames) {
  auto a = PushMemory::Create(1), b = PushMemory::Create(1);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE((*a)->name(), (*b)->name());
  EXPECT_EQ((*a)->name().size(), std::string("zeroshard-push-").size() + 32);
  EXPECT_LE((*a)->name().size(), kMaxPushMemoryName);
}

TEST(PushMemoryTest, ContainsSaysWhereARangeLies) {
  auto m = PushMemory::Create(4096);
  ASSERT_TRUE(m.ok());
  char* base = static_cast<char*>((*m)->data());
  uint64_t offset = 0;
  EXPECT_TRUE((*m)->Contains(base, (*m)->size(), &offset));
  EXPECT_EQ(offset, 0u);
  EXPECT_TRUE((*m)->Contains(base + 100, 10, &offset));
  EXPECT_EQ(offset, 100u);
  EXPECT_FALSE((*m)->Contains(base + 100, (*m)->size(), &offset));
  EXPECT_FALSE((*m)->Contains(base - 1, 1, &offset));
  char elsewhere[8];
  EXPECT_FALSE((*m)->Contains(elsewhere, sizeof(elsewhere), &offset));
}

TEST(PushMemoryTest, OpenRefusesWhatIsNotThatSealedMemory) {
  auto m = PushMemory::Create(4096);
  ASSERT_TRUE(m.ok());
  const pid_t pid = (*m)->pid();
  const int fd = (*m)->fd();
  const std::string& name = (*m)->name();
  // Another secret: the announcer did not create that memory.
  std::string other = name;
  other.back() = other.back() == '0' ? '1' : '0';
  EXPECT_EQ(PeerMemory::Open(pid, fd, other, 4096).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Longer than the memory.
  EXPECT_EQ(PeerMemory::Open(pid, fd, name, (*m)->size() + 1).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // A memfd of the right name that is not sealed could be truncated under
  // the reader.
  const int unsealed = ::memfd_create(name.c_str(), MFD_CLOEXEC);
  ASSERT_GE(unsealed, 0);
  ASSERT_EQ(::ftruncate(unsealed, 4096), 0);
  absl::Status s = PeerMemory::Open(pid, unsealed, name, 4096).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("sealed"), std::string::npos) << s;
  ::close(unsealed);
  // A FIFO in that fd's place is refused without blocking on it.
  int fifo[2];
  ASSERT_EQ(::pipe(fifo), 0);
  EXPECT_EQ(PeerMemory::Open(pid, fifo[0], name, 4096).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ::close(fifo[0]);
  ::close(fifo[1]);
  // An fd that is not open, a process that does not exist.
  EXPECT_EQ(PeerMemory::Open(pid, 1 << 20, name, 4096).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(PeerMemory::Open(INT32_MAX, fd, name, 4096).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Malformed arguments.
  EXPECT_EQ(PeerMemory::Open(0, fd, name, 4096).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PeerMemory::Open(pid, -1, name, 4096).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PeerMemory::Open(pid, fd, name, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PeerMemory::Open(pid, fd, "x", 4096).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PeerMemory::Open(pid, fd, "zeroshard-push-../../x", 4096).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PeerMemory::Open(pid, fd, std::string(100, 'z'), 4096).status().code(),
            absl::StatusCode::kInvalidArgument);
  // And the real one still opens.
  EXPECT_TRUE(PeerMemory::Open(pid, fd, name, 4096).ok());
}

TEST(PushMemoryTest, CreateRefusesZeroBytes) {
  EXPECT_EQ(PushMemory::Create(0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zeroshard::transport
