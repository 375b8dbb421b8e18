#include "server/disk/state_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/disk/instance_directory.h"

namespace zeroshard {
namespace {

using DirectIo = InstanceDirectory::DirectIo;
using Engine = StateFile::Engine;

constexpr size_t kMiB = size_t{1} << 20;

absl::Time Soon() { return absl::Now() + absl::Seconds(30); }

// A new directory of its own under the test's temporary directory.
std::string NewTempDir() {
  std::string pattern = ::testing::TempDir() + "state_XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    ADD_FAILURE() << "mkdtemp " << pattern << ": " << std::strerror(errno);
  }
  return pattern;
}

// State files (not locks) in `dir`.
std::vector<std::string> StateFilesIn(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (InstanceDirectory::IsInstanceFileName(name, InstanceDirectory::StateNaming().prefix) &&
        name.find(".lock") == std::string::npos) {
      names.push_back(name);
    }
  }
  ::closedir(d);
  return names;
}

// The bytes chunk `c` of a file holds: different for every chunk and offset.
void FillChunk(char* p, size_t bytes, uint64_t c) {
  for (size_t i = 0; i < bytes; i += 8) {
    const uint64_t v = (c + 1) * 0x9e3779b97f4a7c15ull ^ (i * 0x100000001b3ull);
    std::memcpy(p + i, &v, 8);
  }
}

bool ChunkIs(const char* p, size_t bytes, uint64_t c) {
  std::vector<char> want(bytes);
  FillChunk(want.data(), bytes, c);
  return std::memcmp(p, want.data(), bytes) == 0;
}

