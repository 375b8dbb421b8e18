#include "server/activation/activation_spill.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "server/disk/instance_directory.h"

namespace zeroshard {
namespace {

std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(base != nullptr ? base : "/tmp", "/", name);
  ::mkdir(dir.c_str(), 0700);
  return dir;
}

// Writes and reads back through io_uring, in the directory's mode, with more
// operations than the ring holds at once.
class SpillIoTest : public ::testing::TestWithParam<InstanceDirectory::DirectIo> {
 protected:
  // The directory `name` in the test's mode, and a ring of `queue_depth`.
  void Open(const std::string& name, unsigned queue_depth) {
    absl::StatusOr<std::unique_ptr<InstanceDirectory>> d =
        InstanceDirectory::Open(TempDir(name), InstanceDirectory::SpillNaming(), GetParam());
    ASSERT_TRUE(d.ok()) << d.status();
    dir_ = *std::move(d);
    absl::StatusOr<std::unique_ptr<SpillIo>> io = SpillIo::Create(queue_depth);
    ASSERT_TRUE(io.ok()) << io.status();
    io_ = *std::move(io);
  }
  std::unique_ptr<InstanceDirectory> dir_;
  std::unique_ptr<SpillIo> io_;
};

TEST_P(SpillIoTest, WritesAndReadsBackManyFilesConcurrently) {
  ASSERT_NO_FATAL_FAILURE(Open("spill_io", /*queue_depth=*/2));
  InstanceDirectory* const d = dir_.get();
  SpillIo* const io = io_.get();
  constexpr int kFiles = 9;
  constexpr size_t kBytes = (3 << 20) + 8192;  // a multiple of the direct-I/O block
  void* out_memory = std::aligned_alloc(InstanceDirectory::kDirectAlignment, kFiles * kBytes);
  void* in_memory = std::aligned_alloc(InstanceDirectory::kDirectAlignment, kFiles * kBytes);
  char* out = static_cast<char*>(out_memory);
  char* in = static_cast<char*>(in_memory);
  for (size_t i = 0; i < kFiles * kBytes; ++i) out[i] = static_cast<char>(i * 131 + i / 4099);
  std::memset(in, 0, kFiles * kBytes);
  std::vector<std::string> paths;
  {
    absl::BlockingCounter written(kFiles);
    std::vector<absl::Status> results(kFiles);
    for (int f = 0; f < kFiles; ++f) {
      paths.push_back(d->NewPath());
      absl::StatusOr<int> fd = d->OpenForWrite(paths.back());
      ASSERT_TRUE(fd.ok()) << fd.status();
      const int file = *fd;
      ASSERT_TRUE(io->Write(file, out + f * kBytes, kBytes, absl::Now() + absl::Seconds(30),
                            [&, f, file](absl::Status s) {
                              ::close(file);
                              results[f] = s;
                              written.DecrementCount();
                            })
                      .ok());
    }
    written.Wait();
    for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;
  }
  {
    absl::BlockingCounter read(kFiles);
    std::vector<absl::Status> results(kFiles);
    for (int f = 0; f < kFiles; ++f) {
      absl::StatusOr<int> fd = d->OpenForRead(paths[f]);
      ASSERT_TRUE(fd.ok()) << fd.status();
      const int file = *fd;
      ASSERT_TRUE(io->Read(file, in + f * kBytes, kBytes, absl::Now() + absl::Seconds(30),
                           [&, f, file](absl::Status s) {
                             ::close(file);
                             results[f] = s;
                             read.DecrementCount();
                           })
                      .ok());
    }
    read.Wait();
    for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;
  }
  EXPECT_EQ(std::memcmp(out, in, kFiles * kBytes), 0);
  EXPECT_EQ(io->in_flight(), 0u);

  // A file shorter than the read: DataLoss, never a silent short read.
  absl::StatusOr<int> fd = d->OpenForRead(paths[0]);
  ASSERT_TRUE(fd.ok());
  const int shorten = ::open(paths[0].c_str(), O_WRONLY);
  ASSERT_EQ(::ftruncate(shorten, 4096), 0);
  ::close(shorten);
  absl::Notification done;
  absl::Status short_read;
  ASSERT_TRUE(io->Read(*fd, in, kBytes, absl::Now() + absl::Seconds(30), [&](absl::Status s) {
                  short_read = s;
                  done.Notify();
                }).ok());
  done.WaitForNotification();
  ::close(*fd);
  EXPECT_EQ(short_read.code(), absl::StatusCode::kDataLoss) << short_read;
  EXPECT_EQ(io->Read(*fd, in, 0, absl::Now(), [](absl::Status) {}).code(),
            absl::StatusCode::kInvalidArgument);
  for (const std::string& p : paths) d->Remove(p);
  std::free(out_memory);
  std::free(in_memory);
}

INSTANTIATE_TEST_SUITE_P(Modes, SpillIoTest,
                         ::testing::Values(InstanceDirectory::DirectIo::kIfSupported,
                                           InstanceDirectory::DirectIo::kNever));

// The threads that queue I/O come and go (RPC handlers, trainers' ranks):
// an operation queued by a thread that exits at once still completes. (The
// kernel cancels io_uring requests of a thread that exits while they run in
// its workers, so the ring's own thread issues them.)
TEST_P(SpillIoTest, OperationsOutliveTheThreadsThatQueuedThem) {
  ASSERT_NO_FATAL_FAILURE(Open("spill_io_threads", /*queue_depth=*/8));
  InstanceDirectory* const d = dir_.get();
  SpillIo* const io = io_.get();
  constexpr int kFiles = 8;
  constexpr size_t kBytes = size_t{16} << 20;
  void* memory = std::aligned_alloc(InstanceDirectory::kDirectAlignment, kBytes);
  std::memset(memory, 0x5a, kBytes);
  absl::BlockingCounter written(kFiles);
  std::vector<absl::Status> results(kFiles);
  std::vector<std::string> paths(kFiles);
  for (int f = 0; f < kFiles; ++f) {
    paths[f] = d->NewPath();
    std::thread([&, f] {
      absl::StatusOr<int> fd = d->OpenForWrite(paths[f]);
      if (!fd.ok()) {
        results[f] = fd.status();
        written.DecrementCount();
        return;
      }
      const int file = *fd;
      absl::Status queued = io->Write(file, memory, kBytes, absl::Now() + absl::Seconds(60),
                                      [&, f, file](absl::Status s) {
                                        ::close(file);
                                        results[f] = s;
                                        written.DecrementCount();
                                      });
      if (!queued.ok()) {
        ::close(file);
        results[f] = queued;
        written.DecrementCount();
      }
    }).join();  // the thread is gone while its write runs
  }
  written.Wait();
  for (int f = 0; f < kFiles; ++f)
    EXPECT_TRUE(results[f].ok()) << "file " << f << ": " << results[f];
  for (const std::string& p : paths) d->Remove(p);
  std::free(memory);
}

// A write that fails (a bad descriptor here) reports its errno, and the
// ring keeps working.
TEST(SpillIo, ReportsErrors) {
  absl::StatusOr<std::unique_ptr<SpillIo>> io = SpillIo::Create(4);
  ASSERT_TRUE(io.ok()) << io.status();
  char buffer[64] = {};
  absl::Notification done;
  absl::Status status;
  ASSERT_TRUE((*io)->Write(/*fd=*/-1, buffer, sizeof(buffer), absl::Now() + absl::Seconds(10),
                           [&](absl::Status s) {
                             status = s;
                             done.Notify();
                           })
                  .ok());
  done.WaitForNotification();
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("spill write"), std::string::npos) << status;
}

}  // namespace
}  // namespace zeroshard
