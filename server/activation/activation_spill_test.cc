#include "server/activation/activation_spill.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(base != nullptr ? base : "/tmp", "/", name);
  ::mkdir(dir.c_str(), 0700);
  return dir;
}

std::set<std::string> List(const std::string& dir) {
  std::set<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return names;
  while (const dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
      names.insert(e->d_name);
    }
  }
  ::closedir(d);
  return names;
}

void Touch(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::write(fd, "x", 1), 1);
  ::close(fd);
}

TEST(SpillDirectory, NamesAreRecognisable) {
  EXPECT_TRUE(SpillDirectory::IsSpillName("zeroshard-spill.0123456789abcdef.lock"));
  EXPECT_TRUE(SpillDirectory::IsSpillName("zeroshard-spill.0123456789abcdef.17"));
  EXPECT_TRUE(SpillDirectory::IsSpillName("zeroshard-spill.0123456789abcdef.lock.new"));
  for (const char* other :
       {"zeroshard-spill.0123456789ABCDEF.1", "zeroshard-spill.0123456789abcde.1",
        "zeroshard-spill.0123456789abcdef.", "zeroshard-spill.0123456789abcdef.1x",
        "zeroshard-spill.0123456789abcdef.lock2", "zeroshard-spill.0123456789abcdefX1",
        "notes.txt", "zeroshard-spill.", "MANIFEST"}) {
    EXPECT_FALSE(SpillDirectory::IsSpillName(other)) << other;
  }
}

// A killed daemon's files go at the next start; a live daemon's files and
// everything that is not a spill file stay.
TEST(SpillDirectory, RemovesOnlyTheFilesOfDeadInstances) {
  const std::string dir = TempDir("spill_leftovers");
  absl::StatusOr<std::unique_ptr<SpillDirectory>> live = SpillDirectory::Open(dir);
  ASSERT_TRUE(live.ok()) << live.status();
  const std::string live_file = (*live)->NewPath();
  Touch(live_file);
  // A dead instance: its lock exists but nobody holds it.
  const std::string dead = "zeroshard-spill.00000000deadbeef";
  Touch(absl::StrCat(dir, "/", dead, ".lock"));
  Touch(absl::StrCat(dir, "/", dead, ".1"));
  Touch(absl::StrCat(dir, "/", dead, ".22"));
  // An orphan: files without any lock.
  Touch(absl::StrCat(dir, "/zeroshard-spill.0000000000000abc.5"));
  // Not ours to touch.
  Touch(absl::StrCat(dir, "/notes.txt"));
  Touch(absl::StrCat(dir, "/zeroshard-spill.bad"));
  // A lock held by someone else (another process would hold it like this).
  const std::string held = absl::StrCat(dir, "/zeroshard-spill.00000000000000ff.lock");
  Touch(held);
  const int held_fd = ::open(held.c_str(), O_RDONLY);
  ASSERT_EQ(::flock(held_fd, LOCK_EX | LOCK_NB), 0);
  Touch(absl::StrCat(dir, "/zeroshard-spill.00000000000000ff.3"));

  absl::StatusOr<std::unique_ptr<SpillDirectory>> second = SpillDirectory::Open(dir);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ((*second)->removed_at_open(), 4u);  // 2 dead files, the dead lock, the orphan
  const std::set<std::string> left = List(dir);
  EXPECT_EQ(left.count(dead + ".lock"), 0u);
  EXPECT_EQ(left.count(dead + ".1"), 0u);
  EXPECT_EQ(left.count(dead + ".22"), 0u);
  EXPECT_EQ(left.count("zeroshard-spill.0000000000000abc.5"), 0u);
  EXPECT_EQ(left.count("notes.txt"), 1u);
  EXPECT_EQ(left.count("zeroshard-spill.bad"), 1u);
  EXPECT_EQ(left.count("zeroshard-spill.00000000000000ff.lock"), 1u);
  EXPECT_EQ(left.count("zeroshard-spill.00000000000000ff.3"), 1u);
  EXPECT_EQ(left.count(live_file.substr(dir.size() + 1)), 1u);
  ::close(held_fd);

  // Closing removes an instance's files and its lock, nothing else.
  live->reset();
  second->reset();
  const std::set<std::string> after = List(dir);
  EXPECT_EQ(after.count(live_file.substr(dir.size() + 1)), 0u);
  for (const std::string& name : after) {
    EXPECT_TRUE(name == "notes.txt" || name == "zeroshard-spill.bad" ||
                name.rfind("zeroshard-spill.00000000000000ff.", 0) == 0)
        << name;
  }
}

