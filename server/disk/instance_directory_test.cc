#include "server/disk/instance_directory.h"

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

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

InstanceDirectory::Naming Spill() { return InstanceDirectory::SpillNaming(); }

bool IsSpillName(absl::string_view name) {
  return InstanceDirectory::IsInstanceFileName(name, Spill().prefix);
}

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

TEST(InstanceDirectory, NamesAreRecognisable) {
  EXPECT_TRUE(IsSpillName("zeroshard-spill.0123456789abcdef.lock"));
  EXPECT_TRUE(IsSpillName("zeroshard-spill.0123456789abcdef.17"));
  EXPECT_TRUE(IsSpillName("zeroshard-spill.0123456789abcdef.lock.new"));
  for (const char* other :
       {"zeroshard-spill.0123456789ABCDEF.1", "zeroshard-spill.0123456789abcde.1",
        "zeroshard-spill.0123456789abcdef.", "zeroshard-spill.0123456789abcdef.1x",
        "zeroshard-spill.0123456789abcdef.lock2", "zeroshard-spill.0123456789abcdefX1",
        "notes.txt", "zeroshard-spill.", "MANIFEST"}) {
    EXPECT_FALSE(IsSpillName(other)) << other;
  }
}

// A killed daemon's files go at the next start; a live daemon's files and
// everything that is not a spill file stay.
TEST(InstanceDirectory, RemovesOnlyTheFilesOfDeadInstances) {
  const std::string dir = TempDir("spill_leftovers");
  absl::StatusOr<std::unique_ptr<InstanceDirectory>> live = InstanceDirectory::Open(dir, Spill());
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

  absl::StatusOr<std::unique_ptr<InstanceDirectory>> second = InstanceDirectory::Open(dir, Spill());
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

TEST(InstanceDirectory, ProbesDirectIoOrUsesBufferedIo) {
  const std::string dir = TempDir("spill_modes");
  absl::StatusOr<std::unique_ptr<InstanceDirectory>> probed = InstanceDirectory::Open(dir, Spill());
  ASSERT_TRUE(probed.ok()) << probed.status();
  std::printf("O_DIRECT in %s: %s\n", dir.c_str(), (*probed)->direct() ? "yes" : "no (buffered)");
  absl::StatusOr<std::unique_ptr<InstanceDirectory>> buffered =
      InstanceDirectory::Open(dir, Spill(), InstanceDirectory::DirectIo::kNever);
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

TEST(InstanceDirectory, RefusesAnUnusableDirectory) {
  EXPECT_EQ(InstanceDirectory::Open("", Spill()).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::string file = TempDir("spill_not_a_dir") + "/file";
  Touch(file);
  absl::StatusOr<std::unique_ptr<InstanceDirectory>> d = InstanceDirectory::Open(file, Spill());
  EXPECT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("--spill_dir"), std::string::npos) << d.status();
}

mode_t ModeOf(const std::string& path) {
  struct stat st;
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

TEST(InstanceDirectory, DirectoriesAndFilesAreOwnerOnly) {
  const std::string base = TempDir("spill_modes_owner");
  const mode_t old_umask = ::umask(0);  // the modes asked for, not the umask's
  absl::StatusOr<std::unique_ptr<InstanceDirectory>> d =
      InstanceDirectory::Open(base + "/a/b", Spill());
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
TEST(InstanceDirectory, NewFilesRefuseAPlantedLink) {
  const std::string base = TempDir("spill_planted");
  const std::string victim = base + "/victim";
  Touch(victim);
  absl::StatusOr<std::unique_ptr<InstanceDirectory>> d =
      InstanceDirectory::Open(base + "/dir", Spill(), InstanceDirectory::DirectIo::kNever);
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

TEST(InstanceDirectory, RefusesADirectoryOthersCanWrite) {
  const std::string dir = TempDir("spill_open_to_all");
  ASSERT_EQ(::chmod(dir.c_str(), 0777), 0);
  absl::StatusOr<std::unique_ptr<InstanceDirectory>> d = InstanceDirectory::Open(dir, Spill());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition) << d.status();
  EXPECT_NE(d.status().message().find(
                absl::StrCat("--spill_dir: ", dir, " is writable by group or others")),
            std::string::npos)
      << d.status();
  EXPECT_NE(d.status().message().find(absl::StrCat("chmod go-w ", dir)), std::string::npos)
      << d.status();
  EXPECT_TRUE(List(dir).empty()) << "nothing is created in a refused directory";
}

TEST(InstanceDirectory, RefusesADirectoryOfAnotherUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to make a directory of uid 65534";
  const std::string dir = TempDir("spill_of_nobody");
  ASSERT_EQ(::chown(dir.c_str(), 65534, 65534), 0);
  absl::StatusOr<std::unique_ptr<InstanceDirectory>> d = InstanceDirectory::Open(dir, Spill());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition) << d.status();
  EXPECT_NE(d.status().message().find(absl::StrCat(dir, " is owned by uid 65534")),
            std::string::npos)
      << d.status();
  EXPECT_TRUE(List(dir).empty()) << "nothing is created in a refused directory";
}

// Spill files and state files in one directory: each kind's instances see
// only their own names, and every message names its own flag.
TEST(InstanceDirectory, TwoNamingsShareADirectory) {
  const std::string dir = TempDir("two_namings");
  EXPECT_TRUE(InstanceDirectory::IsInstanceFileName("zeroshard-state.0123456789abcdef.3",
                                                    InstanceDirectory::StateNaming().prefix));
  EXPECT_FALSE(IsSpillName("zeroshard-state.0123456789abcdef.3"));
  EXPECT_FALSE(InstanceDirectory::IsInstanceFileName("zeroshard-spill.0123456789abcdef.3",
                                                     InstanceDirectory::StateNaming().prefix));
  // A dead spill instance and a dead state instance.
  Touch(absl::StrCat(dir, "/zeroshard-spill.00000000deadbeef.lock"));
  Touch(absl::StrCat(dir, "/zeroshard-spill.00000000deadbeef.1"));
  Touch(absl::StrCat(dir, "/zeroshard-state.00000000deadbeef.lock"));
  Touch(absl::StrCat(dir, "/zeroshard-state.00000000deadbeef.1"));
  absl::StatusOr<std::unique_ptr<InstanceDirectory>> state =
      InstanceDirectory::Open(dir, InstanceDirectory::StateNaming(),
                              InstanceDirectory::DirectIo::kNever);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ((*state)->removed_at_open(), 2u);
  EXPECT_EQ((*state)->naming().flag, "--state_dir");
  std::set<std::string> left = List(dir);
  EXPECT_EQ(left.count("zeroshard-spill.00000000deadbeef.lock"), 1u);
  EXPECT_EQ(left.count("zeroshard-spill.00000000deadbeef.1"), 1u);
  EXPECT_EQ(left.count("zeroshard-state.00000000deadbeef.1"), 0u);
  const std::string state_file = (*state)->NewPath();
  EXPECT_EQ(state_file.rfind(dir + "/zeroshard-state.", 0), 0u) << state_file;
  absl::StatusOr<int> fd = (*state)->OpenForReadWrite(state_file);
  ASSERT_TRUE(fd.ok()) << fd.status();
  ASSERT_EQ(::write(*fd, "x", 1), 1);
  ::close(*fd);
  // The new state file is a live instance's: a spill instance leaves it.
  absl::StatusOr<std::unique_ptr<InstanceDirectory>> spill = InstanceDirectory::Open(dir, Spill());
  ASSERT_TRUE(spill.ok()) << spill.status();
  EXPECT_EQ((*spill)->removed_at_open(), 2u);
  left = List(dir);
  EXPECT_EQ(left.count(state_file.substr(dir.size() + 1)), 1u);
  // A second open of a new file at the same path is refused, naming the flag.
  absl::StatusOr<int> again = (*state)->OpenForReadWrite(state_file);
  EXPECT_FALSE(again.ok());
  EXPECT_EQ(again.status().message().rfind("--state_dir: ", 0), 0u) << again.status();
  state->reset();
  spill->reset();
  EXPECT_TRUE(List(dir).empty());
}

TEST(InstanceDirectory, RefusesANamingWithoutAFlagOrPrefix) {
  const std::string dir = TempDir("bad_naming");
  EXPECT_EQ(InstanceDirectory::Open(dir, {"", "zeroshard-x.", "x"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(InstanceDirectory::Open(dir, {"--x_dir", "", "x"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(InstanceDirectory::Open(dir, {"--x_dir", "a/b.", "x"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<InstanceDirectory>> d =
      InstanceDirectory::Open("", InstanceDirectory::StateNaming());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(d.status().message().rfind("--state_dir: ", 0), 0u) << d.status();
  EXPECT_TRUE(List(dir).empty());
}

}  // namespace
}  // namespace zeroshard