std::unique_ptr<InstanceDirectory> OpenDir(const std::string& path, DirectIo direct_io) {
  absl::StatusOr<std::unique_ptr<InstanceDirectory>> d =
      InstanceDirectory::Open(path, InstanceDirectory::StateNaming(), direct_io);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

// Eight chunks through four buffers, four transfers running at most: every
// Start past the fourth waits for room, and Waits come in any order.
class StateFileTest : public ::testing::TestWithParam<std::tuple<DirectIo, Engine>> {};

TEST_P(StateFileTest, WritesAndReadsBackThroughSeveralBuffers) {
  const auto [direct_io, engine] = GetParam();
  const std::string path = NewTempDir();
  std::unique_ptr<InstanceDirectory> dir = OpenDir(path, direct_io);
  ASSERT_NE(dir, nullptr);
  constexpr size_t kChunks = 8;
  constexpr size_t kBuffers = 4;
  constexpr size_t kChunk = kMiB;
  // Chunk c sits in buffer c % 4 at (c / 4) MiB: two chunks per buffer.
  auto buffer_of = [](size_t c) { return c % kBuffers; };
  auto at_of = [](size_t c) { return (c / kBuffers) * kChunk; };
  absl::StatusOr<std::unique_ptr<StateFile>> created =
      StateFile::Create(dir.get(), kChunks * kChunk, 2 * kChunk, kBuffers, /*queue_depth=*/4,
                        engine);
  ASSERT_TRUE(created.ok()) << created.status();
  StateFile& file = **created;
  std::printf("direct: %s, io_uring: %s\n", file.direct() ? "yes" : "no",
              file.io_uring() ? "yes" : "no");
  EXPECT_EQ(file.direct(), dir->direct());
  if (engine == Engine::kSynchronous) EXPECT_FALSE(file.io_uring());
  EXPECT_EQ(file.size(), kChunks * kChunk);
  EXPECT_EQ(file.buffers(), kBuffers);
  EXPECT_EQ(file.buffer_bytes(), 2 * kChunk);
  for (size_t b = 0; b < kBuffers; ++b) {
    ASSERT_NE(file.buffer(b), nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(file.buffer(b)) % StateFile::kAlignment, 0u);
  }
  EXPECT_EQ(file.buffer(kBuffers), nullptr);

  for (size_t c = 0; c < kChunks; ++c) FillChunk(file.buffer(buffer_of(c)) + at_of(c), kChunk, c);
  // All eight queued at once, then waited for last first.
  for (size_t c = 0; c < kChunks; ++c) {
    ASSERT_TRUE(file.StartWrite(100 + c, c * kChunk, buffer_of(c), at_of(c), kChunk, Soon()).ok());
  }
  EXPECT_EQ(file.in_flight(), kChunks);
  for (size_t c = kChunks; c-- > 0;) {
    const absl::Status s = file.Wait(100 + c, Soon());
    EXPECT_TRUE(s.ok()) << "chunk " << c << ": " << s;
  }
  EXPECT_EQ(file.in_flight(), 0u);

  for (size_t b = 0; b < kBuffers; ++b) std::memset(file.buffer(b), 0, file.buffer_bytes());
  // Pipelined: chunk c starts once chunk c - 4 has been waited for.
  for (size_t c = 0; c < kChunks; ++c) {
    if (c >= 4) {
      const absl::Status s = file.Wait(200 + c - 4, Soon());
      EXPECT_TRUE(s.ok()) << "chunk " << c - 4 << ": " << s;
    }
    ASSERT_TRUE(file.StartRead(200 + c, c * kChunk, buffer_of(c), at_of(c), kChunk, Soon()).ok());
  }
  EXPECT_EQ(file.in_flight(), 4u);
  EXPECT_TRUE(file.WaitAll(Soon()).ok());
  EXPECT_EQ(file.in_flight(), 0u);
  for (size_t c = 0; c < kChunks; ++c) {
    EXPECT_TRUE(ChunkIs(file.buffer(buffer_of(c)) + at_of(c), kChunk, c)) << "chunk " << c;
  }

  // The synchronous helpers, across a chunk boundary into another buffer.
  FillChunk(file.buffer(3), 2 * kChunk, 99);
  ASSERT_TRUE(file.Write(kChunk / 2, 3, 0, 2 * kChunk, Soon()).ok());
  std::memset(file.buffer(1), 0, file.buffer_bytes());
  ASSERT_TRUE(file.Read(kChunk / 2, 1, 0, 2 * kChunk, Soon()).ok());
  EXPECT_TRUE(ChunkIs(file.buffer(1), 2 * kChunk, 99));
  EXPECT_EQ(file.in_flight(), 0u);

  // A file made shorter behind its back: reading past its end is DataLoss.
  ASSERT_EQ(::truncate(file.path().c_str(), 4 * kChunk), 0);
  const absl::Status short_read = file.Read(6 * kChunk, 0, 0, kChunk, Soon());
  EXPECT_EQ(short_read.code(), absl::StatusCode::kDataLoss) << short_read;
  EXPECT_NE(short_read.message().find(file.path()), std::string::npos) << short_read;
  EXPECT_EQ(file.in_flight(), 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Modes, StateFileTest,
    ::testing::Combine(::testing::Values(DirectIo::kIfSupported, DirectIo::kNever),
                       ::testing::Values(Engine::kIoUring, Engine::kSynchronous)),
    [](const ::testing::TestParamInfo<StateFileTest::ParamType>& info) {
      return absl::StrCat(std::get<0>(info.param) == DirectIo::kNever ? "Buffered" : "Direct",
                          std::get<1>(info.param) == Engine::kIoUring ? "IoUring" : "Sync");
    });

TEST(StateFile, OwnerOnlyAllocatedAndRemovedByTheDestructor) {
  const std::string path = NewTempDir();
  std::unique_ptr<InstanceDirectory> dir = OpenDir(path, DirectIo::kIfSupported);
  ASSERT_NE(dir, nullptr);
  const mode_t old_umask = ::umask(0);  // the mode asked for, not the umask's
  absl::StatusOr<std::unique_ptr<StateFile>> file =
      StateFile::Create(dir.get(), 4 * kMiB, kMiB, 1, /*queue_depth=*/2);
  ::umask(old_umask);
  ASSERT_TRUE(file.ok()) << file.status();
  const std::string file_path = (*file)->path();
  EXPECT_EQ(file_path.rfind(path + "/zeroshard-state.", 0), 0u) << file_path;
  struct stat st;
  ASSERT_EQ(::lstat(file_path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), 4 * kMiB);
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, 4 * kMiB) << "blocks not allocated";
  EXPECT_EQ(StateFilesIn(path).size(), 1u);
  // A transfer left in flight is waited for by the destructor.
  ASSERT_TRUE((*file)->StartWrite(1, 0, 0, 0, kMiB, Soon()).ok());
  file->reset();
  EXPECT_NE(::lstat(file_path.c_str(), &st), 0);
  EXPECT_TRUE(StateFilesIn(path).empty());
}

TEST(StateFile, RefusesBadTransfersAndQueuesNothing) {
  const std::string path = NewTempDir();
  std::unique_ptr<InstanceDirectory> dir = OpenDir(path, DirectIo::kIfSupported);
  ASSERT_NE(dir, nullptr);
  absl::StatusOr<std::unique_ptr<StateFile>> created =
      StateFile::Create(dir.get(), 8 * kMiB, kMiB, 2, /*queue_depth=*/4);
  ASSERT_TRUE(created.ok()) << created.status();
  StateFile& file = **created;
  constexpr uint64_t kA = StateFile::kAlignment;
  ASSERT_TRUE(file.StartRead(7, 0, 0, 0, kA, Soon()).ok());
  struct Bad {
    const char* what;
    uint64_t id, offset;
    size_t buffer, at, length;
  };
  for (const Bad& b : std::vector<Bad>{
           {"misaligned offset", 1, 512, 0, 0, kA},
           {"misaligned length", 1, 0, 0, 0, kA + 512},
           {"misaligned buffer position", 1, 0, 0, 512, kA},
           {"length 0", 1, 0, 0, 0, 0},
           {"no such buffer", 1, 0, 2, 0, kA},
           {"past the buffer's end", 1, 0, 1, kMiB - kA, 2 * kA},
           {"position past the buffer", 1, 0, 1, kMiB + kA, kA},
           {"past the file's end", 1, 8 * kMiB - kA, 0, 0, 2 * kA},
           {"offset past the file", 1, 16 * kMiB, 0, 0, kA},
           {"offset that wraps", 1, ~uint64_t{0} - kA + 1, 0, 0, 2 * kA},
           {"an id in flight", 7, kA, 1, 0, kA},
       }) {
    for (bool write : {false, true}) {
      const absl::Status s =
          write ? file.StartWrite(b.id, b.offset, b.buffer, b.at, b.length, Soon())
                : file.StartRead(b.id, b.offset, b.buffer, b.at, b.length, Soon());
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b.what << ": " << s;
      EXPECT_NE(s.message().find(file.path()), std::string::npos) << s;
      EXPECT_EQ(file.in_flight(), 1u) << b.what;
    }
  }
  const absl::Status unknown = file.Wait(8, Soon());
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound) << unknown;
  EXPECT_TRUE(file.Wait(7, Soon()).ok());
  EXPECT_EQ(file.Wait(7, Soon()).code(), absl::StatusCode::kNotFound) << "waited for twice";
  EXPECT_EQ(file.in_flight(), 0u);
  EXPECT_TRUE(file.WaitAll(Soon()).ok()) << "nothing in flight";
}