TEST(SpillDirectory, ProbesDirectIoOrUsesBufferedIo) {
  const std::string dir = TempDir("spill_modes");
  absl::StatusOr<std::unique_ptr<SpillDirectory>> probed = SpillDirectory::Open(dir);
  ASSERT_TRUE(probed.ok()) << probed.status();
  std::printf("O_DIRECT in %s: %s\n", dir.c_str(), (*probed)->direct() ? "yes" : "no (buffered)");
  absl::StatusOr<std::unique_ptr<SpillDirectory>> buffered =
      SpillDirectory::Open(dir, SpillDirectory::DirectIo::kNever);
  ASSERT_TRUE(buffered.ok()) << buffered.status();
  EXPECT_FALSE((*buffered)->direct());
  absl::StatusOr<int> fd = (*buffered)->OpenForWrite((*buffered)->NewPath());
  ASSERT_TRUE(fd.ok()) << fd.status();
  // Buffered files take any length at any address.
  ASSERT_EQ(::write(*fd, "odd", 3), 3);
  ::close(*fd);
  probed->reset();
  buffered->reset();
  EXPECT_EQ(List(dir).size(), 0u);
}

TEST(SpillDirectory, RefusesAnUnusableDirectory) {
  EXPECT_EQ(SpillDirectory::Open("").status().code(), absl::StatusCode::kInvalidArgument);
  const std::string file = TempDir("spill_not_a_dir") + "/file";
  Touch(file);
  absl::StatusOr<std::unique_ptr<SpillDirectory>> d = SpillDirectory::Open(file);
  EXPECT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("--spill_dir"), std::string::npos) << d.status();
}

mode_t ModeOf(const std::string& path) {
  struct stat st;
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

TEST(SpillDirectory, DirectoriesAndFilesAreOwnerOnly) {
  const std::string base = TempDir("spill_modes_owner");
  const mode_t old_umask = ::umask(0);  // the modes asked for, not the umask's
  absl::StatusOr<std::unique_ptr<SpillDirectory>> d = SpillDirectory::Open(base + "/a/b");
  absl::StatusOr<int> fd = d.ok() ? (*d)->OpenForWrite((*d)->NewPath()) : d.status();
  ::umask(old_umask);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(fd.ok()) << fd.status();
  ::close(*fd);
  EXPECT_EQ(ModeOf(base + "/a"), 0700u);
  EXPECT_EQ(ModeOf(base + "/a/b"), 0700u);
  for (const std::string& name : List(base + "/a/b")) {
    EXPECT_EQ(ModeOf(base + "/a/b/" + name), 0600u) << name;
  }
}

// A link planted at a spill file's name is neither followed nor truncated.
TEST(SpillDirectory, NewFilesRefuseAPlantedLink) {
  const std::string base = TempDir("spill_planted");
  const std::string victim = base + "/victim";
  Touch(victim);
  absl::StatusOr<std::unique_ptr<SpillDirectory>> d =
      SpillDirectory::Open(base + "/dir", SpillDirectory::DirectIo::kNever);
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string path = (*d)->NewPath();
  ASSERT_EQ(::symlink(victim.c_str(), path.c_str()), 0);
  absl::StatusOr<int> w = (*d)->OpenForWrite(path);
  EXPECT_FALSE(w.ok());
  if (w.ok()) ::close(*w);
  EXPECT_NE(w.status().message().find(path), std::string::npos) << w.status();
  absl::StatusOr<int> r = (*d)->OpenForRead(path);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  if (r.ok()) ::close(*r);
  struct stat st;
  ASSERT_EQ(::stat(victim.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 1) << "the link's target was truncated";
}

TEST(SpillDirectory, RefusesADirectoryOthersCanWrite) {
  const std::string dir = TempDir("spill_open_to_all");
  ASSERT_EQ(::chmod(dir.c_str(), 0777), 0);
  absl::StatusOr<std::unique_ptr<SpillDirectory>> d = SpillDirectory::Open(dir);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition) << d.status();
  EXPECT_NE(d.status().message().find(
                absl::StrCat("--spill_dir: ", dir, " is writable by group or others")),
            std::string::npos)
      << d.status();
  EXPECT_NE(d.status().message().find(absl::StrCat("chmod go-w ", dir)), std::string::npos)
      << d.status();
  EXPECT_TRUE(List(dir).empty()) << "nothing is created in a refused directory";
}

TEST(SpillDirectory, RefusesADirectoryOfAnotherUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to make a directory of uid 65534";
  const std::string dir = TempDir("spill_of_nobody");
  ASSERT_EQ(::chown(dir.c_str(), 65534, 65534), 0);
  absl::StatusOr<std::unique_ptr<SpillDirectory>> d = SpillDirectory::Open(dir);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition) << d.status();
  EXPECT_NE(d.status().message().find(absl::StrCat(dir, " is owned by uid 65534")),
            std::string::npos)
      << d.status();
  EXPECT_TRUE(List(dir).empty()) << "nothing is created in a refused directory";
}

