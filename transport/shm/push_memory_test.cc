#include "transport/shm/push_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <vector>

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

// Each mapping starts at another page within 2 MiB, never at 0 (memories
// summed together at the same offsets are not read at one offset within
// 2 MiB, nor at that of the daemon's 2 MiB-aligned arrays).
TEST(PushMemoryTest, PeerMappingsStartAtDistinctOffsetsWithinTwoMiB) {
  absl::StatusOr<std::unique_ptr<PushMemory>> mine = PushMemory::Create(size_t{4} << 20);
  ASSERT_TRUE(mine.ok()) << mine.status();
  std::memset((*mine)->data(), 3, (*mine)->size());
  constexpr uintptr_t kStretch = uintptr_t{2} << 20;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  std::set<uintptr_t> offsets;
  std::vector<std::unique_ptr<PeerMemory>> peers;
  for (int i = 0; i < 8; ++i) {
    absl::StatusOr<std::unique_ptr<PeerMemory>> peer =
        PeerMemory::Open((*mine)->pid(), (*mine)->fd(), (*mine)->name(), (*mine)->size());
    ASSERT_TRUE(peer.ok()) << peer.status();
    const uintptr_t at = reinterpret_cast<uintptr_t>((*peer)->bytes().data());
    EXPECT_EQ(at % page, 0u);
    if (page < kStretch) EXPECT_NE(at % kStretch, 0u);
    offsets.insert(at % kStretch);
    ASSERT_EQ((*peer)->bytes().size(), (*mine)->size());
    EXPECT_EQ((*peer)->bytes().front(), 3);
    EXPECT_EQ((*peer)->bytes().back(), 3);
    peers.push_back(*std::move(peer));
  }
  if (page * 9 <= kStretch) EXPECT_EQ(offsets.size(), 8u);
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
  // A FIFO, or a file of another filesystem, in that fd's place is refused
  // before it is taken (its mount is not the memfds').
  int fifo[2];
  ASSERT_EQ(::pipe(fifo), 0);
  s = PeerMemory::Open(pid, fifo[0], name, 4096).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("is not a memfd"), std::string::npos) << s;
  ::close(fifo[0]);
  ::close(fifo[1]);
  const int file = ::open("/proc/self/status", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(file, 0);
  s = PeerMemory::Open(pid, file, name, 4096).status();
  EXPECT_NE(s.message().find("is not a memfd"), std::string::npos) << s;
  ::close(file);
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

// The daemon and the trainer are two processes: a child creates the
// memory and writes into it; this process maps it and reads that in place.
TEST(PushMemoryTest, AnotherProcesssMemoryIsReadInPlace) {
  int up[2], down[2];
  ASSERT_EQ(::pipe(up), 0);
  ASSERT_EQ(::pipe(down), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    absl::StatusOr<std::unique_ptr<PushMemory>> m = PushMemory::Create(4096);
    if (!m.ok()) ::_exit(1);
    std::memcpy((*m)->data(), "from the child", 14);
    const std::string line = absl::StrCat((*m)->fd(), " ", (*m)->name(), "\n");
    if (::write(up[1], line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
      ::_exit(2);
    }
    char done;
    ::read(down[0], &done, 1);  // keeps the memory until the parent has read it
    ::_exit(0);
  }
  char line[256] = {};
  ssize_t got = 0;
  while (got < static_cast<ssize_t>(sizeof(line)) - 1 && (got == 0 || line[got - 1] != '\n')) {
    const ssize_t n = ::read(up[0], line + got, sizeof(line) - 1 - got);
    if (n <= 0) break;
    got += n;
  }
  int fd = -1;
  char name[128] = {};
  ASSERT_EQ(std::sscanf(line, "%d %127s", &fd, name), 2) << line;
  absl::StatusOr<std::unique_ptr<PeerMemory>> peer = PeerMemory::Open(child, fd, name, 4096);
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ((*peer)->bytes().substr(0, 14), "from the child");
  ASSERT_EQ(::write(down[1], "x", 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  // The mapping outlives the child.
  EXPECT_EQ((*peer)->bytes().substr(0, 14), "from the child");
  for (int f : {up[0], up[1], down[0], down[1]}) ::close(f);
}

TEST(PushMemoryTest, CreateRefusesZeroBytes) {
  EXPECT_EQ(PushMemory::Create(0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zeroshard::transport