TEST(StateFile, RefusesBadSizesAndLeavesNothing) {
  const std::string path = NewTempDir();
  std::unique_ptr<InstanceDirectory> dir = OpenDir(path, DirectIo::kIfSupported);
  ASSERT_NE(dir, nullptr);
  constexpr uint64_t kA = StateFile::kAlignment;
  struct Bad {
    const char* what;
    uint64_t bytes;
    size_t buffer_bytes, buffers;
  };
  for (const Bad& b : std::vector<Bad>{{"size 0", 0, kA, 1},
                                       {"misaligned size", kA + 1, kA, 1},
                                       {"buffer size 0", kA, 0, 1},
                                       {"misaligned buffer size", kA, kA / 2, 1},
                                       {"no buffers", kA, kA, 0}}) {
    absl::StatusOr<std::unique_ptr<StateFile>> f =
        StateFile::Create(dir.get(), b.bytes, b.buffer_bytes, b.buffers, 1);
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << b.what << ": "
                                                                    << f.status();
  }
  EXPECT_EQ(StateFile::Create(nullptr, kA, kA, 1, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(StateFilesIn(path).empty());
}

// A disk without room is found by Create, which leaves no file behind.
// RLIMIT_FSIZE stands in for a full disk (EFBIG, with SIGXFSZ ignored).
TEST(StateFile, FullDiskIsResourceExhaustedAtCreate) {
  const std::string path = NewTempDir();
  std::unique_ptr<InstanceDirectory> dir = OpenDir(path, DirectIo::kIfSupported);
  ASSERT_NE(dir, nullptr);
  struct rlimit old_limit;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  void (*old_handler)(int) = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old_limit;
  small.rlim_cur = kMiB;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  absl::StatusOr<std::unique_ptr<StateFile>> f =
      StateFile::Create(dir.get(), 64 * kMiB, kMiB, 2, /*queue_depth=*/4);
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kResourceExhausted) << f.status();
  EXPECT_NE(f.status().message().find(absl::StrCat("--state_dir ", path, " has no room")),
            std::string::npos)
      << f.status();
  EXPECT_NE(f.status().message().find(absl::StrCat(64 * kMiB, " bytes")), std::string::npos)
      << f.status();
  EXPECT_TRUE(StateFilesIn(path).empty());
}

}  // namespace
}  // namespace zeroshard