// Writes and reads back through io_uring, in the directory's mode, with more
// operations than the ring holds at once.
class SpillIoTest : public ::testing::TestWithParam<SpillDirectory::DirectIo> {
 protected:
  // The directory `name` in the test's mode, and a ring of `queue_depth`.
  void Open(const std::string& name, unsigned queue_depth) {
    absl::StatusOr<std::unique_ptr<SpillDirectory>> d =
        SpillDirectory::Open(TempDir(name), GetParam());
    ASSERT_TRUE(d.ok()) << d.status();
    dir_ = *std::move(d);
    absl::StatusOr<std::unique_ptr<SpillIo>> io = SpillIo::Create(queue_depth);
    ASSERT_TRUE(io.ok()) << io.status();
    io_ = *std::move(io);
  }
  std::unique_ptr<SpillDirectory> dir_;
  std::unique_ptr<SpillIo> io_;
};

TEST_P(SpillIoTest, WritesAndReadsBackManyFilesConcurrently) {
  ASSERT_NO_FATAL_FAILURE(Open("spill_io", /*queue_depth=*/2));
  SpillDirectory* const d = dir_.get();
  SpillIo* const io = io_.get();
  constexpr int kFiles = 9;
  constexpr size_t kBytes = (3 << 20) + 8192;  // a multiple of the direct-I/O block
  void* out_memory = std::aligned_alloc(SpillDirectory::kDirectAlignment, kFiles * kBytes);
  void* in_memory = std::aligned_alloc(SpillDirectory::kDirectAlignment, kFiles * kBytes);
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
  for (const std::string& p : paths) SpillDirectory::Remove(p);
  std::free(out_memory);
  std::free(in_memory);
}

INSTANTIATE_TEST_SUITE_P(Modes, SpillIoTest,
                         ::testing::Values(SpillDirectory::DirectIo::kIfSupported,
                                           SpillDirectory::DirectIo::kNever));

// The threads that queue I/O come and go (RPC handlers, trainers' ranks):
// an operation queued by a thread that exits at once still completes. (The
// kernel cancels io_uring requests of a thread that exits while they run in
// its workers, so the ring's own thread issues them.)
TEST_P(SpillIoTest, OperationsOutliveTheThreadsThatQueuedThem) {
  ASSERT_NO_FATAL_FAILURE(Open("spill_io_threads", /*queue_depth=*/8));
  SpillDirectory* const d = dir_.get();
  SpillIo* const io = io_.get();
  constexpr int kFiles = 8;
  constexpr size_t kBytes = size_t{16} << 20;
  void* memory = std::aligned_alloc(SpillDirectory::kDirectAlignment, kBytes);
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
  for (const std::string& p : paths) SpillDirectory::Remove(p);
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
